"""A lilicorr run's objective: DFlash's (drafts/dflash/objective.py: anchors, scored slots, the backbone's slot
losses) plus the correlator's lattice terms, as ModelOpt PR #2342's ``base`` variant composes them
(``hf_lilicorr.py``): loss = backbone + 0.25 * lattice CE + 0.25 * distractor penalty, per row and summed, which the
loop divides by the step's label tokens like every draft loss (so it does not depend on the micro-batch split).

Per block whose every slot is scored, walking the lattice along the data's tokens (teacher forcing): at slot s the
potentials are ``start`` (s = 0) or the pair row leaving the data token's candidate at s - 1, over the slot's k
candidates; the lattice CE is -log softmax(potentials)[data token]; the penalty is E_softmax[w] with w_j =
relu(t(data token) - t(c_j)), t the target's logits at that position (detached): a candidate the target finds
as likely costs nothing, one it rejects costs its logit gap. A slot is supervised while the data's tokens are in
the lattice at it and at every slot before it (past the first miss no path can be right).

The terms are computed in the model's forward (``LiLiCorrModel.head_scores``, where a sharding engine holds the
correlator's parameters); ``row_loss`` here adds them. Frozen backbone (``draft.train_backbone = false``): the
build freezes the backbone's parameters (autograd then keeps nothing of its forward) and its loss is left out; only
the correlator trains. Joint: both, the lattice terms reaching the backbone through the candidates'
log-probabilities and the slot hidden states, as in the PR.

Metrics: the acceptance counts (``ttt_hits_k``, ``block_hits_k``, hence ``acc_k`` and ``eal``) are the served
walk's: its pick equals the target's greedy token. Side sums ``lattice_ce`` / ``lattice_penalty`` (weighted terms,
summed), ``lattice_slots`` (supervised slots), ``lattice_top1_hits`` (the backbone's own argmax is the target's
greedy token, the baseline the walk should beat).
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.objective import DFlashObjective
from treadle.drafts.lilicorr import settings

W_CE = 0.25
W_PENALTY = 0.25


class LiLiCorrObjective(DFlashObjective):
    """DFlash's objective; the lattice terms come from the model's ``head_scores`` (LiLiCorrModel), this adds them
    (``row_loss``) and leaves the backbone's loss out when it is frozen."""

    def __init__(self, cfg, seq_len: int, max_positions: int, seed: int = 0):
        super().__init__(cfg, seq_len, max_positions, seed)
        self.joint = settings.train_backbone(cfg)

    @property
    def label(self) -> str:
        backbone = super().label if self.joint else "the frozen backbone's loss left out"
        return (f"{backbone}; plus {W_CE:g} lattice cross-entropy + {W_PENALTY:g} distractor penalty over the "
                f"correlator's {settings.candidates(self.cfg)} candidates per slot, summed, per label token")

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        ce, penalty = W_CE * out.lattice_ce, W_PENALTY * out.lattice_penalty
        lattice = (ce + penalty).sum((1, 2))
        side = {"lattice_ce": ce.detach().sum(), "lattice_penalty": penalty.detach().sum(),
                "lattice_slots": out.supervised.sum().double(), "lattice_top1_hits": out.top1_hit.sum().double()}
        # Frozen: the backbone gets no gradient (its parameters are frozen) and its loss is not the run's.
        return (super().row_loss(out, token, w)[0] + lattice if self.joint else lattice), side
