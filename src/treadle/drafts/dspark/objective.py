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

import math
from typing import TYPE_CHECKING

import torch

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.dflash.objective import DFlashObjective, sample_anchors, scored_slots
from treadle.drafts.dspark import settings
from treadle.drafts.glide.model import anchored_positions, document_ids
from treadle.drafts.run_model import batch_reads

if TYPE_CHECKING:
    from treadle.train.step import Batch


def dspark_slots(labels: torch.Tensor, doc: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, N, block_size] bool: slot k scored, its data token): DFlash's rule shifted by one slot (slot k reads
    labels[a + k]) and cut to a contiguous prefix."""
    scored, tokens = scored_slots(labels, doc, anchors, valid, block_size + 1)
    return scored.long().cumprod(-1).bool(), tokens


class DSparkObjective(DFlashObjective):
    def __init__(self, cfg, seq_len: int, max_positions: int, seed: int = 0):
        super().__init__(cfg, seq_len, max_positions, seed)
        self.block_size = settings.block_size(cfg)
        self.count = cfg.anchors or max(1, seq_len // self.block_size)
        self.gamma = settings.slot_gamma(cfg)
        self.weights = [math.exp(-k / self.gamma) for k in range(self.block_size)]
        self.dpace = False
        self.max_offset = max(0, min(cfg.max_position_offset, max_positions - seq_len - self.block_size))

    @property
    def label(self) -> str:
        c = self.cfg
        what = {"ce": "cross-entropy on the data", "kl": "KL(target || draft)",
                "mix": f"{1 - c.kl_weight:g} cross-entropy + {c.kl_weight:g} KL(target || draft)"}[c.loss]
        return (f"{what} + the confidence head's BCE at the {self.block_size} slots of up to {self.count} blocks per "
                f"row, slot k weighted exp(-k/{self.gamma:g}), summed, per label token")

    @property
    def eval_label(self) -> str:
        return (f"the draft's cross-entropy on the data, summed over the scored slots ({self.block_size} per block, "
                f"up to {self.count} blocks per row), per label token; not a mean per slot")

    def losses(self, model, batch: Batch, offset: int, train: bool):
        positions, labels = batch["position_ids"], batch["labels"]
        anchors, valid = sample_anchors(labels, self.count, self._seeds(batch))
        scored, tokens = dspark_slots(labels, document_ids(positions), anchors, valid, self.block_size)
        out = model(input_ids=batch["input_ids"], position_ids=anchored_positions(positions, self.cfg.anchor_positions,
                    offset), anchors=anchors, doc_position_ids=positions, labels=labels,
                    slot_labels=torch.where(scored, tokens, IGNORE_INDEX), reads=batch_reads(batch))
        ce, kl, hit = out.ce, out.kl, out.hit
        if not train:
            return ce.sum((1, 2)), {"target_loss": out.target_ce}
        if self.cfg.loss == "mix":
            token = (1.0 - self.cfg.kl_weight) * ce + self.cfg.kl_weight * kl
        else:
            token = ce if self.cfg.loss == "ce" else kl
        w = torch.tensor(self.weights, dtype=ce.dtype, device=ce.device)
        loss = ((token + out.bce.to(token.dtype)) * w).sum((1, 2))
        side = {"target_loss": out.target_ce, "draft_ce": ce.detach().sum(), "draft_kl": kl.detach().sum(),
                "confidence_bce": out.bce.detach().sum().double()}
        prefix = hit.long().cumprod(-1).bool()
        for k in range(self.block_size):
            side[f"ttt_hits_{k + 1}"] = hit[..., k].sum().double()
            side[f"ttt_rows_{k + 1}"] = scored[..., k].sum().double()
        for k in range(self.block_size):
            side[f"block_hits_{k + 1}"] = prefix[..., k].sum().double()
            side[f"block_rows_{k + 1}"] = scored[..., k].sum().double()
        return loss, side


def dspark_setup(cfg, model) -> DSparkObjective:
    """``model.loss_chunk_tokens`` resolved as for dflash (auto: on from a 32k vocabulary), and the objective."""
    from treadle.drafts.dflash.objective import dflash_setup

    if cfg.draft.block_size is None:  # the draft's own block (a draft.init's, or the stages a target ships)
        draft = cfg.draft.model_copy(update={"block_size": model.draft_model.block_size})
        cfg = cfg.model_copy(update={"draft": draft})
    return dflash_setup(cfg, model, DSparkObjective)
