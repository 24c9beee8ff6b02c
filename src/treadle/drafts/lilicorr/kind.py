"""LiLiCorr as a draft kind (drafts/kind.py): the block kind (drafts/dflash/kind.py) with LiLiCorr's model (a
block-draft backbone and its correlator), objective, drafter and layout; ``draft.init`` also takes a DFlash or
DFlash2 draft as the backbone (``build``)."""

from __future__ import annotations

from treadle.drafts.dflash.kind import BlockKind
from treadle.drafts.dflash.model import DFlashModel, build_dflash, check_init_keys
from treadle.drafts.dflash2 import layout as dflash2_layout
from treadle.drafts.dflash2.model import DFlash2Model
from treadle.drafts.kind import init_dir
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


class LiLiCorr(BlockKind):
    settings = settings
    model_class = LiLiCorrModel
    objective_class = LiLiCorrObjective
    drafter_class = LiLiCorrDrafter
    layout = layout  # the LiLiCorrDraftModel layout vLLM loads (lilicorr/layout.py)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build(cfg, data_vocab, data_tokenizer_fingerprint, empty)


LILICORR = LiLiCorr()
