"""treadle: a PyTorch training loop for LLMs and their speculative-decoding draft models.

The Python API (``treadle.api``) is exported lazily (PEP 562): ``import treadle`` imports
neither torch nor transformers, so ``treadle --help`` and ``python -m treadle`` stay fast,
and the package changes nothing in its host process (no warnings filters, no threads).
"""

import importlib as _importlib

__version__ = "0.1.0"

__all__ = ["Callback", "Config", "DraftTrainer", "RunSummary", "UserError", "export", "fit", "generate", "load_config",
           "spec_eval"]


def __getattr__(name: str):
    if name in __all__:  # treadle.api imports torch only when Callback or RunSummary is asked for, or a run starts
        return getattr(_importlib.import_module("treadle.api"), name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
