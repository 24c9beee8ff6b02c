"""An eagle3 draft run's objective: the training-time-test unroll scored against the target, step by step.

Alignment (models/eagle3.py): step k's row t guesses token t + k + 2, i.e. it is scored
against the target at index t + 1 + k (its distribution there, or the data label there).
Row t is scored at step k iff index t + 1 + k exists, lies in row t's document and has a
label: the loss mask moves with the unroll (the bug class of SpecForge#885 is a mask that
does not). Normalization: every scored row adds ``ttt_decay**k`` times its loss to the
micro-batch's sum, which the loop divides by the step's label tokens like any loss, so the
result does not depend on how the step is split into micro-batches or ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.config import DraftConfig
from treadle.data.packed import IGNORE_INDEX
from treadle.models.glide import anchored_positions, document_ids
from treadle.train.callbacks import Callback
from treadle.train.draft import GlideObjective
from treadle.train.step import Batch, StepResult

DEFAULT_TTT_STEPS = 7


def ttt_steps(cfg: DraftConfig) -> int:
    return cfg.ttt_steps or DEFAULT_TTT_STEPS


def scored_rows(position_ids: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T - 1 - step] bool: rows t whose step-``step`` guess is scored (index t + 1 + step in t's document, labelled)."""
    doc = document_ids(position_ids)
    ahead = 1 + step
    return (doc[:, :-ahead] == doc[:, ahead:]) & (labels[:, ahead:] != IGNORE_INDEX)


class Eagle3Objective(GlideObjective):
    """The draft's summed TTT loss of a micro-batch (ce / kl / mix as for GLIDE) plus reported side sums.

    Side sums: ``target_loss`` (the target's own CE, the floor), ``draft_ce`` / ``draft_kl`` (step 0's), and per
    step ``ttt_hits_k`` / ``ttt_rows_k`` that ``TTTAccuracyCallback`` turns into ``acc_k``.
    """

    def __call__(self, model, batch: Batch):
        _, offset = self._draw(batch)
        return self.losses(model, batch, 0, offset, train=True)

    def losses(self, model, batch: Batch, lag: int, offset: int, train: bool):
        positions = batch["position_ids"]
        labels = batch["labels"]
        steps = ttt_steps(self.cfg) if train else 1  # evaluation: step 0's CE, comparable across runs
        out = model(input_ids=batch["input_ids"], position_ids=anchored_positions(positions, self.cfg.anchor_positions,
                    offset), steps=steps, doc_position_ids=positions)
        draft = model.draft_model
        to_draft = draft.target_to_draft()
        in_vocab = draft.t2d if draft.reduced else None
        from_draft = draft.draft_to_target()
        T = labels.shape[1]
        target_log = F.log_softmax(out.target_logits.float(), -1)
        target_ce = F.nll_loss(target_log.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = labels.new_zeros(labels.shape[0], dtype=torch.float32)
        side: dict[str, torch.Tensor] = {"target_loss": target_ce}
        for k, logits in enumerate(out.logits[:steps]):
            ahead = 1 + k
            if ahead >= T:
                break
            rows = scored_rows(positions, labels, k)
            logits = logits[:, : T - ahead].float()
            label = labels[:, ahead:]
            teacher = out.target_logits[:, ahead:].float()
            best = teacher.argmax(-1)  # the target's greedy token: what acceptance compares with
            ce_rows, kl_rows = rows, rows
            if to_draft is not None:  # a reduced head: score within its vocabulary (EAGLE-3's rule)
                label = to_draft[label.clamp_min(0)]
                ce_rows = rows & (label >= 0)
                kl_rows = rows & in_vocab[best]
                teacher = teacher[..., from_draft]
            log_q = F.log_softmax(logits, -1)
            ce = (F.nll_loss(log_q.transpose(1, 2), label.clamp_min(0), reduction="none") * ce_rows).sum(-1)
            kl = (F.kl_div(log_q, F.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)
                  * kl_rows).sum(-1)
            if self.cfg.loss == "mix":
                step_loss = (1.0 - self.cfg.kl_weight) * ce + self.cfg.kl_weight * kl
            else:
                step_loss = ce if self.cfg.loss == "ce" else kl
            loss = loss + self.cfg.ttt_decay ** k * step_loss
            if k == 0:
                side["draft_ce"], side["draft_kl"] = ce.detach().sum(), kl.detach().sum()
            guess = draft.to_target_ids(logits.argmax(-1))
            side[f"ttt_hits_{k + 1}"] = ((guess == best) & rows).sum().double()
            side[f"ttt_rows_{k + 1}"] = rows.sum().double()
        if not train:
            return side.pop("draft_ce"), {"target_loss": target_ce}
        return loss, side


class TTTAccuracyCallback(Callback):
    """After each step: ``acc_k``, the share of scored rows whose step-k guess is the target's greedy token.

    The objective reports hits and rows summed over the step's micro-batches and ranks (divided by the same label
    count, which cancels here); runs before the metrics callback, which logs ``acc_k`` in their place.
    """

    def on_step_end(self, trainer, result: StepResult) -> None:
        m = result.metrics
        k = 1
        while f"ttt_rows_{k}" in m:
            hits, rows = m.pop(f"ttt_hits_{k}"), m.pop(f"ttt_rows_{k}")
            if rows > 0:
                m[f"acc_{k}"] = hits / rows
            k += 1


def eagle3_setup(cfg, model, datasets) -> Eagle3Objective:
    """What an eagle3 run adds to a draft run's setup: its vocabulary map (from the training data's token counts)
    and its objective. The chunked loss is not built for it: an explicit ``model.loss_chunk_tokens`` is refused."""
    import numpy as np

    from treadle.errors import UserError
    from treadle.models.eagle3 import frequent_tokens

    chunk = cfg.model.loss_chunk_tokens
    if chunk != "auto" and int(chunk) > 0:
        raise UserError(f"model.loss_chunk_tokens = {chunk} with draft.kind = 'eagle3': the chunked loss is not "
                        "built for eagle3 drafts (draft.vocab_size shrinks its head instead); accepted: 0 or auto")
    draft = model.draft_model
    if draft.reduced:
        counts = sum(np.asarray(ds.token_counts(draft.target_vocab_size)) for ds in datasets)
        draft.set_vocabulary(frequent_tokens(torch.from_numpy(counts), draft.vocab_size))
    return Eagle3Objective(cfg.draft, model.target.config.max_position_embeddings, cfg.data.seq_len, cfg.train.seed)
