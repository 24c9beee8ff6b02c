"""A GLIDE draft run's objective: the draft's loss per micro-batch (its KV lag and position offsets drawn there),
and glide_setup, what a GLIDE run adds to a draft run's setup."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treadle.config import DraftConfig
from treadle.data.packed import IGNORE_INDEX, row_cross_entropy
from treadle.drafts.glide.model import anchored_positions
from treadle.drafts.run_model import batch_reads
from treadle.drafts.ttt import refuse_chunked_loss, ttt_steps, unrolled_losses
from treadle.models.chunked_ce import resolve_chunk_tokens
from treadle.models.upcast import at_least_fp32

if TYPE_CHECKING:
    from treadle.train.step import Batch


class GlideObjective:
    """Summed draft loss of a micro-batch, plus the target's own loss as a reference floor.

    ``ce`` trains on the next data token (LongSpec); ``kl`` on the target's
    distribution, KL(target || draft), which is what acceptance rewards; ``mix``
    weights them. Both are summed over label tokens, so the loop normalizes them by
    the step's token count like any loss.
    """

    def __init__(self, cfg: DraftConfig, max_positions: int, seq_len: int, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.max_offset = max(0, min(cfg.max_position_offset, max_positions - seq_len))

    def _draw(self, batch: Batch) -> tuple[int, int]:
        """This micro-batch's lag and position offset.

        Drawn from (seed, the micro-batch's first position in the global sample order): the
        same micro-batch gets the same draw at any world size and after any resume.
        """
        first = int(batch["order_position"][0]) if "order_position" in batch else 0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + first)
        # A training-time test of K steps trains links lag..lag + K - 1 of a chain: lags up to gamma - K + 1 start it.
        top = max(1, self.cfg.gamma - ttt_steps(self.cfg) + 1) if self.cfg.kind == "glide" else self.cfg.gamma
        lag = int(torch.randint(1, top + 1, (), generator=g)) if self.cfg.kv_lag else 1
        offset = int(torch.randint(0, self.max_offset + 1, (), generator=g)) if self.max_offset else 0
        return lag, offset

    @property
    def label(self) -> str:
        """What the training loss is, for the run's summary (the eval loss is ``eval_label``)."""
        c = self.cfg
        what = {"ce": "cross-entropy on the data", "kl": "KL(target || draft)",
                "mix": f"{1 - c.kl_weight:g} cross-entropy + {c.kl_weight:g} KL(target || draft)"}[c.loss]
        steps = ttt_steps(c)
        if steps > 1:
            return f"{what}, summed over {steps} unroll steps weighted {c.ttt_decay:g}^k, per label token"
        return f"{what} per label token"

    eval_label = "the draft's cross-entropy on the data per label token"

    def __call__(self, model, batch: Batch):
        lag, offset = self._draw(batch)
        return self.losses(model, batch, lag, offset, train=True)

    def evaluate(self, model, batch: Batch):
        """Eval loss: the draft's CE at lag 1 without offsets, the number a user compares across runs."""
        return self.losses(model, batch, lag=1, offset=0, train=False)

    def losses(self, model, batch: Batch, lag: int, offset: int, train: bool):
        positions = batch["position_ids"]
        shifted = anchored_positions(positions, self.cfg.anchor_positions, offset)
        labels = batch["labels"]
        steps = ttt_steps(self.cfg) if train else 1  # evaluation: the teacher-forced CE, comparable across runs
        if steps > 1:  # training-time test (drafts/glide/model.py): step k scored at row t's token t + k + 1
            out = model(input_ids=batch["input_ids"], position_ids=shifted, lag=lag, doc_position_ids=positions,
                        steps=steps, reads=batch_reads(batch))
            loss, side = unrolled_losses(self.cfg, [out.logits, *out.chain_logits], out.target_logits, positions,
                                         labels, lead=0)
            return loss, {"target_loss": row_cross_entropy(out.target_logits, labels).sum(), **side}
        out = model(input_ids=batch["input_ids"], position_ids=shifted, lag=lag, doc_position_ids=positions,
                    labels=labels, reads=batch_reads(batch))
        scored = labels != IGNORE_INDEX
        if out.logits is None:  # a chunked loss (model.loss_chunk_tokens): per-token scores, logits never whole
            ce, kl, target_ce = out.token_ce.sum(-1), out.token_kl.sum(-1), out.target_token_ce.sum()
            hit = out.token_hit
        else:
            ce = row_cross_entropy(out.logits, labels)
            target_ce = row_cross_entropy(out.target_logits, labels).sum()
            hit = None if train else (out.logits.argmax(-1) == out.target_logits.argmax(-1)) & scored
            if train:  # evaluation reports the CE alone
                kl = (F.kl_div(F.log_softmax(at_least_fp32(out.logits), -1), F.log_softmax(at_least_fp32(out.target_logits), -1),
                               log_target=True, reduction="none").sum(-1) * scored).sum(-1)
        if not train:  # the CE and the draft's top-1 agreement with the target (eval_acc_1: metrics/agreement.py)
            return ce, {"target_loss": target_ce, "ttt_hits_1": hit.sum().double(), "ttt_rows_1": scored.sum().double()}
        if self.cfg.loss == "mix":
            loss = (1.0 - self.cfg.kl_weight) * ce + self.cfg.kl_weight * kl
        else:
            loss = ce if self.cfg.loss == "ce" else kl
        return loss, {"target_loss": target_ce, "draft_ce": ce.detach().sum(), "draft_kl": kl.detach().sum()}


def glide_setup(cfg, model) -> GlideObjective:
    """What a GLIDE run adds to a draft run's setup: the chunked loss's setting checked against its objective (an
    unroll scores whole logits per step; otherwise draft and target are scored chunk by chunk), and the objective."""
    if ttt_steps(cfg.draft) > 1:  # GLIDE's training-time test scores whole logits per step
        refuse_chunked_loss(cfg.model.loss_chunk_tokens, f"draft.ttt_steps = {cfg.draft.ttt_steps}",
                            "or draft.ttt_steps = 1")
    else:
        # The draft and the target share the target's head: both are scored chunk by chunk (GlideModel.forward),
        # the target's logit transform (Gemma's soft-cap, Granite's scale) applied inside each chunk.
        model.loss_chunk_tokens = resolve_chunk_tokens(cfg.model.loss_chunk_tokens, model.target.config.vocab_size)
    return GlideObjective(cfg.draft, model.target.config.max_position_embeddings, cfg.data.seq_len, cfg.train.seed)
