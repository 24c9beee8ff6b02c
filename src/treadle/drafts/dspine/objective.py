"""A dspine run's objective: DFlash's anchors, scored slots, slot weights, normalization and metrics
(drafts/dflash/objective.py), with SpecForge's terms per slot in place of ``draft.loss``'s (drafts/dspine/model.py
says what each is): 0.1 CE + 0.9 L1 of the backbone, the refinement's over the candidates, the alignment.

Metrics: ``acc_k`` / ``eal`` count the walk's picks (what the decode proposes), not the slots' argmaxes;
``spine_l1``, ``refinement``, ``alignment`` (summed, per label token like ``draft_ce``) and ``candidate_coverage``
(scored slots whose data token is among the candidates).
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.objective import DFlashObjective
from treadle.drafts.dspine import settings


class DSpineObjective(DFlashObjective):
    settings = settings

    @property
    def label(self) -> str:
        w = settings.CE_WEIGHT
        return (super().label.replace(self.token_loss, f"{w:g} cross-entropy + {1 - w:g} L1 to the target's "
                                      "distribution (draft.loss not read)")
                + f"; plus the refinement's {w:g} CE + {1 - w:g} L1 over {settings.candidates(self.cfg)} candidates "
                f"and {settings.ALIGNMENT_WEIGHT:g} x CE x the layers' alignment (same weights)")

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        c = settings.CE_WEIGHT
        per_slot = c * out.spine_ce + (1 - c) * out.spine_l1 + out.refinement + out.alignment
        side = {"spine_l1": out.spine_l1.detach().sum(), "refinement": out.refinement.detach().sum(),
                "alignment": out.alignment.detach().sum(), "candidate_coverage": out.covered.sum().double()}
        return (per_slot * w).sum((1, 2)), side
