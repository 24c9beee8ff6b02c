"""``[profile]``: a torch.profiler window over steps ``start_step .. start_step + steps - 1`` on every rank.

The profiler starts one step early as its warm-up where there is one (the first profiled step is not charged
the profiler's own start-up), records exactly the window, and writes one trace per rank (Chrome / Perfetto JSON,
named as TensorBoard's profiler plugin expects: ``<dir>/rank<r>.<time>.pt.trace.json``). Rank 0 prints one line:
the top operators by self time. Without ``start_step`` no callback exists: nothing is paid.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from treadle.train.callbacks import Callback
from treadle.train.step import StepResult

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer


def top_ops(prof, device_type: str, n: int = 5) -> str:
    """'aten::mm 41.2 ms (38%), ...': the operators with the most self time (CPU, or the GPU's on CUDA)."""
    # ProfilerStep#N spans a whole step: its "self" time is whatever ran untraced (Python), not an op.
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:n]
    return ", ".join(f"{e.key} {getattr(e, attr) / 1e3:.1f} ms ({100 * getattr(e, attr) / total:.0f}%)" for e in ranked)


class ProfilerCallback(Callback):
    def __init__(self, start_step: int, steps: int, out_dir: Path, record_shapes: bool, memory: bool,
                 with_stack: bool):
        self.first, self.last = start_step, start_step + steps - 1  # steps as logged (1 = the first)
        self.out_dir = Path(out_dir)
        self.options = dict(record_shapes=record_shapes, profile_memory=memory, with_stack=with_stack)
        self._prof = None

    def on_step_start(self, trainer: Trainer) -> None:
        upcoming = trainer.state.step + 1
        warmup = 1 if self.first > 1 else 0
        if self._prof is not None or upcoming != self.first - warmup:
            return  # a run resumed past the window's start does not profile
        device = trainer.engine.device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(activities=activities, **self.options,
                             schedule=schedule(wait=0, warmup=warmup, active=self.last - self.first + 1, repeat=1),
                             on_trace_ready=tensorboard_trace_handler(str(self.out_dir), f"rank{trainer.engine.rank}"))
        self._prof.__enter__()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._prof is None:
            return
        if trainer.engine.device.type == "cuda":
            torch.cuda.synchronize(trainer.engine.device)  # the step's kernels inside the window
        self._prof.step()
        if trainer.state.step == self.last:
            self._finish(trainer)

    def _finish(self, trainer: Trainer) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        span = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        trainer.console.print(f"profile of {span}: {top_ops(prof, trainer.engine.device.type)}; traces in {self.out_dir}")

    def on_train_end(self, trainer: Trainer) -> None:
        if self._prof is not None:  # the run ended inside the window
            self._finish(trainer)

    on_stop = on_train_end
