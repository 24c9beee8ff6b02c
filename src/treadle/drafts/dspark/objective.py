"""A dspark draft run's objective: DFlash's anchored blocks (dflash/objective.py: the same seeded anchors), every
slot scored, the Markov head teacher-forced, plus the confidence head's BCE, as DeepSpec trains it
(``deepspec/modeling/dspark/loss.py`` @afdfa7c).

Slots: slot k = 0..block_size - 1 of the block at a guesses the token at a + k + 1, scored while a + k is in the
row, in a's document and supervised (``labels[a + k]`` set), and only as a contiguous prefix (DeepSpec's eval
mask: a slot after an unscored one is not scored either).

Per scored slot: the token loss (``draft.loss``: ce on the data, KL(target || draft), or their mix, as for every
treadle kind; DeepSpec's recipe mixes CE with an L1 distance, which treadle does not offer) plus the confidence
head's BCE toward the slot's acceptance rate 1 - TV(draft, target) (detached; weight 1, DeepSpec's
``confidence_head_alpha``), both weighed ``exp(-k / slot_gamma)`` (DeepSpec's ``loss_decay_gamma`` = 4). A row's
loss is their sum over blocks and slots; the loop divides by the step's label tokens like any draft loss.

Metrics: as DFlash's (``ttt_hits_k`` / ``block_hits_k`` -> ``acc_k`` and ``eal``), plus ``confidence_bce`` (summed
over scored slots, per label token, as ``draft_ce``).
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.objective import DFlashObjective, scored_slots
from treadle.drafts.dspark import settings


def dspark_slots(labels: torch.Tensor, doc: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, N, block_size] bool: slot k scored, its data token): DFlash's rule shifted by one slot (slot k reads
    labels[a + k]) and cut to a contiguous prefix."""
    scored, tokens = scored_slots(labels, doc, anchors, valid, block_size + 1)
    return scored.long().cumprod(-1).bool(), tokens


class DSparkObjective(DFlashObjective):
    """DFlash's objective (anchors, token losses, weights, metrics) over DSpark's slots, plus the confidence BCE."""

    settings = settings
    anchor_drafts = True

    @property
    def label(self) -> str:
        return (f"{self.token_loss} + the confidence head's BCE at the {self.slots} slots of up to {self.count} "
                f"blocks per row, slot k weighted exp(-k/{self.gamma:g}), summed, per label token")

    @property
    def eval_label(self) -> str:
        return (f"the draft's cross-entropy on the data, summed over the scored slots ({self.slots} per block, "
                f"up to {self.count} blocks per row), per label token; not a mean per slot")

    def scored(self, labels, doc, anchors, valid):
        return dspark_slots(labels, doc, anchors, valid, self.block_size)

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss, _ = super().row_loss(out, token + out.bce.to(token.dtype), w)
        return loss, {"confidence_bce": out.bce.detach().sum().double()}
