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

Frozen backbone (``draft.train_backbone = false``): the backbone runs without grad and its loss is left out; only
the correlator trains. Joint: both, the lattice terms reaching the backbone through the candidates'
log-probabilities and the slot hidden states, as in the PR.

Metrics: the acceptance counts (``ttt_hits_k``, ``block_hits_k``, hence ``acc_k`` and ``eal``) are the served
walk's: its pick equals the target's greedy token. Side sums ``lattice_ce`` / ``lattice_penalty`` (weighted terms,
summed), ``lattice_slots`` (supervised slots), ``lattice_top1_hits`` (the backbone's own argmax is the target's
greedy token, the baseline the walk should beat).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from treadle.drafts.dflash.objective import DFlashObjective
from treadle.drafts.glide.model import document_ids
from treadle.drafts.lilicorr import settings
from treadle.drafts.lilicorr.model import greedy_walk
from treadle.models.chunked_ce import chunked_rows, model_logits

W_CE = 0.25
W_PENALTY = 0.25


def teacher_scores(model, teacher: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor):
    """(the target's logits at the candidates [..., k] and at the data tokens [...], its greedy tokens [...]) from the
    teacher rows ``score_blocks`` returned: logits [..., V], or final hidden states [..., d] with the chunked loss
    (then only the rows of the head in play are multiplied, and the greedy token a chunk at a time)."""
    with torch.no_grad():
        if not model.loss_chunk_tokens:
            return teacher.gather(-1, ids), teacher.gather(-1, tokens[..., None]).squeeze(-1), teacher.argmax(-1)
        weight, config = model.target.get_output_embeddings().weight, model.target.config
        rows = torch.cat((ids, tokens[..., None]), -1)
        picked = model_logits(config, (teacher[..., None, :] * weight[rows]).sum(-1))
        greedy = chunked_rows(lambda h: (model_logits(config, F.linear(h, weight)).argmax(-1),),
                              [teacher.reshape(-1, teacher.shape[-1])], model.loss_chunk_tokens)[0]
        return picked[..., :-1], picked[..., -1], greedy.view(teacher.shape[:-1])


def lattice_terms(start: torch.Tensor, pair: torch.Tensor, truth: torch.Tensor, teacher_cand: torch.Tensor,
                  teacher_truth: torch.Tensor):
    """Per slot [..., S]: the lattice CE and the penalty along the data's path (``truth``: its candidate index per
    slot, any index where it is not a candidate)."""
    lead = start.shape[:-1]
    k = start.shape[-1]
    rows = [start]
    for s in range(pair.shape[-3]):
        leaving = truth[..., s, None, None].expand(*lead, 1, k)
        rows.append(pair[..., s, :, :].gather(-2, leaving).squeeze(-2))
    node = torch.stack(rows, -2)  # [..., S, k]
    logp = F.log_softmax(node, -1)
    ce = -logp.gather(-1, truth[..., None]).squeeze(-1)
    w = (teacher_truth[..., None] - teacher_cand).clamp_min(0.0)
    return ce, (logp.exp() * w).sum(-1)


class LiLiCorrObjective(DFlashObjective):
    def __init__(self, cfg, seq_len: int, max_positions: int, seed: int = 0):
        super().__init__(cfg, seq_len, max_positions, seed)
        self.joint = settings.train_backbone(cfg)

    @property
    def label(self) -> str:
        backbone = super().label if self.joint else "the frozen backbone's loss left out"
        return (f"{backbone}; plus {W_CE:g} lattice cross-entropy + {W_PENALTY:g} distractor penalty over the "
                f"correlator's {settings.candidates(self.cfg)} candidates per slot, summed, per label token")

    def run(self, model, inputs: dict):
        grad = contextlib.nullcontext() if self.joint else torch.no_grad()
        with grad:
            out, hidden, teacher, features = model.score_blocks(**inputs)
        return out, (hidden, teacher, features)

    def head(self, model, extra, anchors, positions, scored, tokens, out, loss, hit, side):
        hidden, teacher, features = extra
        slots = hidden[:, :, 1:]
        with contextlib.nullcontext() if self.joint else torch.no_grad():
            ids, log_probs = model.candidates(slots)
        anchor, valid = model.anchor_rows(features, anchors, document_ids(positions))
        start, pair = model.lattice(slots, ids, log_probs, anchor, valid)
        t_cand, t_truth, greedy = teacher_scores(model, teacher, ids, tokens)
        in_lattice = ids == tokens[..., None]
        truth = in_lattice.long().argmax(-1)
        supervised = in_lattice.any(-1).long().cumprod(-1).bool() & scored.all(-1, keepdim=True)
        ce, penalty = lattice_terms(start, pair, truth, t_cand, t_truth)
        ce, penalty = W_CE * ce * supervised, W_PENALTY * penalty * supervised
        lattice = (ce + penalty).sum((1, 2))
        B, N, S, k = ids.shape
        pick = greedy_walk(start.flatten(0, 1), pair.flatten(0, 1)).view(B, N, S)
        walked = ids.gather(-1, pick[..., None]).squeeze(-1)
        side.update(lattice_ce=ce.detach().sum(), lattice_penalty=penalty.detach().sum(),
                    lattice_slots=supervised.sum().double(),
                    lattice_top1_hits=((ids[..., 0] == greedy) & scored).sum().double())
        return (loss + lattice if self.joint else lattice), (walked == greedy) & scored
