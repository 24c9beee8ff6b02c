"""LiLiCorr as a draft kind (drafts/kind.py): a DFlash backbone (drafts/dflash/) and its correlator."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash.model import build_dflash, draft_of_config
from treadle.drafts.dflash.objective import dflash_setup
from treadle.drafts.kind import DraftKind, init_dir
from treadle.drafts.lilicorr import layout, settings
from treadle.drafts.lilicorr.drafter import LiLiCorrDrafter
from treadle.drafts.lilicorr.model import KIND, LiLiCorrModel, build_draft
from treadle.drafts.lilicorr.objective import LiLiCorrObjective
from treadle.drafts.targets import checked_target
from treadle.errors import UserError
from treadle.model_dirs import resolve_model_dir


def draft_from_layout(draft_dir, target, where: str):
    """The LiLiCorrDraft a LiLiCorrDraftModel-layout directory holds, checked against ``target``."""
    from safetensors.torch import load_file

    from treadle.models.finite import check_tensors

    config = layout.read_config(draft_dir)
    if config is None:
        raise UserError(f"{where} {draft_dir} is not a LiLiCorr draft (config.json with architectures = "
                        f"[{layout.ARCHITECTURE!r}])")
    geometry = layout.geometry(config, draft_dir)
    draft = build_draft(draft_of_config(config, target, draft_dir, KIND), target.config,
                        int(geometry["lilicorr_candidate_topk"]), int(geometry["lilicorr_num_layers"]))
    layout.check_head(geometry, draft, draft_dir)
    file = Path(draft_dir) / "model.safetensors"
    draft.load_state_dict(layout.import_weights(check_tensors(load_file(str(file)), file, where), draft, draft_dir))
    return draft


def build(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(LiLiCorrModel, target dir, target identity): ``draft.init`` a LiLiCorr draft (backbone and correlator), or
    a DFlash draft (the backbone; a new correlator), or unset (both new)."""
    init = init_dir(cfg.init) if cfg.init is not None else None
    if init is not None and layout.read_config(init) is not None:
        target_dir = resolve_model_dir(Path(cfg.target), "draft.target")
        target, ident = checked_target(target_dir, data_vocab, data_tokenizer_fingerprint, empty)
        draft = draft_from_layout(init, target, "draft.init")
        for key, want, have in (("feature_layers", cfg.feature_layers, list(draft.feature_layers)),
                                ("num_layers", cfg.num_layers, draft.num_layers),
                                ("block_size", cfg.block_size, draft.block_size),
                                ("mask_token_id", cfg.mask_token_id, draft.mask_token_id),
                                ("candidates", cfg.candidates, draft.lilicorr.candidates),
                                ("correlator_layers", cfg.correlator_layers, len(draft.lilicorr.layers))):
            if want is not None and want != have:
                raise UserError(f"draft.{key} = {want} but draft.init {cfg.init} has {have}; accepted: draft.{key} "
                                "unset (the initial draft's) or equal to it")
    else:
        backbone, target_dir, ident = build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty)
        target = backbone.target
        draft = build_draft(backbone.draft_model, target.config, settings.candidates(cfg),
                            settings.correlator_layers(cfg))
    if not settings.train_backbone(cfg):
        draft.backbone.requires_grad_(False)  # frozen: never in the optimizer or a checkpoint (draft.init rebuilds it)
    return LiLiCorrModel(target, draft), target_dir, ident


class LiLiCorr(DraftKind):
    settings = settings

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return LiLiCorrModel(target, draft_from_layout(draft_dir, target, "draft")).eval()

    def setup(self, cfg, model, datasets):
        return dflash_setup(cfg, model, LiLiCorrObjective)

    def drafter(self, model):
        return LiLiCorrDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always the LiLiCorrDraftModel layout vLLM loads (lilicorr/layout.py)."""
        return layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


LILICORR = LiLiCorr()
