"""``model.dtype`` / ``model.compile`` = ``auto`` resolved for one run (the measuring is ``models/autotune.py``).

What a run can use depends on its engine; rank 0 measures and every rank takes its answer (one choice, or ranks
would run different graphs); the resolved values replace ``auto`` in the run's config, so config.toml records
what ran and a resume runs the same. The run's first steps then check the probe's figure (``StepTimeCheck``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from treadle import distributed
from treadle.config import Config
from treadle.errors import UserError
from treadle.models import autotune
from treadle.models.autotune import choose_compile, choose_dtype, probe_path, safe_probe
from treadle.models.fp8 import check_fp8
from treadle.models.hf import decoder_layers
from treadle.train.callbacks import Callback


def dtype_candidates(cfg: Config, engine: str) -> tuple[str, ...]:
    """The dtypes this run's engine can train in (fp32 first)."""
    found = ["fp32"]
    if not (engine == "deepspeed" and cfg.distributed.zero_stage == 0):  # DeepSpeed refuses bf16 at stage 0
        found.append("bf16")
    if engine == "local" and not cfg.draft.frozen_target:  # the one engine that keeps fp32 masters beside bf16 weights
        found.append("bf16-weights")
    return tuple(found)


def check_dtype(cfg: Config, engine: str, device: torch.device | None = None) -> None:
    """Refuse a dtype this run cannot train in (fp8: also by ``device``, the run's own, and torchao; None: the
    engine alone, without the device checks)."""
    accepted = ", ".join(("auto", *dtype_candidates(cfg, engine)))
    if cfg.model.dtype == "fp8":  # never a candidate of auto: it changes the math, so only when asked for
        check_fp8(engine, cfg.draft.frozen_target, cfg.distributed.tensor_parallel, device, accepted)
        return
    if cfg.model.dtype not in ("auto", *dtype_candidates(cfg, engine)):
        what = "a draft run" if cfg.draft.frozen_target else f"distributed.engine {engine!r}"
        raise UserError(f"model.dtype = {cfg.model.dtype!r} is not available to {what} (bf16 weights with fp32 masters "
                        "are the local engine's, for a model run; FSDP2's bf16 already computes in bf16 weights over "
                        f"fp32 shards); accepted: {accepted}")


def resolve_auto(cfg: Config, model: nn.Module, engine: str, device: torch.device,
                 start_step: int = 0) -> tuple[Config, list[str], StepTimeCheck | None]:
    """``cfg`` with ``auto`` replaced by the choices for this run, a line per choice saying why, and the callback
    that checks the choices' figure against the run's first steps (None when nothing was ``auto``). ``start_step``:
    the step a resume continues from (the compile estimate counts the steps left)."""
    check_dtype(cfg, engine, device)
    m, t = cfg.model, cfg.train
    if m.dtype == "fp8" and m.compile == "auto":  # no probe: it measures the dtypes auto chooses between
        cfg = cfg.model_copy(deep=True)
        cfg.model.compile = True
        return cfg, ["treadle: model.compile = auto -> true: torchao's float8 pays only compiled (its speed-ups are "
                     "measured with torch.compile fusing its casts and scales; torchao/float8/README.md)"], None
    if m.dtype != "auto" and m.compile != "auto":
        return cfg, [], None
    rows, seq_len = t.micro_batch_size, cfg.data.seq_len
    # A draft run compiles its one block; the frozen target stays eager.
    layers = 1 if cfg.draft.frozen_target else len(decoder_layers(model))
    micro_steps = max(t.max_steps - start_step, 0) * t.grad_accum_steps

    def decide() -> tuple[list[tuple[str, str | bool, str]], float | None, float | None, str | None]:
        decided = []
        if m.dtype == "auto":
            candidates = dtype_candidates(cfg, engine)
            choice, layer_s, busy = choose_dtype(model, rows, seq_len, device, candidates)
            decided.append(("dtype", choice.value, choice.why))
            chosen = (choice.value,) if device.type == "cuda" else candidates
        else:
            chosen = (m.dtype,)
            seconds, _, busy = safe_probe(model, rows, seq_len, device, chosen)
            layer_s = seconds and seconds[m.dtype]
        estimate = None
        if m.compile == "auto":
            choice = choose_compile(layer_s, layers, micro_steps, device, busy, start_step)
            decided.append(("compile", choice.value, choice.why))
            estimate = choice.estimate_s
        cache = str(probe_path(model, rows, seq_len, device, chosen)) if layer_s is not None else None
        return decided, layer_s, estimate, cache

    decided, layer_s, estimate, cache = distributed.broadcast_object(distributed.on_main(decide))
    cfg = cfg.model_copy(deep=True)
    lines = []
    for key, value, why in decided:
        setattr(cfg.model, key, value)
        shown = str(value).lower() if isinstance(value, bool) else value
        lines.append(f"treadle: model.{key} = auto -> {shown}: {why}")
    # The figure is scaled from PROBE_ROWS rows to the micro-batch; a layer is no faster on more rows than on those,
    # so the unscaled figure is a floor for the real layer (the scaled one may overstate a tiny layer's time).
    # A rank of a pipeline runs some of the layers, a rank of a context group part of each sequence: no floor there.
    split = cfg.distributed.pipeline_parallel > 1 or cfg.distributed.context_parallel > 1
    floor = None
    if layer_s is not None and not split:
        floor = layer_s * min(rows, autotune.PROBE_ROWS) / rows * layers * t.grad_accum_steps
    # A draft run's step is mostly its frozen target's forward, which a compile of the draft block does not touch:
    # its pace says little about what the compile would save, so only the figure is checked there.
    check = StepTimeCheck(layer_s, floor, cache, compile_auto=m.compile == "auto" and not cfg.draft.frozen_target,
                          compiled=bool(cfg.model.compile), estimate_s=estimate)
    return cfg, lines, check


class StepTimeCheck(Callback):
    """The auto probe's figure against the run's own first steps, after ``CHECK_STEPS`` steps that follow a warm-up
    step (of this process: a resume warms up again).

    - A step cannot be faster than its decoder layers: a figure that says the layers alone take ``STALE`` times
      longer than the run's fastest step was taken under load. Its cache entry is dropped (the next run measures
      again) and a line says so.
    - The compile estimate (decoder layers only, from the probe) against the run's pace: where the first steps
      project an eager time past ``COMPILE_PAYS_AFTER_S`` that the estimate had below it, a line says so (the
      choice itself stands: compiling mid-run would recompile every graph under the engine's wrapping). First steps
      taken under load (a neighbour's job at start-up) project far too long a run, so, as the probe measures a
      figure again, the pace is measured again ``RECHECK_SHARE`` of the run later, and the faster of the two decides.
      Said at a fresh start only: it is about the choice made then, and a resumed run would repeat it.
    Only rank 0 writes or prints; no collective, so the ranks need not agree on when it runs.
    """

    CHECK_STEPS = 3
    RECHECK_SHARE = 0.1  # of the run's steps between the first window and the second: time for a load to pass

    def __init__(self, layer_seconds: float | None, floor_seconds: float | None, cache: str | None,
                 compile_auto: bool, compiled: bool, estimate_s: float | None):
        self.layer_seconds = layer_seconds  # the probe's figure: one layer's forward+backward on one micro-batch
        self.floor_seconds = floor_seconds  # what one step's decoder layers take at least, by that figure
        self.cache = cache
        self.compile_auto = compile_auto
        self.compiled = compiled
        self.estimate_s = estimate_s
        self.seconds: list[float] = []  # the window being measured
        self.windows: list[tuple[int, float]] = []  # (last step, median step seconds) of each window measured
        self.start_after: int | None = None  # the step after which the next window starts (None: the warm-up)
        self.warmed = False
        self.floor_checked = False
        self.compile_settled = not (compile_auto and not compiled and estimate_s is not None)

    def on_train_start(self, trainer) -> None:
        if trainer.state.step > 0:  # resumed: the advice, if any, was the first process's to give
            self.compile_settled = True

    def on_step_end(self, trainer, result) -> None:
        if self.floor_checked and self.compile_settled:
            return
        step = trainer.state.step
        if not self.warmed:  # the first step allocates, and with compile it compiles
            self.warmed = True
            return
        if self.start_after is not None and step <= self.start_after:
            return
        self.seconds.append(trainer.last_step_seconds)
        if len(self.seconds) < self.CHECK_STEPS:
            return
        self.windows.append((step, statistics.median(self.seconds)))
        main = not (dist.is_initialized() and dist.get_rank() != 0)
        out = []
        if not self.floor_checked:
            self.floor_checked = True
            out += self.floor_lines(min(self.seconds)) if main else []
        if not self.compile_settled:
            steps_left = trainer.max_steps - step
            line = self.compile_line(self.windows, steps_left, trainer.state.elapsed_s)
            if line is not None and len(self.windows) == 1:  # measured again later before it is said
                self.start_after = step + max(self.CHECK_STEPS, math.ceil(self.RECHECK_SHARE * trainer.max_steps))
            else:
                self.compile_settled = True
                out += [line] if line is not None and main else []
        self.seconds = []
        for line in out:
            trainer.console.print(line)

    def floor_lines(self, fastest: float) -> list[str]:
        if self.floor_seconds is None or self.compiled or self.floor_seconds <= autotune.STALE * fastest:
            return []
        dropped = ""
        if self.cache and Path(self.cache).is_file():
            Path(self.cache).unlink(missing_ok=True)
            dropped = f"; {self.cache} is dropped, the next run measures again"
        return [f"treadle: auto: the run's steps take {fastest * 1e3:.0f} ms, but by the probe's figure "
                f"({self.layer_seconds * 1e3:.0f} ms per layer and micro-batch) their decoder layers alone "
                f"take at least {self.floor_seconds * 1e3:.0f} ms: the figure was taken under load{dropped}"]

    def compile_line(self, windows: list[tuple[int, float]], steps_left: int, elapsed: float) -> str | None:
        """The advice to compile, when the pace of the faster window (``windows``: (last step, median seconds))
        projects an eager time past the threshold that the probe's estimate had below it; else None."""
        typical = min(seconds for _, seconds in windows)
        projected = elapsed + typical * steps_left
        threshold = autotune.COMPILE_PAYS_AFTER_S
        if not projected >= threshold > self.estimate_s:
            return None
        paces = " and ".join(f"{seconds:.2f} s each to step {step}" for step, seconds in windows)
        return (f"treadle: auto: the run's steps ({paces}) project its eager time at {projected:.0f} s, not the "
                f"{self.estimate_s:.0f} s estimated from the probe: past {threshold:.0f} s a compile may pay back "
                "(model.compile = true); model.compile stays false for this run")
