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
from treadle.metrics.sinks import Console, JsonlSink
from treadle.train.callbacks import Callback
from treadle.train.step import StepResult, optimizer_step


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped ones included: they consumed data)
    tokens: int = 0  # input tokens processed, all ranks
    label_tokens: int = 0  # tokens that carried loss, all ranks
    skipped_steps: int = 0  # steps whose update was dropped (non-finite loss or gradient)
    elapsed_s: float = 0.0  # training wall time, summed over resumes

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
        metrics: JsonlSink,
        console: Console,
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        meta: dict | None = None,
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
        self.max_steps = cfg.train.max_steps
        self.tokens_per_step = loader.global_batch * cfg.data.seq_len
        self.state = TrainState()
        self.last_step_seconds = 0.0
        self.last_lr = self.current_lr()

    def fit(self) -> TrainState:
        self.console.start(self.state.step)
        try:
            for cb in self.callbacks:
                cb.on_train_start(self)
            while self.state.step < self.max_steps:
                t0 = time.perf_counter()
                self.last_lr = self.current_lr()
                micro_batches = self.loader.next_step()
                result = optimizer_step(self.engine, micro_batches, self.cfg.train.grad_clip, self.autocast)
                if result.applied:  # a skipped update must not advance the schedule either
                    self.schedule.step()
                self.last_step_seconds = time.perf_counter() - t0
                self.state.record(result, self.tokens_per_step, self.last_step_seconds)
                for cb in self.callbacks:
                    cb.on_step_end(self, result)
            for cb in self.callbacks:
                cb.on_train_end(self)
        finally:
            self.console.stop()
        return self.state

    # ------------------------------------------------------------------ helpers for callbacks

    def current_lr(self) -> float:
        return self.engine.optimizer.param_groups[0]["lr"]

    def log(self, record: dict, kind: str = "step") -> None:
        self.metrics.write(record)
        self.console.log(record, kind)

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.state.step, self.engine, self.state_dict(), to_toml(self.cfg))

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
            cb.load_state_dict(state["callbacks"].get(type(cb).__name__, {}) or cb.state_dict())

    def resume(self, path: Path) -> None:
        self.load_state_dict(self.checkpoints.load(path, self.engine))
        self.console.print(f"resumed from {path} at step {self.state.step}")
