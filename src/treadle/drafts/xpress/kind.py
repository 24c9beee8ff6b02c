"""XPress as a draft kind (drafts/kind.py): the block kind (drafts/dflash/kind.py) with XPress's classes; its export
is vLLM's Qwen3XPressModel layout (xpress/layout.py), its ``speculators`` table speculators' XPressSpeculator one."""

from __future__ import annotations

from treadle.drafts.dflash.kind import BlockKind
from treadle.drafts.xpress import layout, settings, speculators
from treadle.drafts.xpress.drafter import XPressDrafter
from treadle.drafts.xpress.model import XPressModel
from treadle.drafts.xpress.objective import XPressObjective


class XPress(BlockKind):
    settings = settings
    model_class = XPressModel
    objective_class = XPressObjective
    drafter_class = XPressDrafter
    layout = layout  # vLLM's Qwen3XPressModel layout (xpress/layout.py), which reads speculators' format itself
    speculators = speculators  # `treadle export --to speculators`

    def read_config(self, draft_dir) -> dict | None:  # either layout: the layout reads both (no table passed)
        return layout.read_config(draft_dir)

    def max_gamma(self, config: dict) -> int | None:
        return layout.drafts_per_block(config)


XPRESS = XPress()
