"""``model.dtype = "auto"`` and ``model.compile = "auto"``: what runs fastest on this machine, decided at start-up.

Whether bf16 pays on a CPU depends on the machine: one of our 2-core machines ran bf16 autocast 1.45x faster than
fp32, another slower (docs/benchmarks.md). CPU flags do not tell reliably (AMX helps, avx512_bf16 alone may not,
a hypervisor may hide either), so the CPU choice is measured: a few forward+backward passes of one decoder layer of
the run's own shape in each candidate dtype, interleaved round by round (a busy neighbour slows all alike) and
judged by each candidate's fastest pass. The result is cached per machine and shape in treadle's cache, so only
the first run of a shape pays. CUDA decides by capability: bf16 from Ampere (8.0) on.

A bf16 candidate must beat fp32 by ``BF16_MARGIN``: it trades precision for speed, and a coin toss of timing noise
should not flip a run to it. Compile is judged by a documented threshold on the run's estimated eager time
(``COMPILE_PAYS_AFTER_S``), estimated from the same probe.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from treadle.corpus import cache_dir
from treadle.fsutil import write_atomic
from treadle.models.hf import decoder_layers

DTYPES = ("fp32", "bf16", "bf16-weights")
BF16_MARGIN = 1.10  # a bf16 candidate is chosen only if its layer step is >= 10% faster than fp32's
# A cold regional compile of the tiny preset costs 25-36 s here and saves ~30% of each eager step, so it pays back
# after ~100 s of eager steps; compile time grows with the model and the gain shrinks on a busy machine: 5x margin.
COMPILE_PAYS_AFTER_S = 600.0
PROBE_ROUNDS = 3  # timed passes per candidate, after one untimed pass each (first-call paths, allocator)
STEADY = 1.25  # a measurement is cached only if each candidate's two fastest passes are this close
PROBE_ROWS = 2  # rows of the run's micro-batch measured (the per-row time scales to the whole micro-batch)
PROBE_VERSION = 1  # in the cache key: a changed probe measures again


@dataclass
class Choice:
    value: str | bool
    why: str


def _machine() -> dict:
    """What makes a measurement valid elsewhere: CPU model and flags, torch, threads."""
    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in cpu:
                cpu[key.strip()] = val.strip()
    except OSError:
        cpu["processor"] = platform.processor()
    return {"host": platform.node(), "machine": platform.machine(), **cpu, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def cpu_flags() -> list[str]:
    """The CPU's bf16-related flags (recorded beside the figures; not used for the choice)."""
    flags = _machine().get("flags", "").split()
    return [f for f in flags if "bf16" in f or f.startswith("amx") or f in ("avx512f", "avx512_fp16", "avx2")]


def _layer_and_rotary(model: nn.Module) -> tuple[nn.Module, nn.Module | None, int]:
    """One decoder layer, the rotary embedding that feeds it, and the hidden size (a draft run: its target's)."""
    model = getattr(model, "target", model)
    inner = getattr(model, "model", model)
    return decoder_layers(model)[0], getattr(inner, "rotary_emb", None), model.config.hidden_size


def _fresh_rotary(model: nn.Module, rotary: nn.Module | None, device: torch.device) -> nn.Module | None:
    """The run's rotary embedding on ``device``; a new one of its class when the run's is still empty (meta: a model
    read from disk is filled only once the engine has sharded it). HF builds them as ``Rotary(config)``."""
    if rotary is None:
        return None
    if any(b.is_meta for b in rotary.buffers()):
        return type(rotary)(getattr(model, "target", model).config).to(device)
    return copy.deepcopy(rotary).to(device)


def _fresh_layer(model: nn.Module, layer: nn.Module, device: torch.device) -> nn.Module:
    """A new fp32 layer of ``layer``'s class and config on ``device`` (the run's may be on meta, or partitioned by
    ZeRO-3); HF decoder layers are built as ``Layer(config, layer_idx)``. Call under ``fork_rng``: init draws."""
    torch.manual_seed(0)
    return type(layer)(getattr(model, "target", model).config, 0).float().to(device).train()


def _pass(layer: nn.Module, x: torch.Tensor, pos: torch.Tensor, rotary: nn.Module | None, autocast: bool) -> float:
    device = x.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        kwargs = {"position_embeddings": rotary(x, pos)} if rotary is not None else {}
        out = layer(x, position_ids=pos, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(model: nn.Module, rows: int, seq_len: int, device: torch.device,
            candidates: tuple[str, ...]) -> tuple[dict[str, float], bool]:
    """Seconds of one forward+backward of one decoder layer on a ``rows`` x ``seq_len`` micro-batch, per candidate
    (the fastest of ``PROBE_ROUNDS`` interleaved passes, scaled from ``PROBE_ROWS`` rows), and whether the passes
    agreed (each candidate's second-fastest within ``STEADY`` of its fastest). Leaves torch's RNG as it found it."""
    layer, rotary, hidden = _layer_and_rotary(model)
    n = min(rows, PROBE_ROWS)
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fp32 = _fresh_layer(model, layer, device)
        layers = {c: (copy.deepcopy(fp32).to(torch.bfloat16) if c == "bf16-weights" else fp32) for c in candidates}
        rot = _fresh_rotary(model, rotary, device)
        pos = torch.arange(seq_len, device=device).expand(n, seq_len)
        x32 = (torch.randn(n, seq_len, hidden, generator=gen)).to(device).requires_grad_()
        inputs = {c: (x32.detach().bfloat16().requires_grad_() if c == "bf16-weights" else x32) for c in candidates}
        times: dict[str, list[float]] = {c: [] for c in candidates}
        for r in range(PROBE_ROUNDS + 1):
            for c in candidates:
                t = _pass(layers[c], inputs[c], pos, rot, autocast=c == "bf16")
                if r:  # the first round warms up
                    times[c].append(t)
    steady = all(sorted(ts)[1] <= STEADY * min(ts) for ts in times.values())
    return {c: min(ts) * rows / n for c, ts in times.items()}, steady


def _shape_key(model: nn.Module, rows: int, seq_len: int, device: torch.device, candidates: tuple[str, ...]) -> str:
    layer, _, _ = _layer_and_rotary(model)
    cfg = getattr(model, "target", model).config
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "num_experts", "num_local_experts")}
    key = {"v": PROBE_VERSION, "machine": _machine(), "device": str(device), "layer": type(layer).__name__,
           "shape": shape, "rows": rows, "seq_len": seq_len, "candidates": list(candidates)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def probe(model: nn.Module, rows: int, seq_len: int, device: torch.device,
          candidates: tuple[str, ...]) -> tuple[dict[str, float], str, bool]:
    """``measure``'s result from the cache, else measured now and cached if steady; where it came from, in words;
    and whether it is steady (cached ones are)."""
    path = cache_dir() / "autotune" / f"{_shape_key(model, rows, seq_len, device, candidates)}.json"
    try:
        return json.loads(path.read_text())["seconds"], f"cached in {path}", True
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.perf_counter()
    seconds, steady = measure(model, rows, seq_len, device, candidates)
    took = time.perf_counter() - t0
    if not steady:  # a busy machine: this choice holds for this run only, the next run measures again
        return seconds, f"measured now in {took:.1f} s, not cached: passes varied by more than {STEADY - 1:.0%}", False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"seconds": seconds, "probe_s": took}))
    except OSError:
        pass  # a read-only cache measures again next time; the run itself is unaffected
    return seconds, f"measured now in {took:.1f} s", True


def choose_dtype(model: nn.Module, rows: int, seq_len: int, device: torch.device,
                 candidates: tuple[str, ...]) -> tuple[Choice, float, bool]:
    """The fastest of ``candidates`` (fp32 first) for this model and micro-batch on ``device``, with the reason;
    the chosen dtype's seconds per layer and micro-batch (the compile estimate's unit); whether the timing was
    steady."""
    if device.type == "cuda":  # by capability; the chosen dtype alone is timed, for the compile estimate
        cap = torch.cuda.get_device_capability(device)
        fast = cap >= (8, 0) and "bf16" in candidates
        choice = Choice("bf16" if fast else "fp32", f"CUDA capability {cap[0]}.{cap[1]} "
                                                    f"{'has bf16 tensor cores' if fast else 'has no fast bf16'}")
        seconds, _, steady = probe(model, rows, seq_len, device, (choice.value,))
        return choice, seconds[choice.value], steady
    seconds, source, steady = probe(model, rows, seq_len, device, candidates)
    fastest = min(candidates, key=lambda c: seconds[c])
    if fastest != "fp32" and seconds["fp32"] / seconds[fastest] < BF16_MARGIN:
        fastest = "fp32"
    times = ", ".join(f"{c} {seconds[c] * 1e3:.0f} ms" for c in candidates)
    why = (f"one decoder layer's forward+backward at {rows} x {seq_len} on {device.type}: {times} "
           f"(bf16 must be {BF16_MARGIN:.2f}x fp32's speed; {source})")
    return Choice(fastest, why), seconds[fastest], steady


def choose_compile(layer_seconds: float, layers: int, micro_steps: int, device: torch.device,
                   steady: bool = True) -> Choice:
    """Compile when the run's estimated eager time (decoder layers only) exceeds ``COMPILE_PAYS_AFTER_S``.

    Not on an unsteady timing: a busy machine inflates the estimate, but it slows the compile as much, so the
    fixed threshold would compile runs that do not pay it back.
    """
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
        return Choice(False, "no C++ compiler for torch.compile's CPU code")
    if not steady:
        return Choice(False, "the step-time estimate was taken on a busy machine (passes varied); "
                             "model.compile = true compiles anyway")
    estimate = layer_seconds * layers * micro_steps
    if estimate < COMPILE_PAYS_AFTER_S:
        return Choice(False, f"estimated eager time {estimate:.0f} s < {COMPILE_PAYS_AFTER_S:.0f} s, "
                             "where a compile starts to pay back")
    return Choice(True, f"estimated eager time {estimate:.0f} s >= {COMPILE_PAYS_AFTER_S:.0f} s")
