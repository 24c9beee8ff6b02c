"""DFlash2 as a draft kind (drafts/kind.py): the block kind (drafts/dflash/kind.py) with DFlash2's model,
objective, drafter and layout."""

from __future__ import annotations

from treadle.drafts.dflash.kind import BlockKind
from treadle.drafts.dflash2 import layout, settings, speculators
from treadle.drafts.dflash2.drafter import DFlash2Drafter
from treadle.drafts.dflash2.model import DFlash2Model
from treadle.drafts.dflash2.objective import DFlash2Objective


class DFlash2(BlockKind):
    settings = settings
    model_class = DFlash2Model
    objective_class = DFlash2Objective
    drafter_class = DFlash2Drafter
    layout = layout  # z-lab's DFlash2DraftModel layout vLLM loads (dflash2/layout.py)
    speculators = speculators  # `treadle export --to speculators`, draft.init of that format


DFLASH2 = DFlash2()
