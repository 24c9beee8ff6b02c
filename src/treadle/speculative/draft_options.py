"""What ``treadle spec-eval`` refuses before anything loads: a ``--draft`` that names nothing it takes, and the options
the draft it names would refuse at decode time (read from its config.json: seconds, not a traceback after the load).
Plain Python at import: torch and the models load in speculative/evaluate.py when a function runs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from treadle.errors import UserError
from treadle.model_dirs import download_hint

if TYPE_CHECKING:
    from treadle.speculative.tree import DynamicTree


def tree_text(tree: tuple[int, ...] | DynamicTree) -> str:
    """``--tree`` as the user wrote it: 4,2,2,1 or dynamic:K,D,N."""
    return ",".join(map(str, tree)) if isinstance(tree, tuple) else str(tree)


def check_draft_spec(spec: str) -> None:
    """A ``--draft`` that can be nothing ``load_drafter`` takes is one line naming what it may be (before the
    target loads; resolve_model_dir's refusal would suggest target directories)."""
    path = Path(spec)
    if spec == "prompt-lookup" or any((c / "config.json").is_file() for c in (path, path / "draft", path / "hf")):
        return
    raise UserError(f"--draft {spec}: no draft or model there (no config.json in it, its draft/ or its hf/); "
                    "accepted: prompt-lookup; a draft run directory (e.g. runs/my-draft), its draft/ or a `treadle "
                    "export` of it; or a Hugging Face causal LM (or a model run directory with hf/) sharing the "
                    f"target's tokenizer{download_hint(path, '--draft')}")


def draft_export(spec: str) -> tuple[Path, dict] | None:
    """(directory, config.json) of the treadle draft ``--draft`` names (an export or its run directory), read
    without loading it; None for prompt-lookup or a plain causal LM."""
    from treadle.drafts.registry import read_draft_config

    if spec == "prompt-lookup":
        return None
    for candidate in (Path(spec), Path(spec) / "draft"):  # a draft run directory holds its export in draft/
        config = read_draft_config(candidate)
        if config is not None:
            return candidate, config
    return None


def check_draft_options(spec: str, gamma: int, tree, confidence_threshold: float, adapter: Path | None) -> None:
    """What the draft ``--draft`` names would refuse at decode time, refused from its config.json before the
    target or any weights load (seconds, not a traceback after the load): --gamma (or a tree's depth) beyond what
    one proposal of the kind holds, --confidence-threshold without a confidence head, --adapter on a draft that
    takes none. Sampling, trees (a drafter that cannot branch proposes a chain) and --dtype every drafter takes."""
    from treadle.drafts.registry import KINDS

    found = draft_export(spec)
    kind = KINDS.get(found[1]["treadle_draft_kind"]) if found is not None else None  # unknown: the load says so
    what = f"a {kind.name} draft" if kind is not None else "prompt lookup" if spec == "prompt-lookup" else "a causal LM"
    limit = kind.max_gamma(found[1]) if kind is not None else None
    if limit is not None and gamma > limit:
        asked = f"--tree {tree_text(tree)} (depth {gamma})" if tree is not None else f"--gamma {gamma}"
        raise UserError(f"{asked} with --draft {spec}: one forward of this {kind.name} draft proposes at most {limit} "
                        f"tokens (the block its config.json states); accepted: "
                        + (f"a tree of depth <= {limit}" if tree is not None else f"--gamma <= {limit}"))
    if not 0.0 <= confidence_threshold <= 1.0:
        raise UserError(f"--confidence-threshold {confidence_threshold}: accepted: a probability in 0..1 (0 = off)")
    if confidence_threshold and not (kind is not None and kind.confidence_head):
        raise UserError(f"--confidence-threshold {confidence_threshold} with --draft {spec} ({what}, no confidence "
                        "head); accepted: a draft with a confidence head (dspark), else leave it unset")
    if adapter is not None:
        check_adapter_fits(Path(adapter), spec, kind, what)


def not_a_treadle_draft(adapter: Path, draft: str) -> UserError:
    return UserError(f"--adapter {adapter} with --draft {draft}: an adapter adapts a treadle draft (an export of a "
                     "kind with adapters, or its run directory); accepted: --draft the base draft the adapter's run "
                     "started from (its draft.init)")


def check_adapter_fits(adapter: Path, spec: str, kind, what: str) -> None:
    """--adapter read before loading: a PEFT directory, adapting a draft (not a model) of the --draft's kind, a
    kind with adapters. Whether it was trained on this very base draft is checked once the draft is loaded (its
    fingerprint hashes the draft's files)."""
    from treadle.models.lora import read_identity, refuse_model_adapter

    if kind is None:
        raise not_a_treadle_draft(adapter, f"{spec} ({what})")
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"--adapter {adapter}: no adapter_config.json in it; accepted: the adapter/ directory of a "
                        "draft LoRA run (or `treadle export` of its checkpoint)")
    own = kind.settings
    if not getattr(own, "ADAPTERS", False):
        raise UserError(f"--adapter {adapter} with --draft {spec} ({what}): {own.LORA_NOTE}; accepted: a draft of a "
                        "kind with adapters, or no --adapter")
    recorded = read_identity(adapter)
    if recorded is None:
        return
    refuse_model_adapter(recorded, f"--adapter {adapter}", f"the {kind.name} draft --draft {spec}")
    if recorded["draft_kind"] != kind.name:
        raise UserError(f"--adapter {adapter} adapts a {recorded['draft_kind']} draft, --draft {spec} is {what}; "
                        f"accepted: --draft the base draft the adapter's run started from (its draft.init)")
