"""A training-time-test unroll scored against the target, step by step (EAGLE-3's and GLIDE's ``draft.ttt_steps``).

Alignment: step 0's row t is scored ``lead`` indices ahead (EAGLE-3: 1, its row t holds the
embedding of token t + 1 and guesses token t + 2; GLIDE: 0, row t holds token t and guesses
t + 1), step k's row t at index t + lead + k: against the target's distribution there, or the
data label there. Row t is scored at step k iff that index exists, lies in row t's document
and has a label: the loss mask moves with the unroll (the bug class of SpecForge#885 is a mask that does not). Normalization:
every scored row adds ``ttt_decay**k`` times its loss to the micro-batch's sum, which the
loop divides by the step's label tokens like any loss, so the result does not depend on how
the step is split into micro-batches or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.config import DraftConfig
from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError
from treadle.drafts.glide.model import document_ids
from treadle.drafts.settings import default_ttt_steps
from treadle.drafts.ttt_scores import UnrollScores, dense_unroll_scores


def ttt_steps(cfg: DraftConfig) -> int:
    return cfg.ttt_steps or default_ttt_steps(cfg.kind)


def refuse_chunked_loss(setting: int | str, what: str, otherwise: str) -> None:
    """GLIDE's unroll scores whole logits per step (EAGLE-3's scores chunk by chunk): an explicit
    ``model.loss_chunk_tokens`` is refused in one line."""
    if setting != "auto" and int(setting) > 0:
        raise UserError(f"model.loss_chunk_tokens = {setting} with {what}: the chunked loss is not built for GLIDE's "
                        f"training-time-test unroll; accepted: 0 or auto (off), {otherwise}")


def scored_rows(position_ids: torch.Tensor, labels: torch.Tensor, step: int, lead: int = 1) -> torch.Tensor:
    """[B, T - lead - step] bool: rows t whose step-``step`` guess is scored (index t + lead + step in t's
    document, labelled)."""
    doc = document_ids(position_ids)
    ahead = lead + step
    return (doc[:, : doc.shape[1] - ahead] == doc[:, ahead:]) & (labels[:, ahead:] != IGNORE_INDEX)


@dataclass
class DraftVocabulary:
    """A draft head over part of the target's vocabulary (EAGLE-3's ``draft.vocab_size``): maps between the two."""

    to_draft: torch.Tensor  # [target vocab] draft id of each target id, -1 outside
    in_vocab: torch.Tensor  # [target vocab] bool
    from_draft: torch.Tensor  # [draft vocab] target id of each draft id


def unrolled_losses(cfg: DraftConfig, step_logits: list[torch.Tensor], target_logits: torch.Tensor,
                    positions: torch.Tensor, labels: torch.Tensor, vocab: DraftVocabulary | None = None,
                    lead: int = 1):
    """(per-row summed loss [B], side sums) of an unroll's whole ``step_logits`` (``unroll_loss``)."""
    scores = dense_unroll_scores(step_logits, target_logits, labels, vocab and vocab.to_draft,
                                 vocab and vocab.from_draft, lead)
    return unroll_loss(cfg, scores, positions, labels, vocab, lead)


def unroll_loss(cfg: DraftConfig, scores: UnrollScores, positions: torch.Tensor, labels: torch.Tensor,
                vocab: DraftVocabulary | None = None, lead: int = 1, start: int = 0):
    """(per-row summed loss [B], side sums) of an unroll's per-row ``scores`` (ce / kl / mix as for GLIDE).

    Side sums: ``draft_ce`` / ``draft_kl`` (step 0's), and per step ``ttt_hits_k`` / ``ttt_rows_k`` that
    ``TTTAccuracyCallback`` turns into ``acc_k``. A reduced ``vocab`` scores within the draft's vocabulary
    (EAGLE-3's rule: labels and teacher argmaxes outside it are not scored). ``lead``: see the module docstring.
    ``positions`` and ``labels`` are the whole sequence's; the scores' rows start at index ``start`` (context
    parallelism: this rank's slice; the ranks' sums add up to one process's).
    """
    side: dict[str, torch.Tensor] = {}
    loss = labels.new_zeros(labels.shape[0], dtype=scores.ce[0].dtype if scores.ce else torch.float32)
    for k, (ce, kl, guess) in enumerate(zip(scores.ce, scores.kl, scores.guess)):
        ahead, n = lead + k, ce.shape[1]
        rows = scored_rows(positions, labels, k, lead)[:, start:start + n]
        best = scores.target_best[:, start + ahead:start + ahead + n]
        ce_rows, kl_rows = rows, rows
        if vocab is not None:
            ce_rows = rows & (vocab.to_draft[labels[:, start + ahead:start + ahead + n].clamp_min(0)] >= 0)
            kl_rows = rows & vocab.in_vocab[best]
        ce, kl = (ce * ce_rows).sum(-1), (kl * kl_rows).sum(-1)
        if cfg.loss == "mix":
            step_loss = (1.0 - cfg.kl_weight) * ce + cfg.kl_weight * kl
        else:
            step_loss = ce if cfg.loss == "ce" else kl
        loss = loss + cfg.ttt_decay ** k * step_loss
        if k == 0:
            side["draft_ce"], side["draft_kl"] = ce.detach().sum(), kl.detach().sum()
        side[f"ttt_hits_{k + 1}"] = ((guess == best) & rows).sum().double()
        side[f"ttt_rows_{k + 1}"] = rows.sum().double()
    return loss, side


def unroll_chunk_tokens(cfg, target_config) -> int:
    """``model.loss_chunk_tokens`` for a kind whose unroll scores through the target's head (eagle3, mtp): a chunk of
    rows at a time, the target's logit transform (Gemma's soft-cap, Granite's scale) applied inside each chunk; 0
    (whole logits) where the target transforms its logits in a way the chunked teacher does not apply and the setting
    allows it."""
    from treadle.models.chunked_ce import AUTO_CHUNK_TOKENS, resolve_chunk_tokens, unhandled_logit_transforms

    setting, cp = cfg.model.loss_chunk_tokens, cfg.distributed.context_parallel
    if setting == "auto" and cp > 1:
        setting = AUTO_CHUNK_TOKENS  # a slice is scored only chunk by chunk (its rows read the next slice's teacher)
    chunk = resolve_chunk_tokens(setting, target_config.vocab_size)
    unhandled = chunk and unhandled_logit_transforms(target_config)
    if unhandled:  # GLIDE refuses such a target outright (drafts/targets.py); the whole-logits loss reads its logits
        if setting != "auto" or cp > 1:
            raise UserError(f"model.loss_chunk_tokens = {cfg.model.loss_chunk_tokens} with an {cfg.draft.kind} draft: "
                            f"the target transforms its logits ({', '.join(unhandled)}) in a way the chunked teacher "
                            "does not apply; accepted: model.loss_chunk_tokens = 0 (and distributed.context_parallel = "
                            "1)")
        chunk = 0
    return chunk

