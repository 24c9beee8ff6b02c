"""The objective of kinds that replay one module K times from the target's hidden state (mtp, frozen_kv): the
recursive unroll scored against the target (drafts/ttt.py's alignment).

The model's ``forward(input_ids, position_ids, steps, doc_position_ids, reads, labels)`` returns the per-step logits
(``logits``: step k's row t guesses token t + k + 1) and the target's (``target_logits``), or, for a model that scores
through the target's head (``chunked_unroll``) with ``model.loss_chunk_tokens`` set, the per-row scores computed a
chunk of rows at a time (``scores``: no [tokens, vocab] logits of any step kept for backward).

Step k's row t (k = 1..K) guesses token t + k + 1: scored iff that index is in t's document and labelled (the loss
mask moves with the unroll), against the data token (ce), the target's distribution there (kl) or both (mix), and
weighted ``ttt_decay**(k - 1)`` (FastMTP's beta^(k-1)); the sum is divided by the step's label tokens like every
treadle loss. Metrics: ``acc_k`` (step k's guess is the target's greedy token) and ``eal``, the expected drafts a
greedy verification accepts per chain: sum over k of P(steps 1..k all the target's greedy tokens), over rows whose
steps 1..k are all scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treadle.data.packed import IGNORE_INDEX
from treadle.metrics.agreement import counts
from treadle.drafts.glide.model import anchored_positions
from treadle.drafts.glide.objective import GlideObjective
from treadle.drafts.run_model import batch_reads
from treadle.drafts.ttt import scored_rows, ttt_steps, unroll_chunk_tokens, unroll_loss
from treadle.drafts.ttt_scores import UnrollScores, dense_unroll_scores
from treadle.errors import UserError
from treadle.models.upcast import at_least_fp32

if TYPE_CHECKING:
    from treadle.train.step import Batch


@dataclass
class UnrollOutput:
    logits: list[torch.Tensor] | None  # per step k = 1..K, the draft's [B, T, V]: row t guesses token t + k + 1
    target_logits: torch.Tensor | None  # the frozen target's [B, T, V]
    target_hidden: torch.Tensor  # its final hidden states [B, T, d]
    # A kind's auxiliary per-step classification of the guessed token (frozen_kv: the centroid-masked head's centroid
    # logits [B, T, C]), scored like the steps against ``aux_classes`` [V] (the class of each token id); None: none
    aux_logits: list[torch.Tensor] | None = None
    aux_classes: torch.Tensor | None = None
    scores: UnrollScores | None = None  # the chunked loss's (logits and target_logits None then)


def aux_loss(cfg, out: UnrollOutput, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row [B] summed CE of ``out.aux_logits`` against the class of the token each step guesses, over the rows
    that step scores, weighted as the steps are (``ttt_decay**(k - 1)``)."""
    loss = labels.new_zeros(labels.shape[0], dtype=torch.float32)
    for k, logits in enumerate(out.aux_logits or ()):
        n = labels.shape[1] - 1 - k
        rows = scored_rows(positions, labels, k)
        target = out.aux_classes[labels[:, 1 + k:1 + k + n].clamp_min(0)]
        ce = F.cross_entropy(at_least_fp32(logits[:, :n]).flatten(0, 1), target.flatten(), reduction="none")
        loss = loss + cfg.ttt_decay ** k * (ce.view_as(target) * rows).sum(-1)
    return loss


def guesses_by_step(argmaxes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per step k = 1..K, the [N, L] argmaxes of step k's rows moved so that entry i is the guess for token i + 1
    (row t of step k guesses token t + k + 1: index t + k; the first k entries -1)."""
    return [torch.cat((ids.new_full((ids.shape[0], k), -1), ids[:, : ids.shape[1] - k]), dim=1)
            for k, ids in enumerate(argmaxes, start=1)]


def chain_prefix(scores, positions: torch.Tensor, labels: torch.Tensor) -> dict:
    """``block_hits_k`` / ``block_rows_k``: rows whose steps 1..k are all scored, and those among them whose steps
    1..k all equal the target's greedy token (``TTTAccuracyCallback`` sums the ratios into ``eal``)."""
    side = {}
    n = scores.guess[0].shape[1]
    alive = hit = None
    for k, guess in enumerate(scores.guess):
        rows = scored_rows(positions, labels, k)[:, :guess.shape[1]]
        ok = (guess == scores.target_best[:, 1 + k:1 + k + guess.shape[1]]) & rows
        n = guess.shape[1]
        alive = rows if alive is None else alive[:, :n] & rows
        hit = ok if hit is None else hit[:, :n] & ok
        side[f"block_hits_{k + 1}"] = hit.sum().double()
        side[f"block_rows_{k + 1}"] = alive.sum().double()
    return side


class RecurrentObjective(GlideObjective):
    """The unroll's summed loss of a micro-batch plus side sums: ``target_loss`` (the target's own CE, the floor),
    ``draft_ce`` / ``draft_kl`` (step 1's), ``ttt_hits_k`` / ``ttt_rows_k`` and ``block_hits_k`` / ``block_rows_k``."""

    eval_label = "the draft's cross-entropy on the data at its first guess, per label token"

    def __call__(self, model, batch: Batch):
        _, offset = self._draw(batch)
        return self.losses(model, batch, 0, offset, train=True)

    def losses(self, model, batch: Batch, lag: int, offset: int, train: bool):
        positions, labels = batch["position_ids"], batch["labels"]
        # Evaluation runs the whole unroll too: its loss is step 1's CE (comparable across runs), its eval_acc_k and
        # eval_eal the agreement of every step.
        steps = ttt_steps(self.cfg)
        out = model(input_ids=batch["input_ids"], position_ids=anchored_positions(positions, self.cfg.anchor_positions,
                    offset), steps=steps, doc_position_ids=positions, reads=batch_reads(batch), labels=labels)
        if out.scores is not None:  # a chunked loss (model.loss_chunk_tokens): per-row scores, logits never whole
            scores, target_ce = out.scores, out.scores.target_ce.sum()
        else:
            target_log = F.log_softmax(at_least_fp32(out.target_logits), -1)
            target_ce = F.nll_loss(target_log.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            scores = dense_unroll_scores(out.logits, out.target_logits, labels, None, None, lead=1)
        loss, side = unroll_loss(self.cfg, scores, positions, labels)
        if out.aux_logits:
            aux = aux_loss(self.cfg, out, positions, labels)
            loss, side["aux_ce"] = loss + aux.to(loss.dtype), aux.detach().sum()
        side.update(chain_prefix(scores, positions, labels))
        if not train:
            return side["draft_ce"], {"target_loss": target_ce, **counts(side)}
        return loss, {"target_loss": target_ce, **side}


def recurrent_setup(cfg, model) -> RecurrentObjective:
    """What a recurrent kind's run adds to a draft run's setup: the chunked loss's setting where its model scores
    through the target's head (``chunked_unroll``: mtp; auto chunks from a 32k vocabulary), else whole logits per
    step (frozen_kv: the assistant's own head and its centroids)."""
    setting = cfg.model.loss_chunk_tokens
    if getattr(model, "chunked_unroll", False):
        model.loss_chunk_tokens = unroll_chunk_tokens(cfg, model.target.config)
    elif setting != "auto" and int(setting) > 0:
        raise UserError(f"model.loss_chunk_tokens = {setting} with draft.kind = {cfg.draft.kind!r}: its unroll scores "
                        "whole logits per step (the chunked loss is not built for it yet); accepted: 0 or auto (off)")
    else:
        model.loss_chunk_tokens = 0
    return RecurrentObjective(cfg.draft, model.target.config.max_position_embeddings, cfg.data.seq_len, cfg.train.seed)
