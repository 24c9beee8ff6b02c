"""Periodic work hangs off the loop as stateful callbacks, not ``if`` branches in it.

A callback sees the trainer at three moments (start, after each step, end) and
may keep state; ``state_dict`` is saved in every checkpoint (JSON) so a resumed
run knows, e.g., its starting loss and the last step it evaluated.
Order matters at the end of a run: metrics, eval, checkpoint, export.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treadle import distributed
from treadle.metrics.agreement import rates
from treadle.metrics.flops import memory_window
from treadle.train.step import StepResult, label_tokens, split_loss

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer


class Callback:
    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None: ...

    def on_train_end(self, trainer: Trainer) -> None:
        """The run reached train.max_steps."""

    def on_stop(self, trainer: Trainer) -> None:
        """The run stops early but resumably (signal, time limit): only what resuming needs."""

    def owed(self, trainer: Trainer) -> list[Path] | None:
        """What of this callback's end-of-run output is missing for the step a finished run ended at (a kill after
        its final checkpoint, before its export landed), on rank 0 (the writer; [] elsewhere); a finished run run
        again has ``write_owed`` write it. None: the callback writes nothing a finished run owes."""
        return None

    def write_owed(self, trainer: Trainer, missing: list[Path]) -> None:
        """Write what ``owed`` found missing (``missing``: rank 0's list, [] elsewhere), from the final checkpoint."""
        self.on_train_end(trainer)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def is_log_step(step: int, log_every: int, max_steps: int) -> bool:
    """Whether ``step`` writes a metrics record: every ``log_every`` steps, and the last one."""
    return step % log_every == 0 or step == max_steps


class MetricsCallback(Callback):
    """Every ``log_every`` steps: one metrics.jsonl record and a console update.

    With the model's FLOPs per token: ``tflops_per_s`` (per device) and, with the device's peak, ``mfu``; and the
    window's peak memory (``metrics/flops.py``), the max over ranks.
    """

    def __init__(self, log_every: int, flops_per_token: float = 0.0, peak_tflops: float | None = None):
        self.log_every = log_every
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._window_steps = 0
        self._window_tokens = 0
        self._window_seconds = 0.0
        self._window_data_seconds = 0.0
        self._window_sources: dict[str, list[float]] = {}  # name -> [summed loss, label tokens] since the last record

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        st = trainer.state
        self._window_steps += 1
        self._window_tokens += trainer.tokens_per_step
        self._window_seconds += trainer.last_step_seconds
        self._window_data_seconds += trainer.last_data_seconds
        for name, (loss, count) in result.by_source.items():
            acc = self._window_sources.setdefault(name, [0.0, 0])
            acc[0] += loss * count
            acc[1] += count
        if self.first_loss is None:
            self.first_loss = result.loss
        self.last_loss = result.loss
        trainer.console.step(st.step)
        if not is_log_step(st.step, self.log_every, trainer.max_steps):
            return
        record = {
            "step": st.step,
            "loss": result.loss,
            "lr": trainer.last_lr,  # the lr this step used (the schedule has already moved on)
            "grad_norm": result.grad_norm,
            **result.metrics,
            "tokens": st.tokens,
            "tokens_per_s": self._window_tokens / max(self._window_seconds, 1e-9),
            "data_wait_s": self._window_data_seconds / self._window_steps,  # per step: what prefetch did not hide
            "elapsed_s": round(st.elapsed_s, 3),
        }
        record |= self._utilization(trainer)
        if trainer.sources:  # each source's token-weighted loss over the window, and its tokens so far
            record |= {f"loss/{n}": total / count for n, (total, count) in self._window_sources.items() if count}
            record |= {f"tokens/{n}": t for n, t in trainer.loader.tokens_by_source(trainer.cfg.data.seq_len).items()}
        if len(trainer.loader.mixture.phases) > 1:
            record["phase"] = trainer.loader.mixture.phase_index(st.step - 1)
        if st.skipped_steps:
            record["skipped_steps"] = st.skipped_steps
        trainer.log(record)
        self._window_steps, self._window_tokens, self._window_seconds, self._window_data_seconds = 0, 0, 0.0, 0.0
        self._window_sources = {}

    def _utilization(self, trainer: Trainer) -> dict:
        engine, out = trainer.engine, {}
        if self.flops_per_token:
            world = max(engine.world_size, 1)
            tflops = self.flops_per_token * self._window_tokens / max(self._window_seconds, 1e-9) / world / 1e12
            out["tflops_per_s"] = tflops
            if self.peak_tflops:
                out["mfu"] = tflops / self.peak_tflops
        memory = memory_window(engine.device)  # every rank, at every log step: the max is one collective
        if engine.world_size > 1:
            memory = dict(zip(memory, distributed.all_reduce_max(list(memory.values()), engine.device)))
        return out | {k: round(v, 4) for k, v in memory.items()}

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "last_loss": self.last_loss}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss, self.last_loss = state["first_loss"], state["last_loss"]


def evaluate(trainer: Trainer) -> tuple[float, int, dict[str, float]]:
    """Token-weighted mean loss over the validation batches, summed over ranks; side quantities likewise."""
    engine = trainer.engine
    names: list[str] = []

    def measure(model, batch) -> torch.Tensor:
        with trainer.autocast():
            summed, side = split_loss(trainer.eval_loss_fn(model, batch))
        names[:] = side
        return torch.stack([t.detach().double() for t in (label_tokens(batch), summed.sum(), *side.values())])

    total = engine.forward_only(trainer.val_batches(), measure)  # through a pipeline's stages, on a pipeline
    if total is None:
        return math.nan, 0, {}
    tokens, loss_total, *side_totals = engine.all_reduce_sum(total).tolist()
    denom = max(tokens, 1.0)
    return loss_total / denom, int(tokens), {f"eval_{n}": v / denom for n, v in zip(names, side_totals)}


class EvalCallback(Callback):
    """Validation loss and perplexity at the start (``at_start``), every ``eval_every`` steps and at the end.

    ``perplexity``: False for a draft run, whose eval loss is no model's per-token CE (a DFlash draft's sums the
    scored slots of a block), so exp of it is no perplexity. The eval loss's agreement counts (a draft's objective
    returns them) are logged as rates: ``eval_acc_k``, ``eval_eal`` (metrics/agreement.py, as the steps' ``acc_k``).
    Other evaluations on the same cadence (a draft's acceptance) override ``measure``.
    """

    def __init__(self, eval_every: int, at_start: bool = True, perplexity: bool = True):
        self.eval_every = eval_every
        self.at_start = at_start
        self.perplexity = perplexity
        self.first: dict | None = None
        self.last: dict | None = None

    def measure(self, trainer: Trainer) -> dict:
        t0 = time.perf_counter()
        loss, tokens, side = evaluate(trainer)
        ppl = {"eval_ppl": math.exp(min(loss, 50.0))} if self.perplexity else {}
        return {"eval_loss": loss, **ppl, **rates(side, "eval_"), "eval_tokens": tokens,
                "eval_s": round(time.perf_counter() - t0, 3)}

    def describe(self, trainer: Trainer) -> str:
        """What ``measure`` is about to do, for the line a plain log shows as it starts."""
        t, seq_len = trainer.cfg.train, trainer.cfg.data.seq_len
        return f"validation loss on {t.eval_batches} batches of {t.micro_batch_size} x {seq_len} tokens"

    def _run(self, trainer: Trainer) -> None:
        trainer.console.status(f"eval {trainer.state.step}: {self.describe(trainer)} ...")
        record = {"step": trainer.state.step, **self.measure(trainer)}
        self.first = self.first or record
        self.last = record
        trainer.log(record, kind="eval")

    def on_train_start(self, trainer: Trainer) -> None:
        # A fresh run: the starting point every later eval is compared to (without at_start, the first periodic
        # eval is). A resumed run has its own, restored with the callback's state.
        if self.at_start and self.first is None:
            self._run(trainer)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        # The last step's eval runs here too, not in on_train_end: then a checkpoint taken
        # at that step already holds it, and a run resumed there does not evaluate twice.
        step = trainer.state.step
        if (self.eval_every and step % self.eval_every == 0) or step == trainer.max_steps:
            self._run(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        if self.last is None or self.last["step"] != trainer.state.step:
            self._run(trainer)

    def state_dict(self) -> dict:
        return {"first": self.first, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.first, self.last = state["first"], state["last"]


class CheckpointCallback(Callback):
    """Every ``every`` steps, every ``every_s`` seconds of training, at the end, and when the run is asked to stop.

    Either interval may be 0 (off); whichever is due first saves, and a save of either kind restarts the clock.
    The clock is rank 0's: every rank must save the same step (a save is collective), so rank 0's verdict is
    shared by ``any_rank`` after each step, and only when the time interval is on. A resumed run starts
    from a checkpoint, so its clock starts at zero; the step interval counts from step 0 whatever the resumes.
    """

    def __init__(self, every: int, every_s: float = 0.0):
        self.every = every
        self.every_s = every_s
        self.last_saved: int | None = None
        self._since = time.monotonic()  # when the clock last restarted: the start, or the last save

    def _save(self, trainer: Trainer) -> None:
        if self.last_saved != trainer.state.step:
            trainer.save_checkpoint()
            self.last_saved = trainer.state.step
        self._since = time.monotonic()

    def _time_due(self, trainer: Trainer) -> bool:
        if not self.every_s:
            return False
        due = trainer.engine.rank == 0 and time.monotonic() - self._since >= self.every_s
        return trainer.engine.any_rank(due)

    def on_train_start(self, trainer: Trainer) -> None:
        # A resumed run already has the checkpoint of the step it starts from.
        self.last_saved = trainer.state.step if trainer.resumed_from is not None else None
        self._since = time.monotonic()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        by_steps = self.every and trainer.state.step % self.every == 0
        if self._time_due(trainer) or by_steps:  # the collective first: every rank joins it at every step
            self._save(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self._save(trainer)

    def on_stop(self, trainer: Trainer) -> None:
        self._save(trainer)


class FinalExport(Callback):
    """A callback whose ``on_train_end`` writes the run's exports (``outputs``, each with the step in its marker)."""

    out_dir: Path

    def outputs(self) -> list[Path]:
        """The directories ``on_train_end`` writes."""
        return [Path(self.out_dir)]

    def owed(self, trainer: Trainer) -> list[Path]:
        from treadle.checkpoint.export import export_complete

        if trainer.engine.rank != 0:
            return []
        return [p for p in self.outputs() if not export_complete(p, trainer.state.step)]

    def write_owed(self, trainer: Trainer, missing: list[Path]) -> None:
        from treadle.checkpoint.export import remove_leftovers

        super().write_owed(trainer, missing)
        for path in missing:  # the kill's leftovers: a half-written export, or a whole earlier one set aside
            remove_leftovers(path)


class ExportCallback(FinalExport):
    """At the end, a Hugging Face model directory that ``from_pretrained`` loads, its tokenizer carrying the chat
    template an SFT run rendered conversations with (``chat_template``, Jinja); ``into``: ``export_hf``'s."""

    def __init__(self, out_dir, tokenizer_dir, chat_template: str | None = None, into=None):
        self.out_dir = out_dir
        self.tokenizer_dir = tokenizer_dir
        self.chat_template = chat_template
        self.into = into

    def on_train_end(self, trainer: Trainer) -> None:
        from treadle.checkpoint.export import export_hf

        export_hf(trainer.engine.module, trainer.engine.export_state_dict(), self.tokenizer_dir, self.out_dir,
                  enabled=trainer.engine.rank == 0, chat_template=self.chat_template, into=self.into,
                  step=trainer.state.step)


class AdapterExportCallback(ExportCallback):
    """At the end of a LoRA run, a PEFT adapter directory (``PeftModel.from_pretrained`` and vLLM's LoRA loader read
    it); ``treadle export --merge`` writes the merged model instead."""

    def __init__(self, out_dir, adapters, base_name: str | None = None):
        super().__init__(out_dir, None)
        self.adapters = adapters
        self.base_name = base_name  # lora.base_name

    def on_train_end(self, trainer: Trainer) -> None:
        from treadle.checkpoint.export import export_adapter

        state = trainer.engine.export_state_dict()  # a collective on sharded engines: every rank calls it
        if trainer.engine.rank == 0:
            export_adapter(self.adapters, state, self.out_dir, step=trainer.state.step, base_name=self.base_name)
