"""Guards that keep a run alive or stop it cleanly: NaN/Inf policy, fault injection,
signals and the wall-clock limit. The exit codes are listed in ``treadle.errors``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from treadle.config import Config, ResilienceConfig
from treadle.distributed import HealthCheck, HealthCheckFailed, all_reduce_max, restart_count
from treadle.errors import EXIT_INTERRUPTED, EXIT_TRAINING_FAILED, TrainingFailed, UserError
from treadle.train.callbacks import Callback
from treadle.train.step import StepResult, split_loss

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer

class NanGuardCallback(Callback):
    """Counts steps whose update was dropped (non-finite loss or gradient) and applies the policy.

    The skip itself happens in ``optimizer_step`` (agreed by all ranks); here we decide
    what a run of bad steps means: keep skipping, roll back to the newest checkpoint
    with a smaller learning rate, or stop.
    """

    def __init__(self, cfg: ResilienceConfig):
        self.cfg = cfg
        self.consecutive = 0
        self.rollbacks = 0

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if result.applied:
            self.consecutive = 0
            return
        self.consecutive += 1
        step = trainer.state.step
        trainer.log({"step": step, "event": "nonfinite_step_skipped", "loss": result.loss, "grad_norm": result.grad_norm,
                     "consecutive": self.consecutive}, kind="guard")
        policy = self.cfg.nan_policy
        if policy == "abort":
            raise TrainingFailed(f"step {step}: non-finite loss or gradient norm and resilience.nan_policy = 'abort'")
        if self.consecutive < self.cfg.max_consecutive_bad:
            return
        if policy == "skip":
            raise TrainingFailed(
                f"step {step}: {self.consecutive} non-finite steps in a row (resilience.max_consecutive_bad); "
                "the run is diverging: try resilience.nan_policy = 'rollback' or a lower optim.lr"
            )
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingFailed(
                f"step {step}: still non-finite after {self.rollbacks} rollbacks (resilience.max_rollbacks); "
                "lower optim.lr or inspect the data around this step"
            )
        counters = self.rollbacks + 1
        path = trainer.rollback(self.cfg.rollback_lr_scale)
        # The checkpoint restored our counters to their old values; a rollback must not forget itself.
        self.rollbacks, self.consecutive = counters, 0
        trainer.log({"step": trainer.state.step, "event": "rollback", "checkpoint": str(path), "rollbacks": self.rollbacks,
                     "lr_scale": trainer.state.lr_scale, "data_position": trainer.loader.position}, kind="guard")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.rollbacks = state["consecutive"], state["rollbacks"]


class FaultInjectionCallback(Callback):
    """FOR TESTS AND DRILLS ONLY (``resilience.inject_nan_steps``): the listed steps get a NaN loss.

    Each listed step fires once per process, so a rollback that replays a step
    number does not re-inject there.
    """

    def __init__(self, steps: list[int]):
        self.pending = set(steps)
        self.clean = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.clean = trainer.loss_fn

    def on_step_start(self, trainer: Trainer) -> None:
        step = trainer.state.step + 1
        if step in self.pending:
            self.pending.discard(step)
            trainer.loss_fn = _poisoned(self.clean)
        else:
            trainer.loss_fn = self.clean


def _poisoned(loss_fn):
    def nan_loss(model, batch):
        summed, side = split_loss(loss_fn(model, batch))
        return summed * math.nan, side

    return nan_loss


class KillInjectionCallback(Callback):
    """FAULT INJECTION FOR TESTS AND DRILLS ONLY (``resilience.inject_kill_step``): SIGKILL this rank after the step.

    It runs after every other callback, so the step's checkpoint is complete and ``latest`` points at it when the
    rank dies; an async save is waited for first. SIGKILL, not an exception: nothing of treadle's own shutdown
    runs, as when the kernel's OOM killer or a failing node takes a rank.
    """

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.state.step == self.step:
            trainer.checkpoints.wait()
            print(f"treadle: resilience.inject_kill_step = {self.step}: SIGKILL to this rank (a drill)",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class RestartNoticeCallback(Callback):
    """A torchrun restart (``--max-restarts``) is written where the run is read: an ``elastic_restart`` record in
    metrics.jsonl and on the console, with the attempt and the checkpoint auto-resume took (None: none existed yet).

    Each node's agent counts its own restarts, and one that restarts because another node re-joined does not count
    (torch.distributed.elastic): rank 0's count alone can read 0 after a restart, so the attempt is the largest
    count of any rank (one collective at the start).
    """

    def on_train_start(self, trainer: Trainer) -> None:
        attempt = restart_count()
        if trainer.engine.world_size > 1:
            attempt = int(all_reduce_max([attempt], trainer.engine.device)[0])
        if attempt:
            trainer.log({"step": trainer.state.step, "event": "elastic_restart", "attempt": attempt,
                         "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None}, kind="guard")


def elastic_callbacks(cfg: Config, rank: int, world_size: int) -> list[Callback]:
    """The callbacks of a run under torchrun, built before anything is written (a drill key that cannot fire is a
    UserError now) and placed last in the list (the kill comes after the step's checkpoint)."""
    callbacks: list[Callback] = [RestartNoticeCallback()] if "TORCHELASTIC_RESTART_COUNT" in os.environ else []
    r, every, max_steps = cfg.resilience, cfg.checkpoint.every, cfg.train.max_steps
    if r.inject_kill_step is None:
        return callbacks
    if r.inject_kill_rank >= world_size:
        raise UserError(f"resilience.inject_kill_rank = {r.inject_kill_rank} is not a rank of this launch "
                        f"(world size {world_size}); accepted: 0 to {world_size - 1}")
    if r.inject_kill_step > max_steps:
        raise UserError(f"resilience.inject_kill_step = {r.inject_kill_step} is after train.max_steps = {max_steps}, "
                        f"so the kill would never happen; accepted: 1 to {max_steps}")
    # The kill follows a checkpoint of its own step, so the restart resumes past it and never kills again, even
    # where a node's restart count stays 0 (above); without one, the replayed step would kill at every attempt.
    if not every or r.inject_kill_step % every:
        raise UserError(f"resilience.inject_kill_step = {r.inject_kill_step} is not a checkpoint step "
                        f"(checkpoint.every = {every}); accepted: a multiple of checkpoint.every")
    if rank == r.inject_kill_rank and restart_count() == 0:
        callbacks.append(KillInjectionCallback(r.inject_kill_step))
    return callbacks


class HealthCheckCallback(Callback):
    """Every ``every`` steps, all ranks answer a round trip within a short deadline (``HealthCheck``).

    A hung rank otherwise shows up as every other rank sitting in the next collective
    until the process-group timeout; here it becomes a TrainingFailed naming the step.
    """

    def __init__(self, every: int, timeout_s: float):
        self.every = every
        self.check = HealthCheck(timeout_s)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.state.step % self.every == 0:
            try:
                self.check.check(trainer.state.step)
            except HealthCheckFailed as exc:
                raise TrainingFailed(str(exc)) from None


class ShutdownWatcher:
    """Turns SIGTERM, SIGUSR1, SIGINT and ``train.time_limit`` into "stop after this step".

    A handler only records the request: the loop finishes the step, writes a checkpoint
    and exits with EXIT_STOPPED_RESUMABLE. A second SIGINT exits at once. Once a stop is
    requested, a watchdog forces the exit after ``shutdown_timeout_s`` in case saving hangs.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, time_limit_s: float | None, shutdown_timeout_s: float):
        self.deadline = time.monotonic() + time_limit_s if time_limit_s is not None else None
        self.shutdown_timeout_s = shutdown_timeout_s
        self.reason: str | None = None
        self._previous: dict = {}
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and signum == signal.SIGINT:
            print("treadle: second SIGINT, exiting now", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        if self.reason is None:
            self.reason = name
            print(f"treadle: {name} received, finishing this step and writing a checkpoint", file=sys.stderr, flush=True)

    def requested(self, step_seconds: float, save_seconds: float) -> str | None:
        """The reason to stop now, if any: a signal, or too little time left for another step and a save."""
        if self.reason is None and self.deadline is not None:
            if time.monotonic() + 2 * step_seconds + save_seconds >= self.deadline:
                self.reason = "time_limit"
        return self.reason

    def arm_watchdog(self) -> None:
        """From now on, saving has shutdown_timeout_s to finish before the process is ended."""
        if self._watchdog is None:
            def force_exit() -> None:
                print(f"treadle: shutdown checkpoint did not finish in {self.shutdown_timeout_s:.0f} s "
                      "(resilience.shutdown_timeout_s); exiting without it", file=sys.stderr, flush=True)
                os._exit(EXIT_TRAINING_FAILED)

            self._watchdog = threading.Timer(self.shutdown_timeout_s, force_exit)
            self._watchdog.daemon = True
            self._watchdog.start()
