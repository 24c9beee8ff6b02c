"""The loop: durations, bookkeeping, and when periodic work runs.

The step math (micro-batching, normalization, clipping, the update) lives in
``step.py``; everything periodic (metrics, eval, checkpoints, export) is a
callback. What remains here reads top to bottom.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterable

from treadle.checkpoint.manager import CheckpointManager
from treadle.config import Config, to_toml
from treadle.errors import UserError, first_line
from treadle.metrics.sinks import Console, Sinks
from treadle.train.callbacks import Callback
from treadle.train.resilience import ShutdownWatcher, TrainingFailed
from treadle.train.step import StepResult, loss_sum, optimizer_step


# lr is the schedule's (``_apply_lr_scale``); fused / foreach: the implementation this run chose (build_optimizer)
_CONFIGURED_HYPERPARAMETERS = ("weight_decay", "betas", "eps", "fused", "foreach")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped ones included: they consumed data)
    tokens: int = 0  # input tokens processed, all ranks
    label_tokens: int = 0  # tokens that carried loss, all ranks
    skipped_steps: int = 0  # steps whose update was dropped (non-finite loss or gradient)
    elapsed_s: float = 0.0  # training wall time, summed over resumes
    lr_scale: float = 1.0  # product of rollback lr scales, on top of the schedule

    def record(self, result: StepResult, tokens: int, seconds: float) -> None:
        self.step += 1
        self.tokens += tokens
        self.label_tokens += result.label_tokens
        self.skipped_steps += not result.applied
        self.elapsed_s += seconds


class Trainer:
    def __init__(
        self,
        cfg: Config,
        engine,
        schedule,
        loader,
        val_batches: Callable[[], Iterable[dict]],
        callbacks: list[Callback],
        checkpoints: CheckpointManager,
        metrics: Sinks,
        console: Console,
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        meta: dict | None = None,
        shutdown: ShutdownWatcher | None = None,
        loss_fn: Callable = loss_sum,
        eval_loss_fn: Callable | None = None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.schedule = schedule
        self.loader = loader
        self.val_batches = val_batches
        self.callbacks = callbacks
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.console = console
        self.autocast = autocast
        self.meta = meta or {}  # facts about the run's inputs (vocab, tokenizer) that export needs
        self.latest_metrics: dict = {}  # last value of every logged key (checkpoint "best" uses it)
        self.last_records: dict[str, dict] = {}  # kind ("step", "eval") -> the last record logged of that kind
        self.max_steps = cfg.train.max_steps
        self.tokens_per_step = loader.global_batch * cfg.data.seq_len
        self.shutdown = shutdown or ShutdownWatcher(None, cfg.resilience.shutdown_timeout_s)
        self.state = TrainState()
        self.loss_fn = loss_fn  # what a step minimizes; callbacks may swap it for one step (fault injection)
        self.eval_loss_fn = eval_loss_fn or loss_fn  # what evaluation reports as eval_loss
        self.resumed_from: Path | None = None
        self.owed: list[tuple[Callback, list[Path]]] = []  # a finished run's missing exports (``_owed``)
        self.stop_reason: str | None = None
        self.stop_asked: str | None = None  # a callback's request_stop, seen after the step's callbacks
        self.last_step_seconds = 0.0
        self.last_data_seconds = 0.0  # of the last step, waiting for its batches
        self.last_save_seconds = 0.0
        self.last_lr = self.current_lr()
        self.phase_lr_scale: float | None = None  # the data phase's lr multiplier now applied (None: not yet)
        # Per-source losses are reported when the run names its sources ([[data.sources]]).
        self.sources = loader.names if cfg.data.sources else []

    def fit(self) -> TrainState:
        """Train to max_steps, or until a signal / the time limit asks to stop (``stop_reason``)."""
        if self.finished:  # no callback runs: the run's end (final eval, export) happened when it finished,
            if self.owed:  # unless a kill came between its final checkpoint and its export
                self._finish_owed()
            return self.state
        self.console.start(self.state.step)
        self.shutdown.install()
        try:
            self._each("on_train_start")
            while self.state.step < self.max_steps and self.stop_reason is None:
                self._each("on_step_start")
                t0 = time.perf_counter()
                self._enter_phase()
                self.last_lr = self.current_lr()
                micro_batches = self.loader.next_step(self.state.step)
                self.last_data_seconds = time.perf_counter() - t0
                result = optimizer_step(self.engine, micro_batches, self.cfg.train.grad_clip, self.autocast, self.loss_fn,
                                        self.sources)
                if result.applied:  # a skipped update must not advance the schedule either
                    self.schedule.step()
                self.last_step_seconds = time.perf_counter() - t0
                self.state.record(result, self.tokens_per_step, self.last_step_seconds)
                for cb in self.callbacks:
                    cb.on_step_end(self, result)
                self.stop_reason = self._stop_requested()
            if self.stop_reason is not None:
                self.shutdown.arm_watchdog()
                self._each("on_stop")
            else:
                self._each("on_train_end")
            self.checkpoints.wait()  # an async save still in flight must land before we return
        finally:
            self.checkpoints.join()  # also on a failure: the process group must outlive a save in flight
            self.loader.close()
            self.shutdown.uninstall()
            self.console.stop()
        return self.state

    def _enter_phase(self) -> None:
        """At a data phase's first step (and on the first step of any run), apply its lr scale."""
        scale = self.loader.mixture.lr_scale(self.state.step)
        if scale != self.phase_lr_scale:
            if self.phase_lr_scale is not None:
                self.console.print(f"data phase {self.loader.mixture.phase_index(self.state.step)} begins with step "
                                   f"{self.state.step + 1} (lr x{scale:g})")
            self.phase_lr_scale = scale
            self._apply_lr_scale()

    def _each(self, hook: str) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self)

    def _stop_requested(self) -> str | None:
        local = self.stop_asked or self.shutdown.requested(self.last_step_seconds, self.last_save_seconds)
        # One collective: every rank stops after the same step, or one would wait forever in the next.
        if self.engine.any_rank(local is not None):
            return local or "stop requested by another rank"
        return None

    # ------------------------------------------------------------------ helpers for callbacks

    def request_stop(self, reason: str) -> None:
        """Stop after this step as a signal would (on_stop: a checkpoint; the run resumes later, exit code 75)."""
        self.stop_asked = reason

    def current_lr(self) -> float:
        return self.engine.optimizer.param_groups[0]["lr"]

    def log(self, record: dict, kind: str = "step") -> None:
        self.latest_metrics = {**self.latest_metrics, **record}
        self.last_records[kind] = record
        self.metrics.write(record, kind)
        self.console.log(record, kind)

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        path = self.checkpoints.save(self.state.step, self.engine, self.state_dict(), to_toml(self.cfg),
                                     metrics=self.latest_metrics)
        self.last_save_seconds = time.perf_counter() - t0
        return path

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        return {
            "train": asdict(self.state),
            "meta": self.meta,
            "loader": self.loader.state_dict(),
            "schedule": self.schedule.state_dict(),
            "callbacks": {type(cb).__name__: cb.state_dict() for cb in self.callbacks},
        }

    def load_state_dict(self, state: dict) -> None:
        self.state = TrainState(**state["train"])
        self.loader.load_state_dict(state["loader"])
        self.schedule.load_state_dict(state["schedule"])
        for cb in self.callbacks:
            saved = state["callbacks"].get(type(cb).__name__)
            if saved:  # a callback the checkpoint did not know (e.g. eval switched on later) keeps its fresh state
                cb.load_state_dict(saved)

    def resume(self, path: Path) -> None:
        # The optimizer's state dict carries its hyperparameters: this run's config (as built) wins over the
        # checkpoint's, or another optim.weight_decay / betas / eps would be reported as changed and silently ignored.
        groups = self.engine.optimizer.param_groups
        configured = [{k: g[k] for k in _CONFIGURED_HYPERPARAMETERS if k in g} for g in groups]
        saved = self.checkpoints.load(path, self.engine, config_toml=to_toml(self.cfg), meta=self.meta)
        try:
            self.load_state_dict(saved)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a hand-edited or foreign train state
            raise UserError(f"checkpoint {path}: train_state.json does not hold the state this run needs "
                            f"({type(exc).__name__}: {first_line(exc)}); accepted: a checkpoint treadle wrote") from None
        for group, values in zip(self.engine.optimizer.param_groups, configured):
            group.update(values)
        self.resumed_from = path
        if not self.finished:
            self.console.print(f"resumed from {path} at step {self.state.step}")
            return
        self.owed = self._owed()
        if not self.owed:  # a finished run run again (docs/checkpoints.md): this line is all it prints
            self.console.print(f"{self._finished_words()}: nothing to do")

    def _finished_words(self) -> str:
        return (f"treadle: {self.cfg.train.output_dir} finished at step {self.state.step} "
                f"(train.max_steps = {self.max_steps})")

    def _owed(self) -> list[tuple[Callback, list[Path]]]:
        """The end-of-run outputs a finished run lacks (a kill after its final checkpoint, before its export landed):
        missing on any rank is missing on all, callback by callback (writing one may be collective)."""
        owed = []
        for cb in self.callbacks:
            missing = cb.owed(self)
            if missing is not None and self.engine.any_rank(bool(missing)):
                owed.append((cb, missing))
        return owed

    def _finish_owed(self) -> None:
        """A finished run run again writes what its end owed from the final checkpoint, and says so in one line."""
        for cb, missing in self.owed:
            cb.write_owed(self, missing)
        written = ", ".join(str(p) for _, missing in self.owed for p in missing)  # rank 0's: the one that prints
        self.console.print(f"{self._finished_words()}; its export was missing or incomplete, written again from "
                           f"{self.resumed_from}: {written}")

    @property
    def finished(self) -> bool:
        """Resumed at or past train.max_steps: nothing to train, evaluate or export again."""
        return self.resumed_from is not None and self.state.step >= self.max_steps

    def rollback(self, lr_scale: float) -> Path:
        """Back to the newest checkpoint with a smaller lr, skipping the data that went bad."""
        self.checkpoints.wait()
        path = self.checkpoints.find_resume("auto")
        if path is None:
            raise TrainingFailed("non-finite steps but no checkpoint to roll back to; set checkpoint.every")
        data, scale = self.loader.state_dict(), self.state.lr_scale * lr_scale
        self.resume(path)
        self.loader.load_state_dict(data)  # the stretch that went bad is not trained on again
        self.state.lr_scale = scale
        self._apply_lr_scale()
        return path

    def _apply_lr_scale(self) -> None:
        """lr = peak lr x rollback scale x data phase scale x the schedule's factor at this step."""
        sched = self.schedule
        scale = self.state.lr_scale * (self.phase_lr_scale or 1.0)
        sched.base_lrs = [self.cfg.optim.lr * scale for _ in sched.base_lrs]
        for group, base, fn in zip(self.engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
