"""LiLiCorr as a draft kind (drafts/kind.py): a block-draft backbone (drafts/dflash/) and its correlator, built,
loaded and trained through DFlash's hooks (``build_dflash`` / ``load_dflash`` with ``LiLiCorrModel``)."""

from __future__ import annotations

from treadle.drafts.dflash.model import DFlashModel, build_dflash, check_init_keys, load_dflash
from treadle.drafts.dflash2 import layout as dflash2_layout
from treadle.drafts.dflash2.model import DFlash2Model
from treadle.drafts.dflash.objective import dflash_setup
from treadle.drafts.kind import DraftKind, init_dir
from treadle.drafts.lilicorr import layout, settings
from treadle.drafts.lilicorr.drafter import LiLiCorrDrafter
from treadle.drafts.lilicorr.model import LiLiCorrModel, build_draft
from treadle.drafts.lilicorr.objective import LiLiCorrObjective


def build(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(LiLiCorrModel, target dir, target identity): ``draft.init`` a LiLiCorr draft (backbone and correlator), or
    a DFlash or DFlash2 draft (the backbone, DFlash2's without its selector; a new correlator), or unset (both
    new)."""
    init = init_dir(cfg.init) if cfg.init is not None else None
    if init is None or layout.read_config(init) is not None:
        model, target_dir, ident = build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, LiLiCorrModel)
    else:
        run = DFlash2Model if dflash2_layout.read_config(init) is not None else DFlashModel
        backbone, target_dir, ident = build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, run)
        trained = backbone.draft_model
        draft = build_draft(trained.drop_selector() if run is DFlash2Model else trained, backbone.target.config,
                            settings.candidates(cfg), settings.correlator_layers(cfg))
        check_init_keys(cfg, draft)  # conv_group_size: the backbone's
        model = LiLiCorrModel(backbone.target, draft)
    if not settings.train_backbone(cfg):
        # frozen: never in the optimizer or a checkpoint (draft.init rebuilds it)
        model.draft_model.backbone.requires_grad_(False)
    return model, target_dir, ident


class LiLiCorr(DraftKind):
    settings = settings
    read_config = staticmethod(layout.read_config)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dflash(draft_dir, target, LiLiCorrModel)

    def setup(self, cfg, model, datasets):
        return dflash_setup(cfg, model, LiLiCorrObjective)

    def drafter(self, model):
        return LiLiCorrDrafter(model)

    def max_gamma(self, config: dict) -> int | None:
        from treadle.drafts.dflash.layout import drafts_per_block

        return drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always the LiLiCorrDraftModel layout vLLM loads (lilicorr/layout.py)."""
        return layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


LILICORR = LiLiCorr()
