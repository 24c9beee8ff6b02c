"""XPress as a draft kind (drafts/kind.py): DFlash's kind with XPress's classes; its export is vLLM's
Qwen3XPressModel layout (xpress/layout.py), its ``speculators`` table speculators' XPressSpeculator one."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash.kind import DFlash
from treadle.drafts.xpress import layout, settings, speculators
from treadle.drafts.xpress.drafter import XPressDrafter
from treadle.drafts.xpress.model import XPressModel
from treadle.drafts.xpress.objective import XPressObjective


class XPress(DFlash):
    settings = settings
    model_class = XPressModel
    objective_class = XPressObjective
    drafter_class = XPressDrafter
    layout = layout
    speculators = speculators  # `treadle export --to speculators`

    def read_config(self, draft_dir) -> dict | None:  # either layout: xpress/layout.py reads both itself
        return layout.read_config(draft_dir)

    def max_gamma(self, config: dict) -> int | None:
        return layout.drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always vLLM's Qwen3XPressModel layout (xpress/layout.py)."""
        return layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """None: no remote code opens this layout (vLLM's model class does)."""


XPRESS = XPress()
