"""Checkpoint cost: sync save, load, and how long an async save stalls the training thread.

For each model (the ``tiny`` preset, 7.4M parameters, and ``small``), with AdamW
state initialized by one real step:

- sync save: ``CheckpointManager.save`` end to end (DCP write, fsync, rename, latest);
- load: ``CheckpointManager.load`` (validation, restricted unpickling, DCP read);
- async stall: from calling ``save`` until it returns, i.e. until the training thread
  can run its next step (the snapshot is taken; the write goes on in the background);
  the first save is listed apart because it allocates the staging buffers;
- torch's ``dcp.async_save`` (thread mode, its default stager) on the same state,
  for comparison: the alternative we did not take;
- the first training step run while the background write is in flight, against the
  same step with nothing in flight (2 cores are shared with the writer).

    .venv/bin/python bench/checkpoint.py [--reps 5] [--presets tiny,small]

Prints a markdown table. The target is an async stall under 10% of the sync save.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import treadle  # noqa: F401  (filters DCP's "no process group" warning)
from treadle.checkpoint.manager import CheckpointManager
from treadle.config import ModelConfig
from treadle.engine import LocalEngine
from treadle.models.hf import build_model, count_parameters

VOCAB = 8192


def setup(preset: str) -> tuple[LocalEngine, dict]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset), vocab_size=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, VOCAB, (4, 128))
    eng = LocalEngine(model, opt, torch.device("cpu"))
    train_step(eng, batch)  # AdamW state exists from here on
    return eng, {"input_ids": batch, "labels": batch}


def train_step(eng: LocalEngine, batch) -> float:
    t0 = time.perf_counter()
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    eng.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    eng.step()
    eng.zero_grad()
    return time.perf_counter() - t0


def state_mb(eng: LocalEngine) -> float:
    def size(o):
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, dict):
            return sum(size(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(size(v) for v in o)
        return 0

    return size(eng.state_dict()) / 2**20


def bench(preset: str, reps: int, work: Path) -> dict:
    eng, batch = setup(preset)
    ts = {"train": {"step": 0}}
    cfg = "[model]\n"
    sync = CheckpointManager(work / f"{preset}-sync", keep_last=2)
    saves, loads = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        path = sync.save(i + 1, eng, ts, cfg)
        saves.append(time.perf_counter() - t0)
    for _ in range(reps):
        t0 = time.perf_counter()
        sync.load(path, eng)
        loads.append(time.perf_counter() - t0)

    asyn = CheckpointManager(work / f"{preset}-async", keep_last=2, async_save=True)

    def ours(i):
        asyn.save(i + 1, eng, ts, cfg)
        return asyn.wait

    def theirs(i):  # torch's own async save of the same state, for comparison
        target = work / f"{preset}-torch-{i}"
        fut = dcp.async_save(eng.state_dict(), checkpoint_id=target)
        return lambda: (fut.result(), shutil.rmtree(target))

    timings = {}
    for name, start in (("ours", ours), ("torch", theirs)):
        stalls, writes, during, baseline = [], [], [], []
        for i in range(reps + 1):
            baseline.append(train_step(eng, batch))  # nothing in flight
            t0 = time.perf_counter()
            finish = start(i)
            stalls.append(time.perf_counter() - t0)
            during.append(train_step(eng, batch))  # overlaps the background write
            finish()
            writes.append(time.perf_counter() - t0)
        timings[name] = stalls, writes, during, baseline
    stalls, writes, during, baseline = timings["ours"]
    torch_stalls = timings["torch"][0]

    med = statistics.median
    return {
        "model": preset, "params": count_parameters(eng.model), "state_mb": state_mb(eng),
        "sync": med(saves), "load": med(loads), "stall_first": stalls[0], "stall": med(stalls[1:]),
        "write": med(writes[1:]), "torch_stall": med(torch_stalls[1:]), "torch_first": torch_stalls[0],
        "step": med(baseline), "step_during": med(during[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--presets", default="tiny,small")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        for preset in args.presets.split(","):
            rows.append(bench(preset, args.reps, Path(tmp)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
          f"python {platform.python_version()}, median of {args.reps} (async: after the first)\n")
    print("| model | params | state (MB) | sync save (s) | load (s) | async stall (ms) | stall / sync "
          "| first async stall (ms) | save to durable, one step overlapped (s) | torch dcp.async_save stall: first / median (ms) "
          "| train step: idle / during write (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['state_mb']:.0f} | {r['sync']:.2f} | {r['load']:.2f} "
              f"| {r['stall'] * 1e3:.0f} | {r['stall'] / r['sync']:.1%} | {r['stall_first'] * 1e3:.0f} "
              f"| {r['write']:.2f} | {r['torch_first'] * 1e3:.0f} / {r['torch_stall'] * 1e3:.0f} | {r['step']:.2f} / {r['step_during']:.2f} |")


if __name__ == "__main__":  # the guard also keeps any spawned worker from re-running the benchmark
    main()
