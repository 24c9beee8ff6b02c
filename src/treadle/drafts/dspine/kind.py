"""DSpine as a draft kind (drafts/kind.py): the block kind (drafts/dflash/kind.py) with DSpine's model, objective,
drafter and layout; a new draft also gets its transfer codes from the target's head (``build_dspine``)."""

from __future__ import annotations

from treadle.drafts.dflash.kind import BlockKind
from treadle.drafts.dspine import layout, settings
from treadle.drafts.dspine.drafter import DSpineDrafter
from treadle.drafts.dspine.model import DSpineModel, build_dspine
from treadle.drafts.dspine.objective import DSpineObjective


class DSpine(BlockKind):
    settings = settings
    model_class = DSpineModel
    objective_class = DSpineObjective
    drafter_class = DSpineDrafter
    layout = layout  # SpecForge's DSpineDraftModel layout (dspine/layout.py)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dspine(cfg, data_vocab, data_tokenizer_fingerprint, empty)


DSPINE = DSpine()
