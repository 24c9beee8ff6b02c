"""An eagle3 draft run's objective: the training-time-test unroll scored against the target (drafts/ttt.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treadle.data.packed import IGNORE_INDEX
from treadle.metrics.agreement import counts
from treadle.drafts.glide.model import anchored_positions
from treadle.drafts.glide.objective import GlideObjective
from treadle.drafts.run_model import batch_reads
from treadle.drafts.ttt import DraftVocabulary, ttt_steps, unroll_chunk_tokens, unroll_loss, unrolled_losses
from treadle.models.upcast import at_least_fp32

if TYPE_CHECKING:
    from treadle.train.step import Batch


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
        # Evaluation runs the whole unroll too: its loss is step 0's CE (comparable across runs), its eval_acc_k the
        # agreement of every step.
        steps = ttt_steps(self.cfg)
        out = model(input_ids=batch["input_ids"], position_ids=anchored_positions(positions, self.cfg.anchor_positions,
                    offset), steps=steps, doc_position_ids=positions, labels=labels, reads=batch_reads(batch))
        draft = model.draft_model
        vocab = DraftVocabulary(draft.target_to_draft(), draft.t2d, draft.draft_to_target()) if draft.reduced else None
        if out.scores is not None:  # a chunked loss (model.loss_chunk_tokens): per-row scores, logits never whole
            s = out.scores
            target_ce = s.target_ce.sum()
            loss, side = unroll_loss(self.cfg, s, s.positions, s.labels, vocab, start=s.start)
        else:
            target_log = F.log_softmax(at_least_fp32(out.target_logits), -1)
            target_ce = F.nll_loss(target_log.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            loss, side = unrolled_losses(self.cfg, out.logits[:steps], out.target_logits, positions, labels, vocab)
        if not train:
            return side["draft_ce"], {"target_loss": target_ce, **counts(side)}
        return loss, {"target_loss": target_ce, **side}


def eagle3_setup(cfg, model, datasets) -> Eagle3Objective:
    """What an eagle3 run adds to a draft run's setup: the chunked loss's setting resolved (auto always chunks under
    context parallelism), its vocabulary map (from the training data's token counts, unless the draft starts from
    ``draft.init``) and its objective."""
    import numpy as np

    from treadle.drafts.eagle3.model import frequent_tokens

    model.loss_chunk_tokens = unroll_chunk_tokens(cfg, model.target.config)
    draft = model.draft_model
    if draft.reduced and cfg.draft.init is None:  # a draft.init brings its own map, which its head was trained on
        counts = sum(np.asarray(ds.token_counts(draft.target_vocab_size)) for ds in datasets)
        draft.set_vocabulary(frequent_tokens(torch.from_numpy(counts), draft.vocab_size))
    return Eagle3Objective(cfg.draft, model.target.config.max_position_embeddings, cfg.data.seq_len, cfg.train.seed)

