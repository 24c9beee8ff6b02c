"""``model.dtype = "auto"`` and ``model.compile = "auto"``: what runs fastest on this machine, decided at start-up.

Whether bf16 pays on a CPU depends on the machine: one of our 2-core machines ran bf16 autocast 1.45x faster than
fp32, another slower (docs/benchmarks.md). CPU flags do not tell reliably (AMX helps, avx512_bf16 alone may not,
a hypervisor may hide either), so the CPU choice is measured: a few forward+backward passes of one decoder layer of
the run's own shape in each candidate dtype, interleaved round by round (a busy neighbour slows all alike) and
judged by each candidate's fastest pass. The layer is run with the inputs its own model makes for it (a one-layer
copy of the architecture, its forward stopped at the layer), so every decoder family is probed the same way; one
that still cannot be falls back to fp32 in one line. The result is cached per machine and shape in treadle's
cache, only when its passes agreed and the machine was not loaded while they ran (``treadle/machine_load.py``); a
later run times the cached choice again briefly and measures everything again when the cached figure was taken
under load (``STALE``), and the run's first steps check the figure once more (``train/auto.py``). CUDA decides by
capability: bf16 from Ampere (8.0) on.

A bf16 candidate must beat fp32 by ``BF16_MARGIN``: it trades precision for speed, and a coin toss of timing noise
should not flip a run to it. Compile is judged by a documented threshold on the run's estimated eager time
(``COMPILE_PAYS_AFTER_S``), estimated from the same probe.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from treadle import machine_load
from treadle.corpus import cache_dir
from treadle.fsutil import write_atomic
from treadle.machine_load import machine
from treadle.models.hf import decoder_layers

DTYPES = ("fp32", "bf16", "bf16-weights")
BF16_MARGIN = 1.10  # a bf16 candidate is chosen only if its layer step is >= 10% faster than fp32's
# A cold regional compile of the tiny preset costs 25-36 s here and saves ~30% of each eager step, so it pays back
# after ~100 s of eager steps; compile time grows with the model and the gain shrinks on a busy machine: 5x margin.
COMPILE_PAYS_AFTER_S = 600.0
PROBE_ROUNDS = 3  # timed passes per candidate, after one untimed pass each (first-call paths, allocator)
STEADY = 1.25  # a measurement is cached only if each candidate's two fastest passes are this close
CHECK_ROUNDS = 2  # timed passes of a cached figure's fastest candidate, checking it before it is used
STALE = 2.0  # a cached figure this many times slower than the check is measured again
PROBE_ROWS = 2  # rows of the run's micro-batch measured (the per-row time scales to the whole micro-batch)
PROBE_VERSION = 2  # in the cache key: a changed probe measures again (2: the layer's inputs made by the model)


@dataclass
class Choice:
    value: str | bool
    why: str
    estimate_s: float | None = None  # compile: the run's estimated eager time it was judged by


def cpu_flags() -> list[str]:
    """The CPU's bf16-related flags (recorded beside the figures; not used for the choice)."""
    flags = machine().get("flags", "").split()
    return [f for f in flags if "bf16" in f or f.startswith("amx") or f in ("avx512f", "avx512_fp16", "avx2")]


def _target(model: nn.Module) -> nn.Module:
    return getattr(model, "target", model)  # a draft run measures its target's layers


class _Captured(Exception):
    """Raised by the capture hook: the probe model's forward stops at its first decoder layer."""


def _probe_model(model: nn.Module, device: torch.device) -> nn.Module:
    """A fresh fp32 copy of the run's architecture with one decoder layer and a small vocabulary, on ``device``.

    Built from the config, not from the run's layer: the run's may be on meta or partitioned by ZeRO-3, and the
    model itself prepares what its layers take (rotary embeddings per layer type, masks, sliding windows), which
    differs by family (Gemma 3 keeps a rotary embedding per layer type). Call under ``fork_rng``: init draws."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(_target(model).config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer kinds (sliding/full attention)
        config.layer_types = config.layer_types[:1]
    config.vocab_size = min(config.vocab_size, 256)  # the layer's time does not depend on it; the head's memory does
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(config, key, None)
        if isinstance(ids, int) and ids >= config.vocab_size or isinstance(ids, list):
            setattr(config, key, None)
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()


def _layer_inputs(small: nn.Module, rows: int, seq_len: int, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """The probe model's decoder layer and what the model passes it besides the hidden states (positional
    arguments after them, keyword arguments), captured from one forward that stops at the layer."""
    layer = decoder_layers(small)[0]
    captured = {}

    def hook(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, dict(kwargs)
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            small(input_ids=torch.zeros(rows, seq_len, dtype=torch.long, device=device),
                  position_ids=torch.arange(seq_len, device=device).expand(rows, seq_len), use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "kwargs" not in captured:
        raise RuntimeError("the model's forward never called its first decoder layer")
    args, kwargs = captured["args"], captured["kwargs"]
    if args:
        args = args[1:]
    else:
        kwargs.pop("hidden_states")
    return layer, args, kwargs


def _cast(value, dtype: torch.dtype):
    """Floating tensors (rotary cos/sin, an additive mask) in ``dtype``, as the model makes them for bf16 inputs."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _pass(layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict, autocast: bool) -> float:
    device = x.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = layer(x, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...],
            rounds: int = PROBE_ROUNDS) -> tuple[dict[str, float], bool]:
    """Seconds of one forward+backward of one decoder layer on a ``rows`` x ``seq_len`` micro-batch, per candidate
    (the fastest of ``rounds`` interleaved passes, scaled from ``PROBE_ROWS`` rows), and whether the passes
    agreed (each candidate's second-fastest within ``STEADY`` of its fastest). Leaves torch's RNG as it found it."""
    n = min(rows, PROBE_ROWS)
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        small = _probe_model(model, device)
        fp32, args, kwargs = _layer_inputs(small, n, seq_len, device)
        hidden = _target(model).config.hidden_size
        x32 = torch.randn(n, seq_len, hidden, generator=gen).to(device).requires_grad_()
        setups = {c: (copy.deepcopy(fp32).to(torch.bfloat16), x32.detach().bfloat16().requires_grad_(),
                      _cast(args, torch.bfloat16), _cast(kwargs, torch.bfloat16))
                  if c == "bf16-weights" else (fp32, x32, args, kwargs) for c in candidates}
        times: dict[str, list[float]] = {c: [] for c in candidates}
        for r in range(rounds + 1):
            for c in candidates:
                layer, x, a, kw = setups[c]
                t = _pass(layer, x, a, kw, autocast=c == "bf16")
                if r:  # the first round warms up
                    times[c].append(t)
    steady = rounds < 2 or all(sorted(ts)[1] <= STEADY * min(ts) for ts in times.values())
    return {c: min(ts) * rows / n for c, ts in times.items()}, steady


def _shape_key(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...]) -> str:
    layer = decoder_layers(_target(model))[0]
    cfg = _target(model).config
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "num_experts", "num_local_experts")}
    key = {"v": PROBE_VERSION, "machine": machine(), "device": str(device), "layer": type(layer).__name__,
           "shape": shape, "rows": rows, "seq_len": seq_len, "candidates": list(candidates)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _ms(seconds: dict[str, float], candidates) -> str:
    return ", ".join(f"{c} {seconds[c] * 1e3:.0f} ms" for c in candidates)


def probe_path(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...]) -> Path:
    return cache_dir() / "autotune" / f"{_shape_key(model, rows, seq_len, device, candidates)}.json"


def probe(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...],
          watch: Callable[[], machine_load.Watch | machine_load.Given] | None = None,
          ) -> tuple[dict[str, float], str, str | None]:
    """``measure``'s result from the cache, else measured now and cached if it can be trusted; where it came from, in
    words; and why it cannot be trusted beyond this run (None: it can; cached ones can).

    A figure measured now is cached only when its passes agreed (``STEADY``) and the machine was not loaded while
    they ran (``watch``, default ``machine_load.watch``: the load average, CPU steal, a reference kernel): passes under
    a steady load agree too, and such a figure would decide every later run on this machine (issue 48).

    A cached figure is checked first: its fastest candidate is timed again (``CHECK_ROUNDS`` passes). A figure
    more than ``STALE`` times slower than the check was taken under load (the fastest pass of an idle machine cannot
    be that much slower than a later one), so every candidate is measured again and the cache replaced, or dropped
    when the new figure cannot be trusted either. A check slower than the figure means this machine is busy now:
    the calmer cached figure is kept, and the line says so.
    """
    path = probe_path(model, rows, seq_len, device, candidates)
    try:
        cached = json.loads(path.read_text())["seconds"]
        if set(cached) != set(candidates):
            raise KeyError
    except (OSError, ValueError, KeyError, TypeError):
        cached = None
    note = ""
    if cached is not None:
        fastest = min(candidates, key=lambda c: cached[c])
        now, _ = measure(model, rows, seq_len, device, (fastest,), rounds=CHECK_ROUNDS)
        ratio = cached[fastest] / now[fastest]
        if ratio <= STALE:
            kept = "" if ratio >= 1 / STALE else (f"; a check now ran {1 / ratio:.1f}x slower ({_ms(now, [fastest])}): "
                                                  "a busy machine, the cached figure kept")
            return cached, f"cached in {path}{kept}", None
        note = (f"; the cached {_ms(cached, [fastest])} was {ratio:.1f}x slower than a check now "
                f"({_ms(now, [fastest])}), taken under load: measured again")
    watching = (watch or machine_load.watch)()
    t0 = time.perf_counter()
    seconds, steady = measure(model, rows, seq_len, device, candidates)
    took = time.perf_counter() - t0
    verdict = watching.verdict()
    busy = (f"on a loaded machine ({verdict.why})" if verdict.loaded
            else None if steady else f"with passes that varied by more than {STEADY - 1:.0%}")
    if busy is not None:  # this choice holds for this run only, the next run measures again
        if cached is not None:  # and not from the stale figure
            path.unlink(missing_ok=True)
        return seconds, f"measured now in {took:.1f} s {busy}: this choice holds for this run only, not cached{note}", \
            busy
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"seconds": seconds, "probe_s": took}))
    except OSError:
        pass  # a read-only cache measures again next time; the run itself is unaffected
    return seconds, f"measured now in {took:.1f} s{note}", None


def safe_probe(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...],
               watch: Callable[[], machine_load.Watch | machine_load.Given] | None = None,
               ) -> tuple[dict[str, float] | None, str, str | None]:
    """``probe``, or, where one decoder layer of this family cannot be run on its own, ``None`` and why (one line):
    ``auto`` then falls back to what needs no measurement instead of stopping the run."""
    try:
        return probe(model, rows, seq_len, device, candidates, watch)
    except Exception as exc:  # noqa: BLE001 - any family-specific failure; the run goes on without a figure
        kind = getattr(_target(model).config, "model_type", type(_target(model)).__name__)
        message = str(exc).splitlines()[0] if str(exc) else ""
        why = f"one {kind} decoder layer could not be probed ({type(exc).__name__}: {message})"
        return None, why, why


def choose_dtype(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...],
                 watch: Callable[[], machine_load.Watch | machine_load.Given] | None = None,
                 ) -> tuple[Choice, float | None, str | None]:
    """The fastest of ``candidates`` (fp32 first) for this model and micro-batch on ``device``, with the reason;
    the chosen dtype's seconds per layer and micro-batch (the compile estimate's unit; None where the probe could
    not run); why that figure holds for this run only (None: it can be trusted; ``probe``)."""
    if device.type == "cuda":  # by capability; the chosen dtype alone is timed, for the compile estimate
        cap = torch.cuda.get_device_capability(device)
        fast = cap >= (8, 0) and "bf16" in candidates
        choice = Choice("bf16" if fast else "fp32", f"CUDA capability {cap[0]}.{cap[1]} "
                                                    f"{'has bf16 tensor cores' if fast else 'has no fast bf16'}")
        seconds, _, busy = safe_probe(model, rows, seq_len, device, (choice.value,), watch)
        return choice, seconds and seconds[choice.value], busy
    seconds, source, busy = safe_probe(model, rows, seq_len, device, candidates, watch)
    if seconds is None:
        return Choice("fp32", f"{source}; fp32, which needs no measurement"), None, busy
    fastest = min(candidates, key=lambda c: seconds[c])
    if fastest != "fp32" and seconds["fp32"] / seconds[fastest] < BF16_MARGIN:
        fastest = "fp32"
    times = _ms(seconds, candidates)
    why = (f"one decoder layer's forward+backward at {rows} x {seq_len} on {device.type}: {times} "
           f"(bf16 must be {BF16_MARGIN:.2f}x fp32's speed; {source})")
    return Choice(fastest, why), seconds[fastest], busy


def choose_compile(layer_seconds: float | None, layers: int, micro_steps: int, device: torch.device,
                   busy: str | None = None, after_step: int = 0) -> Choice:
    """Compile when the run's estimated eager time (decoder layers only) exceeds ``COMPILE_PAYS_AFTER_S``.

    ``micro_steps``: the micro-batches left to run (a resume: after ``after_step``). Not on a figure measured on a
    busy machine (``busy``, why): the load inflates the estimate (issue 48: 344 s estimated for a run that trained in
    141 s), and it slows the compile as much, so the fixed threshold would compile runs that do not pay it back. The
    line says what the estimate is made of; the run's first steps check it (``train/auto.py``, ``StepTimeCheck``).
    """
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
        return Choice(False, "no C++ compiler for torch.compile's CPU code")
    if layer_seconds is None:
        return Choice(False, "no step-time estimate (the probe could not run); model.compile = true compiles anyway")
    if busy is not None:
        return Choice(False, f"no step-time estimate from a figure measured {busy}; model.compile = true compiles "
                             "anyway")
    estimate = layer_seconds * layers * micro_steps
    left = f" left after step {after_step}" if after_step else ""
    basis = (f"estimated eager time {estimate:.0f} s = one decoder layer's {layer_seconds * 1e3:.0f} ms x {layers} "
             f"layer{'s' * (layers != 1)} x {micro_steps} micro-batches{left} (the probe's figure; the embedding, "
             "head, optimizer and evals not counted)")
    if estimate < COMPILE_PAYS_AFTER_S:
        return Choice(False, f"{basis} < {COMPILE_PAYS_AFTER_S:.0f} s, where a compile starts to pay back", estimate)
    return Choice(True, f"{basis} >= {COMPILE_PAYS_AFTER_S:.0f} s", estimate)
