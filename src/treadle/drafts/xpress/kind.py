"""XPress as a draft kind (drafts/kind.py): DFlash's kind with XPress's classes; its layout is speculators' (the
kind's own export and its ``speculators`` table are the same writer)."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash.kind import DFlash
from treadle.drafts.xpress import settings, speculators
from treadle.drafts.xpress.drafter import XPressDrafter
from treadle.drafts.xpress.model import XPressModel
from treadle.drafts.xpress.objective import XPressObjective


class XPress(DFlash):
    settings = settings
    model_class = XPressModel
    objective_class = XPressObjective
    drafter_class = XPressDrafter
    layout = speculators
    speculators = speculators  # `treadle export --to speculators` writes what the run's export writes

    def max_gamma(self, config: dict) -> int | None:
        return speculators.drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always speculators' XPressSpeculator layout (xpress/speculators.py)."""
        return speculators.layout_export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """None: no remote code opens this layout (speculators' package and vLLM do)."""


XPRESS = XPress()
