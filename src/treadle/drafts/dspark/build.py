"""A DSpark run's model: the stages a DeepSeek-V4 target (or ``draft.init``) ships, fine-tuned in place
(dspark/v4.py), or else DFlash's build of a ``DSparkDraft`` (dspark/model.py)."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash.model import build_dflash, load_dflash
from treadle.drafts.dspark import stages
from treadle.drafts.dspark.model import DSparkModel
from treadle.drafts.kind import init_dir
from treadle.drafts.targets import building_beside, checked_target
from treadle.model_dirs import resolve_model_dir


def build_dspark(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(DSparkModel, target dir, target identity) for a ``DraftConfig``: the stages a DeepSeek-V4 target (or
    ``draft.init``) ships, fine-tuned in place (dspark/v4.py); else DFlash's build (``build_dflash``) of a
    ``DSparkDraft``, from ``draft.init`` the directory's draft (its layers, block size, mask token and Markov rank
    are the run's)."""
    if cfg.init is None and building_beside():  # the run's own model: no shipped stages to read
        return build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, DSparkModel)
    target_dir = resolve_model_dir(Path(cfg.target), "draft.target")
    source = target_dir if cfg.init is None else init_dir(cfg.init)
    found = stages.find(source)
    if found is None:
        return build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, DSparkModel)
    from treadle.drafts.dspark import v4  # transformers' DeepSeek-V4 modeling, for a run on stages only

    where = "draft.target" if cfg.init is None else "draft.init"
    target, ident = checked_target(target_dir, data_vocab, data_tokenizer_fingerprint, empty)
    draft = v4.load_stages(source, target.config, found)
    v4.check_run_keys(cfg, draft, f"{where} {source}")
    model = v4.StagesModel(target, draft)
    model.origin = f"DSpark stages: the {found.count} {where} {source} ships (mtp.{{s}}.*)"
    return model, target_dir, ident


def load_dspark(draft_dir, target) -> DSparkModel:
    """A DSpark draft in the Qwen3DSparkModel layout (treadle's export, DeepSpec's checkpoint, or a speculators-format
    one with the same slot convention), or DSpark stages (a checkpoint carrying them, a stitched export, a stages
    run's draft/), attached to ``target``."""
    found = stages.find(draft_dir)
    if found is not None:
        from treadle.drafts.dspark import v4

        return v4.StagesModel(target, v4.load_stages(draft_dir, target.config, found)).eval()
    return load_dflash(draft_dir, target, DSparkModel)
