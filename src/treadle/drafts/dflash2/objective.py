"""A dflash2 draft run's objective: DFlash's (drafts/dflash/objective.py: anchors, scored slots, slot weights,
normalization, chunked scoring, metrics) plus the selector's cross-entropy over each slot's candidates, weighted
``draft.selector_weight`` and by the same slot weights (drafts/dflash2/model.py says where each part comes from).

Metrics: ``acc_k`` / ``eal`` count the selector's picks (what the decode proposes), not the slots' argmaxes;
``selector_ce`` is the selector's summed cross-entropy, per label token like ``draft_ce``.
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.objective import DFlashObjective
from treadle.drafts.dflash2 import settings


class DFlash2Objective(DFlashObjective):
    def __init__(self, cfg, seq_len: int, max_positions: int, seed: int = 0):
        super().__init__(cfg, seq_len, max_positions, seed)
        self.selector_weight = settings.selector_weight(cfg)

    @property
    def label(self) -> str:
        return (f"{super().label}; plus {self.selector_weight:g} x the selector's cross-entropy over each slot's "
                "candidates (same weights)")

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss, _ = super().row_loss(out, token + self.selector_weight * out.selector_ce, w)
        return loss, {"selector_ce": out.selector_ce.detach().sum()}
