"""A draft run: the ordinary loop, with a frozen target and a draft as the model.

What differs from pretraining lives here and nowhere in the loop, for every draft kind: acceptance measured
at eval time, the training-time test's accuracy, and the draft-only export. Loading the target and each
kind's objective live with the kinds (drafts/).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treadle.config import DraftConfig
from treadle.metrics.agreement import rates
from treadle.errors import UserError
from treadle.speculative.acceptance import chain_acceptance, degenerate_target_warning, lookup_tau
from treadle.train.callbacks import Callback, EvalCallback, FinalExport
from treadle.train.step import StepResult

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer


# ----------------------------------------------------------------------------- callbacks


def eval_prompts(dataset, n: int, prompt_len: int) -> torch.Tensor:
    """The first ``n`` held-out windows cut to ``prompt_len`` tokens: fixed, so every eval sees the same text."""
    if prompt_len > dataset.seq_len:
        raise UserError(f"draft.eval_prompt_len = {prompt_len} exceeds data.seq_len = {dataset.seq_len}")
    count = min(n, len(dataset))
    return torch.stack([dataset[i]["input_ids"][:prompt_len] for i in range(count)])


# How the drafts of the acceptance eval are computed, per model.dtype: the run's own forward (the draft is scored as
# it trains). spec-eval decodes at its --dtype (fp32 by default): on the same prompts at the same precision the two
# agree (tests/test_eagle3.py), across precisions they need not, so the eval line says which it ran.
EVAL_PRECISION = {"fp32": "fp32", "bf16": "bf16 autocast", "bf16-weights": "bf16 weights"}


class AcceptanceCallback(EvalCallback):
    """tau_sim and per-position acceptance of the draft, on the eval cadence (start unless off, every N, end).

    The target's greedy continuations of fixed held-out prompts are generated once per
    process in fp32 (the target is frozen, so they never change) and scored by ``chain_acceptance``
    under the run's precision, over the rounds a greedy decode of them runs: what ``treadle
    spec-eval`` measures on these prompts at that precision.
    """

    def __init__(self, cfg: DraftConfig, prompts: torch.Tensor, eval_every: int, at_start: bool = True):
        super().__init__(eval_every, at_start)
        self.cfg = cfg
        self.prompts = prompts
        self.texts: torch.Tensor | None = None

    def describe(self, trainer: Trainer) -> str:
        first = ", the target's continuations generated first" if self.texts is None else ""
        precision = EVAL_PRECISION.get(trainer.cfg.model.dtype, trainer.cfg.model.dtype)
        return f"acceptance (tau_sim, drafts in {precision}) on {len(self.prompts)} prompts{first}"

    def scored_model(self, trainer: Trainer) -> torch.nn.Module:
        """The draft run model scored (a draft run's: the model the engine trains)."""
        return trainer.engine.module

    def measure(self, trainer: Trainer) -> dict:
        # Every rank measures the same prompts: the methods gather sharded weights collectively.
        model = self.scored_model(trainer)
        t0 = time.perf_counter()
        model.eval()
        if self.texts is None:
            self.texts = model.continue_greedily(self.prompts.to(trainer.engine.device), self.cfg.eval_new_tokens)
            if trainer.console.enabled:  # the rank that prints; once: the target and its texts never change
                lookup = lookup_tau(self.texts, self.prompts.shape[1], self.cfg.gamma)
                warning = degenerate_target_warning(lookup, self.cfg.gamma)
                if warning is not None:
                    trainer.console.print(warning)
        with trainer.autocast():
            got = chain_acceptance(model, self.texts, self.prompts.shape[1], self.cfg.gamma)
        model.train()
        # acceptance_rounds: the rounds behind accept_1; accept_k's own count is acceptance_rounds times the product of
        # accept_1 .. accept_{k-1} (the rounds that reached position k: metrics/report.py annotates them)
        return {"tau_sim": got["tau_sim"], **{f"accept_{k + 1}": a for k, a in enumerate(got["acceptance_conditional"])},
                "acceptance_rounds": got["rounds"], "acceptance_s": round(time.perf_counter() - t0, 3)}


class DraftExportCallback(FinalExport):
    """At the end, the draft alone: ``<output_dir>/draft`` (see ``export_draft``)."""

    def __init__(self, out_dir: Path, target_dir: Path, identity: dict, cfg: DraftConfig):
        self.out_dir, self.target_dir, self.identity, self.cfg = out_dir, target_dir, identity, cfg

    def on_train_end(self, trainer: Trainer) -> None:
        from treadle.checkpoint.export import export_draft

        weights = trainer.engine.export_state_dict()  # every rank: gathering may be collective
        if trainer.engine.rank == 0:
            export_draft(trainer.engine.module, weights, self.out_dir, self.target_dir, self.identity, self.cfg,
                         step=trainer.state.step)


class TTTAccuracyCallback(Callback):
    """After each step: ``acc_k``, the share of scored rows whose step-k guess is the target's greedy token, and for a
    block draft ``eal``, its expected accepted drafts per block (drafts/dflash/objective.py).

    The objective reports hits and rows summed over the step's micro-batches and ranks (divided by the same label
    count, which cancels here); runs before the metrics callback, which logs ``acc_k`` in their place.
    """

    def on_step_end(self, trainer, result: StepResult) -> None:
        rates(result.metrics)  # the evaluation's eval_acc_k come from the same helper (train/callbacks.py)
