"""What the installed torch and transformers offer, decided once, where treadle's supported range differs.

treadle supports torch 2.11 through 2.15 and transformers 5.17 through the newest tested (pyproject.toml). An API
that appeared inside that range is looked up here, by feature and not by version number, so a backport or a
nightly answers for itself; the code that uses it takes a fallback with the same numbers, or refuses in one line
naming the release that has it. docs/training.md "Versions" lists each one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from treadle.errors import UserError

# torch 2.13: the fused chunked ``F.linear_cross_entropy``. Older: models/chunked_ce.py's own chunked op.
HAS_LINEAR_CROSS_ENTROPY = hasattr(F, "linear_cross_entropy")

# FSDP2 trains a draft beside a frozen target from torch 2.13 on; under 2.11 the run fails in backward (the frozen
# root weights freed after forward: "setStorage ... storage of size 0") or leaves the draft unchanged. A fixed bug,
# not an API, so the only probe is the version (2.12 untested: refused with 2.11).
FSDP2_TRAINS_DRAFTS = TorchVersion(torch.__version__) >= (2, 13)


def gemma4_kv_sharing() -> bool:
    """transformers 5.23: Gemma 4's config says which layer stores the K/V its shared layers reuse
    (``kv_sharing_modes``), which the frozen_kv kind (Gemma 4's assistant) reads. Older: that kind is refused."""
    from transformers import Gemma4TextConfig

    return hasattr(Gemma4TextConfig, "kv_sharing_modes")


def require(available: bool, feature: str, needs: str, remedy: str) -> None:
    """Refuse ``feature`` in one line when the installed release lacks it: ``needs`` names the release that has it
    ("transformers >= 5.23"), ``remedy`` what else is accepted."""
    if not available:
        raise UserError(f"{feature} needs {needs} (installed: torch {torch.__version__}, transformers "
                        f"{_transformers_version()}); accepted: {remedy}")


def require_model_type(path, key: str) -> None:
    """Refuse, in one line naming the installed transformers, a model directory whose ``config.json`` names a
    ``model_type`` that release does not know (Mistral Large 4 is in 5.24, not 5.17), instead of transformers'
    "does not recognize this architecture" deep inside a load. Other problems are left to the loader's own line."""
    import json
    from pathlib import Path

    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if isinstance(model_type, str) and model_type and model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(f"{key} {path}: model_type {model_type!r} is not a model the installed transformers "
                        f"{_transformers_version()} has; accepted: a transformers release that has it (treadle "
                        f"supports transformers {_supported('transformers')}), or a model of a type this one has")


def _supported(name: str) -> str:
    from packaging.requirements import Requirement

    from treadle.versions import requirements, spec

    found = [Requirement(r) for r in requirements() if Requirement(r).name == name]
    return spec(found[0]) if found else "(see pyproject.toml)"


def _transformers_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "not installed"
