"""A draft run: the ordinary loop, with a frozen target and a GLIDE draft as the model.

What differs from pretraining lives here and nowhere in the loop: loading the target,
the objective (with its KV lag and position offsets), acceptance measured at eval time,
and the draft-only export.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treadle.config import DraftConfig
from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError
from treadle.drafts.glide.model import anchored_positions
from treadle.models.upcast import at_least_fp32
from treadle.speculative.acceptance import chain_acceptance, lookup_tau
from treadle.train.callbacks import Callback, EvalCallback
from treadle.train.step import Batch, row_cross_entropy
from treadle.train.ttt import ttt_steps, unrolled_losses

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer


# ----------------------------------------------------------------------------- the objective


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
        return what + (f", summed over {steps} unroll steps weighted {c.ttt_decay:g}^k" if steps > 1 else "")

    eval_label = "the draft's cross-entropy on the data"

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
                        steps=steps)
            loss, side = unrolled_losses(self.cfg, [out.logits, *out.chain_logits], out.target_logits, positions,
                                         labels, lead=0)
            return loss, {"target_loss": row_cross_entropy(out.target_logits, labels).sum(), **side}
        out = model(input_ids=batch["input_ids"], position_ids=shifted, lag=lag, doc_position_ids=positions,
                    labels=labels)
        if out.logits is None:  # a chunked loss (model.loss_chunk_tokens): per-token scores, logits never whole
            ce, kl, target_ce = out.token_ce.sum(-1), out.token_kl.sum(-1), out.target_token_ce.sum()
        else:
            ce = row_cross_entropy(out.logits, labels)
            target_ce = row_cross_entropy(out.target_logits, labels).sum()
            if train:  # evaluation reports the CE alone
                kl = (F.kl_div(F.log_softmax(at_least_fp32(out.logits), -1), F.log_softmax(at_least_fp32(out.target_logits), -1),
                               log_target=True, reduction="none").sum(-1) * (labels != IGNORE_INDEX)).sum(-1)
        if not train:
            return ce, {"target_loss": target_ce}
        if self.cfg.loss == "mix":
            loss = (1.0 - self.cfg.kl_weight) * ce + self.cfg.kl_weight * kl
        else:
            loss = ce if self.cfg.loss == "ce" else kl
        return loss, {"target_loss": target_ce, "draft_ce": ce.detach().sum(), "draft_kl": kl.detach().sum()}


# ----------------------------------------------------------------------------- callbacks


def eval_prompts(dataset, n: int, prompt_len: int) -> torch.Tensor:
    """The first ``n`` held-out windows cut to ``prompt_len`` tokens: fixed, so every eval sees the same text."""
    if prompt_len > dataset.seq_len:
        raise UserError(f"draft.eval_prompt_len = {prompt_len} exceeds data.seq_len = {dataset.seq_len}")
    count = min(n, len(dataset))
    return torch.stack([dataset[i]["input_ids"][:prompt_len] for i in range(count)])


# Prompt lookup (no model) gaining half of what a perfect draft gains on the target's own greedy text means that
# text loops. Natural text is far below: the built-in corpus's held-out Python gives tau 1.7 of 5 at gamma 4, an
# under-trained demo target that writes "the the the ..." 3.7.
DEGENERATE_LOOKUP_SHARE = 0.5


def degenerate_target_warning(texts: torch.Tensor, prompt_len: int, gamma: int) -> str | None:
    """One line when the target's greedy continuations repeat themselves, else None."""
    tau = lookup_tau(texts, prompt_len, gamma)
    if tau - 1 < DEGENERATE_LOOKUP_SHARE * gamma:
        return None
    return (f"treadle: warning: the target looks degenerate: its greedy continuations of the eval prompts repeat "
            f"themselves (prompt lookup, with no model, reaches tau {tau:.2f} of at most {gamma + 1} on them), so a "
            "tau_sim near its ceiling says little about the draft; use a target that writes varied text "
            "(trained longer, or a real model)")


class AcceptanceCallback(EvalCallback):
    """tau_sim and per-position acceptance of the draft, on the eval cadence (start unless off, every N, end).

    The target's greedy continuations of fixed held-out prompts are generated once per
    process (the target is frozen, so they never change) and scored by ``chain_acceptance``.
    """

    def __init__(self, cfg: DraftConfig, prompts: torch.Tensor, eval_every: int, at_start: bool = True):
        super().__init__(eval_every, at_start)
        self.cfg = cfg
        self.prompts = prompts
        self.texts: torch.Tensor | None = None

    def describe(self, trainer: Trainer) -> str:
        first = ", the target's continuations generated first" if self.texts is None else ""
        return f"acceptance (tau_sim) on {len(self.prompts)} prompts{first}"

    def measure(self, trainer: Trainer) -> dict:
        # Every rank measures the same prompts: the methods gather sharded weights collectively.
        model = trainer.engine.module
        t0 = time.perf_counter()
        model.eval()
        if self.texts is None:
            self.texts = model.continue_greedily(self.prompts.to(trainer.engine.device), self.cfg.eval_new_tokens)
            if trainer.console.enabled:  # the rank that prints; once: the target and its texts never change
                warning = degenerate_target_warning(self.texts, self.prompts.shape[1], self.cfg.gamma)
                if warning is not None:
                    trainer.console.print(warning)
        with trainer.autocast():
            got = chain_acceptance(model, self.texts, self.prompts.shape[1], self.cfg.gamma)
        model.train()
        return {"tau_sim": got["tau_sim"], **{f"accept_{k + 1}": a for k, a in enumerate(got["acceptance_conditional"])},
                "acceptance_s": round(time.perf_counter() - t0, 3)}


class DraftExportCallback(Callback):
    """At the end, the draft alone: ``<output_dir>/draft`` (see ``export_draft``)."""

    def __init__(self, out_dir: Path, target_dir: Path, identity: dict, cfg: DraftConfig):
        self.out_dir, self.target_dir, self.identity, self.cfg = out_dir, target_dir, identity, cfg

    def on_train_end(self, trainer: Trainer) -> None:
        from treadle.checkpoint.export import export_draft

        weights = trainer.engine.export_state_dict()  # every rank: gathering may be collective
        if trainer.engine.rank == 0:
            export_draft(trainer.engine.module, weights, self.out_dir, self.target_dir, self.identity, self.cfg,
                         step=trainer.state.step)

