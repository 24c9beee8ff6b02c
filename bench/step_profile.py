"""Where a step's host time goes: treadle's loop against bench/overhead.py's bare loop, under torch.profiler, and
every host sync each one makes per step, by the line that makes it.

    python bench/step_profile.py [--steps 12] [--batch 4] [--seq-len 256] [--dtype fp32]

A host sync is a call that needs a tensor's value on the host: ``.item()``, ``.tolist()``, ``float()`` / ``int()``
/ ``bool()`` of a tensor, ``.nonzero()``, ``.cpu()``, ``.numpy()``. On a CPU they cost nothing; on a GPU each one
waits for every kernel queued before it, so the host cannot run ahead and launch the next step's kernels while the
GPU works. They are counted here with a ``TorchFunctionMode`` (every tensor method call passes through it), the
site being the innermost frame outside torch. Counts per step are exact on any device; the profiler's table of
operator self time (CPU) shows what treadle runs per step beyond the bare loop's forward, backward, clip and AdamW.
The model is the ``tiny`` preset on the built-in corpus (bench/overhead.py's shapes), local engine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (bench/ is not a package: its Bare loop and treadle's config)

from treadle.train.callbacks import Callback  # noqa: E402

SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "nonzero", "cpu", "numpy", "__index__"}
HERE = str(Path(__file__).resolve().parent)


class SyncCounter(TorchFunctionMode):
    """Counts host syncs by (method, site) into ``counts`` (reset by the caller per step)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.counts[(name, site())] += 1
        return func(*args, **(kwargs or {}))


def site() -> str:
    """The innermost frame in treadle's or this bench's code (torch's own frames skipped), and the library frame
    under it where the call is a library's (transformers')."""
    ours, library = None, None
    for frame in reversed(traceback.extract_stack()[:-2]):  # without site() and __torch_function__
        if "/treadle/" in frame.filename or frame.filename.startswith(HERE):
            path = frame.filename.split("/src/")[-1] if "/src/" in frame.filename else Path(frame.filename).name
            ours = f"{path}:{frame.lineno} {frame.name}"
            break
        if library is None and "/torch/" not in frame.filename:
            library = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return f"{library} (from {ours})" if library else (ours or "elsewhere")


class Probe:
    """Per-step sync counts and a profiler window over steps ``first+1 .. first+steps`` (steps counted from 1).
    ``at_step_start(k)``, called as step k+1 starts (k steps done), closes step k: all of it, its callbacks too."""

    def __init__(self, first: int, steps: int):
        from torch.profiler import ProfilerActivity, profile

        self.first, self.steps = first, steps
        self.counter, self.per_step = SyncCounter(), []
        self.prof = profile(activities=[ProfilerActivity.CPU])

    def at_step_start(self, k: int) -> None:
        if self.first < k <= self.first + self.steps:
            self.per_step.append(self.counter.counts)
        self.counter.counts = collections.Counter()
        if k == self.first:
            self.prof.start()
        elif k == self.first + self.steps:
            self.prof.stop()


class ProbeCallback(Callback):
    def __init__(self, probe: Probe):
        self.probe = probe

    def on_step_start(self, trainer) -> None:
        self.probe.at_step_start(trainer.state.step)


def run_bare(args, probe: Probe) -> None:
    bare = overhead.Bare(args)
    with probe.counter:
        for k in range(probe.first + probe.steps + 1):
            probe.at_step_start(k)
            bare.steps(1)


def run_treadle(args, probe: Probe) -> None:
    """``treadle train``'s loop with every callback the run has (overhead.py keeps only the metrics one)."""
    from treadle.train.run import build_trainer, close_trainer

    args.rounds = 1  # overhead.config: 2 + steps + 1 steps
    cfg = overhead.config(args, tempfile.mkdtemp(), args.dtype)
    cfg.model.attention = args.attention
    trainer = build_trainer(cfg, live=False,
                            callbacks=[ProbeCallback(probe)])
    try:
        with probe.counter:
            trainer.fit()
    finally:
        close_trainer(trainer)


def top(prof, steps: int, n: int) -> dict[str, tuple[float, int]]:
    """Operator -> (self CPU ms per step, calls per step), the top n."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in ranked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="steps measured (treadle logs every 10th: one log step)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--attention", choices=["auto", "dense", "varlen"], default="auto", help="treadle's model.attention")
    args = p.parse_args()
    torch.set_num_threads(2)
    results = {}
    for name, run in (("bare", run_bare), ("treadle", run_treadle)):
        probe = Probe(2, args.steps)  # two warm-up steps
        run(args, probe)
        results[name] = (probe.per_step, probe.prof)

    print(f"# {args.steps} steps of batch {args.batch} x {args.seq_len}, tiny preset, {args.dtype}, treadle's "
          f"model.attention {args.attention}, torch "
          f"{torch.__version__}, 2 threads")
    for name, (per_step, prof) in results.items():
        totals = collections.Counter()
        for c in per_step:
            totals.update(c)
        counts = [sum(c.values()) for c in per_step]
        print(f"\n## {name}: host syncs per step {min(counts)}-{max(counts)} (total {sum(counts)} over {args.steps})")
        print("| call | site | per step |")
        print("|---|---|---|")
        for (call, where), n in totals.most_common():
            print(f"| {call} | {where} | {n / args.steps:.2f} |")
    print("\n## operators by self CPU time per step")
    print("| operator | bare ms | bare calls | treadle ms | treadle calls |")
    print("|---|---|---|---|---|")
    bare, ours = (top(results[k][1], args.steps, args.top) for k in ("bare", "treadle"))
    full = {k: top(results[k][1], args.steps, 10_000) for k in ("bare", "treadle")}
    for op in dict.fromkeys([*ours, *bare]):
        b, t = full["bare"].get(op, (0.0, 0)), full["treadle"].get(op, (0.0, 0))
        print(f"| {op} | {b[0]:.2f} | {b[1]:.0f} | {t[0]:.2f} | {t[1]:.0f} |")
    extra = sorted(((op, t[1] - full["bare"].get(op, (0, 0))[1]) for op, t in full["treadle"].items()),
                   key=lambda x: -x[1])
    print("\nops treadle calls more often per step than the bare loop: "
          + ", ".join(f"{op} +{n:.0f}" for op, n in extra if n >= 1))


if __name__ == "__main__":
    main()
