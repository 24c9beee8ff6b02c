"""What the installed torch and transformers offer, decided once, where treadle's supported range differs.

treadle supports torch 2.11 through 2.15 and transformers 5.17 through the newest tested (pyproject.toml). An API
that appeared inside that range is looked up here, by feature and not by version number, so a backport or a
nightly answers for itself; the code that uses it takes a fallback with the same numbers, or refuses in one line
naming the release that has it (``require``). docs/training.md "Versions" lists each one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.errors import UserError

# torch 2.13: the fused chunked ``F.linear_cross_entropy``. Older: models/chunked_ce.py's own chunked op.
HAS_LINEAR_CROSS_ENTROPY = hasattr(F, "linear_cross_entropy")


def require(available: bool, feature: str, needs: str, remedy: str) -> None:
    """Refuse ``feature`` in one line when the installed release lacks it: ``needs`` names the release that has
    it ("torch >= 2.13"), ``remedy`` what the user can do instead."""
    if not available:
        raise UserError(f"{feature} needs {needs} (installed: torch {torch.__version__}, transformers "
                        f"{_transformers_version()}); {remedy}")


def _transformers_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "not installed"
