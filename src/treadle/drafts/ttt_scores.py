"""A training-time-test unroll's per-row scores against the target, from whole logits or chunk by chunk.

Step k's row t is scored at index ``t + ahead`` (``ahead = lead + k``, drafts/ttt.py's alignment): the draft's CE on
the label there, KL(teacher || draft) against the target's distribution there, and the draft's guess (compared with
the target's greedy token for ``acc_k``). A reduced draft vocabulary (EAGLE-3's ``draft.vocab_size``) scores within
it: the teacher is the target's logits restricted to the draft's ids and renormalized, labels are mapped to draft
ids. drafts/ttt.py turns the scores into the loss (which rows count, the weights); the math of a row lives in
``row_scores`` alone, so the whole-logits and the chunked paths are the same computation.

Chunked (``chunked_unroll_scores``, ``model.loss_chunk_tokens``): the draft's logits and the teacher's are
recomputed from hidden states a chunk of rows at a time (``chunked_rows``), so neither the target's [B, T, V] logits
nor the draft's [B, T, draft vocab] logits of any step are kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from treadle.models.chunked_ce import chunked_rows, model_logits
from treadle.models.upcast import at_least_fp32


@dataclass
class UnrollScores:
    """Per step k: [B, n_k] rows t = start .. start + n_k - 1 of the sequence, scored at t + lead + k."""

    ce: list[torch.Tensor]  # the draft's CE on the label (a label outside a reduced vocabulary: on id 0, masked later)
    kl: list[torch.Tensor]  # KL(teacher || draft)
    guess: list[torch.Tensor]  # the draft's argmax, in target ids
    target_best: torch.Tensor  # [B, N] the target's greedy token at every index of the whole sequence
    target_ce: torch.Tensor | None = None  # [B, T] the target's CE on this rank's labels (chunked path only)
    # What the loss's row masks read (chunked path): the whole sequence's document positions and labels, and the
    # index of the scores' first row in it.
    positions: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    start: int = 0


def row_scores(logits: torch.Tensor, teacher_logp: torch.Tensor, label: torch.Tensor):
    """(CE on ``label``, KL(teacher || draft), argmax) of each row of draft ``logits`` [..., V]; softmaxes in fp32."""
    logits = at_least_fp32(logits)
    log_q = F.log_softmax(logits, -1)
    ce = F.nll_loss(log_q.flatten(0, -2), label.flatten(), reduction="none").view(label.shape)
    kl = F.kl_div(log_q, teacher_logp, log_target=True, reduction="none").sum(-1)
    return ce, kl, logits.argmax(-1)


def draft_labels(labels: torch.Tensor, to_draft: torch.Tensor | None) -> torch.Tensor:
    """Labels in the draft's ids, clamped to a valid id (rows whose label is outside are masked by the caller)."""
    return labels.clamp_min(0) if to_draft is None else to_draft[labels.clamp_min(0)].clamp_min(0)


def dense_unroll_scores(step_logits: list[torch.Tensor], target_logits: torch.Tensor, labels: torch.Tensor,
                        to_draft: torch.Tensor | None, from_draft: torch.Tensor | None, lead: int) -> UnrollScores:
    """Scores from whole logits: ``step_logits`` [B, T, draft vocab] per step, ``target_logits`` [B, T, V]."""
    T = labels.shape[1]
    # The target's side once for all steps (each step reads it from its own offset on).
    teacher = at_least_fp32(target_logits)
    teacher_logp = F.log_softmax(teacher[..., from_draft] if from_draft is not None else teacher, -1)
    scores = UnrollScores([], [], [], teacher.argmax(-1))
    label = draft_labels(labels, to_draft)
    for k, logits in enumerate(step_logits):
        ahead = lead + k
        if ahead >= T:
            break
        ce, kl, guess = row_scores(logits[:, : T - ahead], teacher_logp[:, ahead:], label[:, ahead:])
        scores.ce.append(ce), scores.kl.append(kl)
        scores.guess.append(guess if from_draft is None else from_draft[guess])
    return scores


def chunked_unroll_scores(draft_logits: Callable[[torch.Tensor], torch.Tensor], hidden: list[torch.Tensor],
                          target_hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                          to_draft: torch.Tensor | None, from_draft: torch.Tensor | None, lead: int, chunk_tokens: int,
                          whole_labels: torch.Tensor | None = None, start: int = 0,
                          gather: Callable[[torch.Tensor, int], torch.Tensor] = lambda x, dim: x, config=None,
                          ignore_index: int = -100) -> UnrollScores:
    """Scores chunk by chunk: ``draft_logits`` maps a step's hidden rows to logits, ``hidden`` [B, T, d] per step
    (rows start .. start + T - 1 of the sequence); ``target_hidden`` [B, N, d] the target's final hidden states of the
    whole sequence, ``head`` its LM head; ``labels`` [B, T] this rank's, ``whole_labels`` [B, N] the whole
    sequence's (default: ``labels``, one process), ``gather`` concatenates every rank's rows (context parallelism);
    ``config``: the target's, whose logit transform (Gemma's soft-cap, Granite's scale) the teacher's chunks apply.
    Call it inside the model's forward (sharded weights are there)."""
    whole_labels = labels if whole_labels is None else whole_labels
    B, N = whole_labels.shape
    T = hidden[0].shape[1] if hidden else labels.shape[1]
    weight, bias = head.weight, head.bias

    def target_side(t_h, y):  # the target's greedy token and CE over its whole vocabulary: no grad, [rows] each
        z = at_least_fp32(model_logits(config, F.linear(t_h, weight, bias)) if config is not None
                          else F.linear(t_h, weight, bias))
        return z.argmax(-1), F.nll_loss(F.log_softmax(z, -1), y, ignore_index=ignore_index, reduction="none")

    with torch.no_grad():  # this rank's rows; their greedy tokens are then gathered (every step reads ahead)
        mine = target_hidden[:, start:start + T]
        best, target_ce = chunked_rows(target_side, [mine.flatten(0, 1), labels.flatten()], chunk_tokens)
    scores = UnrollScores([], [], [], gather(best.view(B, T), 1), target_ce.view(B, T))
    # The teacher restricted to the draft's ids is the target's head restricted to their rows (its logit transform
    # is elementwise: restricting before or after it is the same).
    t_weight = weight if from_draft is None else weight[from_draft]
    t_bias = bias if from_draft is None or bias is None else bias[from_draft]
    label = draft_labels(whole_labels, to_draft)

    def step_chunk(h, t_h, y):
        with torch.no_grad():  # the teacher is fixed: recomputed in backward, never differentiated
            z = F.linear(t_h, t_weight, t_bias)
            teacher_logp = F.log_softmax(at_least_fp32(model_logits(config, z) if config is not None else z), -1)
        return row_scores(draft_logits(h), teacher_logp, y)

    for k, h in enumerate(hidden):
        ahead = lead + k
        n = min(T, N - ahead - start)  # rows whose index t + ahead exists
        if n <= 0:
            break
        ce, kl, guess = chunked_rows(step_chunk, [h[:, :n].flatten(0, 1),
                                                  target_hidden[:, start + ahead:start + ahead + n].flatten(0, 1),
                                                  label[:, start + ahead:start + ahead + n].flatten()], chunk_tokens)
        scores.ce.append(ce.view(B, n)), scores.kl.append(kl.view(B, n))
        guess = guess.view(B, n)
        scores.guess.append(guess if from_draft is None else from_draft[guess])
    return scores
