"""treadle: a PyTorch training loop for LLMs and their speculative-decoding draft models.

The Python API (``treadle.api``) is exported lazily (PEP 562): ``import treadle`` imports
neither torch nor transformers, so ``treadle --help`` and ``python -m treadle`` stay fast,
and the package changes nothing in its host process (no warnings filters, no threads).
"""

import importlib

__version__ = "0.1.0"

__all__ = ["Callback", "Config", "RunSummary", "UserError", "export", "generate", "load_config", "spec_eval", "train"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("treadle.api"), name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
