"""An xpress run's objective: DFlash's (drafts/dflash/objective.py: anchors, scored slots, the backbone's slot loss
per ``draft.loss``) with the refiner's terms, as speculators 0.9.0 composes XPress's loss (``models/xpress/
metrics.py``): per scored slot

    loss = L(refined, teacher-forced) + CONSISTENCY_WEIGHT * mean_j L(refined, free-running round j)
           + BASE_WEIGHT * the backbone's own slot loss

with L = CE_WEIGHT * CE(draft, the target's argmax) + TV_WEIGHT * TV(draft, target) (0.1 and 0.9: speculators'
``{"ce": 0.1, "tv": 0.9}``), each weighed by DFlash's slot weights and summed per row; the loop divides by the
step's label tokens like every draft loss. The backbone's term is DFlash's token loss (``draft.loss``: what every
treadle block kind trains its backbone with) where speculators uses L again: the anchor that keeps the Jacobi seed,
the backbone's own argmax, from drifting.

The terms are computed in the model's forward (``XPressModel.head_scores``, where a sharding engine holds the
refiner's parameters); ``row_loss`` adds them. Metrics: the acceptance counts (``acc_k``, ``eal``) are the served
draft's, the last Jacobi pass's argmax against the target's greedy token; side sums ``refined_loss``,
``consistency_loss`` (weighted, summed) and ``refined_ce`` (the teacher-forced refiner's CE on the target's argmax).
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.objective import DFlashObjective
from treadle.drafts.xpress import settings


class XPressObjective(DFlashObjective):
    @property
    def label(self) -> str:
        s = settings
        return (f"{s.BASE_WEIGHT:g} x ({super().label}); plus the refiner's {s.CE_WEIGHT:g} CE + {s.TV_WEIGHT:g} TV "
                f"teacher-forced and {s.CONSISTENCY_WEIGHT:g} x its mean over {s.CONSISTENCY_PASSES} free-running "
                "rounds, under the same slot weights")

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        rounds = settings.CONSISTENCY_WEIGHT * out.rounds
        refiner = ((out.refined + rounds) * w).sum((1, 2))
        base = super().row_loss(out, token, w)[0]
        side = {"refined_loss": (out.refined * w).detach().sum(), "consistency_loss": (rounds * w).detach().sum(),
                "refined_ce": out.refined_ce.detach().sum()}
        return settings.BASE_WEIGHT * base + refiner, side
