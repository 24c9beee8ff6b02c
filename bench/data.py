"""Data loading: what the loader delivers (tokens/s, no model) against what training the tiny model consumes.

Baseline: real training steps of the default ``tiny`` Llama through ``build_trainer``
(built-in data, seq_len 256, micro-batch 8, 2 threads, no eval or export, data.prefetch
on as by default), measured in this same run. Its tokens/s is global tokens per step over
the median step time (``Trainer.last_step_seconds``); the trainer's own data wait per step
(``last_data_seconds``) is reported too.

Loader cases (``StepLoader.next_step`` in a loop, nothing consumes the batches):

* ``packed``  - the built-in corpus train split as one source (``PackedDataset``);
* ``mixture`` - three sources: the built-in shards (weight 3), a text JSONL source and a
  chat SFT JSONL source (an ``ExampleDataset``), temperature 2, with a phase switch
  (weights 3/1/1 -> 1/1/3) half-way through each round;
* ``mixture, consumer waits`` - the same mixture with and without ``prefetch=True``:
  the consumer does a fixed amount of work per step (matmuls on the same 2 threads as
  training, calibrated to one training step of the baseline, capped at ``--max-work-s``
  so that a loaded machine does not stretch the bench: a step's build takes about a
  millisecond, so any longer work hides it alike). The table gives the mean time the
  consumer waits in ``next_step`` after the first step (always built in the call, with
  cold permutations; reported apart); its tokens/s is tokens per step over that wait.

The JSONL files come from ``treadle.data.samples.write_samples``; they are tokenized
into a throw-away cache (``$TREADLE_CACHE`` pointed at a temporary directory) before any
timing: that one-time build, and a second open that hits the cache, are reported apart.

Rounds are interleaved (train, packed, mixture, train, ...) and medians reported, so
that another job on the machine's cores hits every case alike.

    python bench/data.py [--rounds 3] [--train-steps 6] [--loader-steps 500] [--wait-steps 9]
                         [--max-work-s 0.5] [--profile] [--json out.json]

Target (issue): every loader case >= 50x the tokens/s that training consumes.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from treadle import corpus
from treadle.config import load_config
from treadle.data.builtin import builtin_shards
from treadle.data.loader import StepLoader
from treadle.data.mixture import Mixture, Phase
from treadle.data.packed import PackedDataset
from treadle.data.sources import open_source
from treadle.train.callbacks import Callback, MetricsCallback
from treadle.train.run import build_trainer

TARGET = 50.0
WEIGHTS = (3.0, 1.0, 1.0)  # builtin, text, sft: until the phase switch
SWITCHED = (1.0, 1.0, 3.0)  # after it
TEMPERATURE = 2.0


# ----------------------------------------------------------------------------- machine


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- training baseline


class _Interleave(Callback):
    """Records each step's times; after the warm-up and after every chunk of steps, runs ``between`` (one round).

    ``Trainer.fit`` closes the loader (its prefetch pool) when it returns, so the whole
    baseline is one ``fit`` and the loader rounds run from here, between training steps
    (outside ``last_step_seconds``, which is taken before the callbacks).
    """

    def __init__(self, warmup: int, chunk: int, between):
        self.warmup, self.chunk, self.between = warmup, chunk, between
        self.step, self.data, self.seen = [], [], 0

    def on_step_end(self, trainer, result) -> None:
        self.seen += 1
        if self.seen > self.warmup:
            self.step.append(trainer.last_step_seconds)
            self.data.append(trainer.last_data_seconds)
        if self.seen >= self.warmup and (self.seen - self.warmup) % self.chunk == 0:
            self.between((self.seen - self.warmup) // self.chunk)


class Training:
    def __init__(self, args, out: Path):
        cfg = load_config(None, [
            f"--train.output_dir={out}", f"--train.micro_batch_size={args.batch}", f"--data.seq_len={args.seq_len}",
            "--model.preset=tiny", "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none",
            f"--train.max_steps={10**6}", f"--train.log_every={10**6}", "--train.threads=2", "--schedule.warmup_steps=10",
        ])
        self.trainer = build_trainer(cfg, live=False)
        self.trainer.console.enabled = False
        self.trainer.callbacks = [cb for cb in self.trainer.callbacks if isinstance(cb, MetricsCallback)]

    def run(self, warmup: int, rounds: int, chunk: int, between) -> _Interleave:
        """``warmup`` steps, then ``rounds`` chunks of ``chunk`` steps; ``between(i)`` after the warm-up (i = 0) and each chunk."""
        times = _Interleave(warmup, chunk, between)
        self.trainer.callbacks.append(times)
        self.trainer.max_steps = self.trainer.state.step + warmup + rounds * chunk
        self.trainer.fit()
        return times


# ----------------------------------------------------------------------------- sources and loaders


def open_sources(args, tmp: Path) -> tuple[dict, dict]:
    """{name: dataset} of the mixture, and the cache build / hit timings of the JSONL sources."""
    from treadle.data.samples import write_samples

    data_cfg = load_config(None, [f"--data.seq_len={args.seq_len}"]).data
    tok = corpus.builtin_tokenizer_dir()
    builtin = builtin_shards("train", tok)  # the user's cache: it is the training data too
    t0 = time.perf_counter()
    files = write_samples(tmp / "samples", n=args.sample_rows, seed=0)
    timings = {"write_samples_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    importlib.import_module("datasets")  # part of the first open of a data file in a fresh process: timed apart
    timings["import_datasets_s"] = time.perf_counter() - t0

    old = os.environ.get("TREADLE_CACHE")
    os.environ["TREADLE_CACHE"] = str(tmp / "cache")  # a cold cache for the JSONL sources, thrown away at the end
    try:
        specs = {"text": files["text"], "sft": files["chat"]}
        datasets_by_name = {"builtin": PackedDataset([builtin], args.seq_len, data_cfg.mask_cross_doc)}
        for name, path in specs.items():
            opened = {}
            for attempt in ("build", "hit"):  # format "auto", the config default: reads the first row even on a hit
                t0 = time.perf_counter()
                opened[attempt] = open_source(name, [str(path)], "train", "auto", "text", args.seq_len, data_cfg, tok,
                                              f"data.sources ({name})")
                timings[f"{name}_{attempt}_s"] = time.perf_counter() - t0
            assert opened["build"].dataset.shards[0].path == opened["hit"].dataset.shards[0].path, "second open missed the cache"
            ds = opened["hit"].dataset
            datasets_by_name[name] = ds
            timings[f"{name}_describe"] = opened["hit"].describe()
            timings[f"{name}_rows"] = int(ds.meta.get("rows", 0))
    finally:
        if old is None:
            os.environ.pop("TREADLE_CACHE", None)
        else:
            os.environ["TREADLE_CACHE"] = old
    return datasets_by_name, timings


def mixture_loader(sources: dict, args, steps: int, prefetch: bool = False) -> StepLoader:
    mix = Mixture(list(sources), WEIGHTS, [Phase(steps // 2, SWITCHED)], TEMPERATURE)
    return StepLoader(sources, args.batch, 1, seed=0, mixture=mix, prefetch=prefetch)


def loader_rate(make, steps: int, tokens_per_step: int) -> float:
    loader = make()
    try:
        t0 = time.perf_counter()
        for s in range(steps):
            loader.next_step(s)
        return steps * tokens_per_step / (time.perf_counter() - t0)
    finally:
        loader.close()


def per_sample_us(ds, n: int = 200) -> float:
    step = max(1, len(ds) // n)
    idx = [(i * step) % len(ds) for i in range(n)]
    t0 = time.perf_counter()
    for i in idx:
        ds[i]
    return (time.perf_counter() - t0) / n * 1e6


# ----------------------------------------------------------------------------- consumer wait (prefetch)


class FakeWork:
    """A fixed number of matmuls on the torch threads, calibrated to last about one training step."""

    def __init__(self, seconds: float, size: int = 512):
        self.a = torch.randn(size, size)
        self.b = torch.randn(size, size)
        self._mm(3)
        t0, reps = time.perf_counter(), 20
        self._mm(reps)
        self.count = max(1, round(seconds / ((time.perf_counter() - t0) / reps)))

    def _mm(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b)

    def __call__(self) -> None:
        self._mm(self.count)


def consumer_wait(sources: dict, args, work: FakeWork, prefetch: bool) -> dict:
    """Seconds waited in ``next_step``: the first step (always built in the call, cold caches) and the mean of the rest."""
    loader = mixture_loader(sources, args, args.wait_steps, prefetch=prefetch)
    waits = []
    try:
        start = time.perf_counter()
        for s in range(args.wait_steps):
            t0 = time.perf_counter()
            loader.next_step(s)
            waits.append(time.perf_counter() - t0)
            work()
        total = time.perf_counter() - start
    finally:
        loader.close()
    return {"first_s": waits[0], "wait_s": statistics.mean(waits[1:]), "step_s": total / args.wait_steps, "waits_s": waits}


# ----------------------------------------------------------------------------- main


def profile_mixture(sources: dict, args, top: int = 14) -> str:
    loader = mixture_loader(sources, args, args.loader_steps)
    prof = cProfile.Profile()
    prof.enable()
    for s in range(args.loader_steps):
        loader.next_step(s)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--train-steps", type=int, default=6, help="training steps per round (after 2 warm-up steps)")
    p.add_argument("--loader-steps", type=int, default=500, help="loader steps per round and case")
    p.add_argument("--wait-steps", type=int, default=9, help="steps per round of the consumer-wait case (the first is reported apart)")
    p.add_argument("--max-work-s", type=float, default=0.5, help="cap on the consumer's work per step (seconds)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--sample-rows", type=int, default=500, help="rows per JSONL file (write_samples n)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the mixture loader")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()

    torch.set_num_threads(2)
    begin, load_start = time.perf_counter(), load()
    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-data-"))
    try:
        res = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["machine"] = machine()
    res["load_average"] = {"start": load_start, "end": load()}
    res["wall_s"] = time.perf_counter() - begin
    report(res, args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


def run(args, tmp: Path) -> dict:
    tokens = args.batch * args.seq_len
    train = Training(args, tmp / "run")
    sources, cache = open_sources(args, tmp)
    packed = sources["builtin"]

    rates = {"packed": [], "mixture": []}

    def loader_round(i: int) -> None:  # i = 0: after the warm-up steps, a warm-up of the loaders too
        steps = 20 if i == 0 else args.loader_steps
        packed_rate = loader_rate(lambda: StepLoader(packed, args.batch, 1, seed=i), steps, tokens)
        mixture_rate = loader_rate(lambda: mixture_loader(sources, args, steps), steps, tokens)
        if i > 0:
            rates["packed"].append(packed_rate)
            rates["mixture"].append(mixture_rate)

    times = train.run(2, args.rounds, args.train_steps, loader_round)
    step_s = statistics.median(times.step)
    train_rate = tokens / step_s

    work = FakeWork(min(step_s, args.max_work_s))
    waits = {False: [], True: []}
    for _ in range(args.rounds):
        for prefetch in (False, True):
            waits[prefetch].append(consumer_wait(sources, args, work, prefetch))

    res = {
        "config": vars(args) | {"json": str(args.json) if args.json else None},
        "tokens_per_step": tokens,
        "train": {"tokens_per_s": train_rate, "step_s_median": step_s, "step_s": times.step,
                  "data_wait_s_median": statistics.median(times.data), "data_wait_s": times.data},
        "loader": {k: {"tokens_per_s": statistics.median(v), "rounds": v, "ratio": statistics.median(v) / train_rate}
                   for k, v in rates.items()},
        "consumer_wait": {("prefetch" if k else "no_prefetch"): {
            "wait_s_mean": statistics.median(r["wait_s"] for r in v), "first_s": statistics.median(r["first_s"] for r in v),
            "step_s_mean": statistics.median(r["step_s"] for r in v), "rounds": v} for k, v in waits.items()},
        "fake_work": {"matmuls_512": work.count, "target_s": min(step_s, args.max_work_s)},
        "cache": cache,
        "per_sample_us": {name: per_sample_us(ds) for name, ds in sources.items()},
        "samples_per_source": {name: len(ds) for name, ds in sources.items()},
    }
    for prefetch, key in ((False, "no_prefetch"), (True, "prefetch")):  # the wait, as a rate: what the consumer sees
        w = res["consumer_wait"][key]["wait_s_mean"]
        res["consumer_wait"][key]["tokens_per_s"] = tokens / w if w > 0 else float("inf")
        res["consumer_wait"][key]["ratio"] = res["consumer_wait"][key]["tokens_per_s"] / train_rate
    if args.profile:
        res["profile"] = profile_mixture(sources, args)
    return res


def report(res: dict, args) -> None:
    m, t = res["machine"], res["train"]
    print(f"# data loading: {args.rounds} interleaved rounds, batch {args.batch} x {args.seq_len} "
          f"({res['tokens_per_step']:,} tokens/step), medians")
    print(f"# machine: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs, Python {m['python']}, torch {m['torch']}, "
          f"{m['torch_threads']} torch threads; load average {res['load_average']['start']} -> {res['load_average']['end']}")
    print()
    print(f"| case | tokens/s | vs training | >= {TARGET:.0f}x |")
    print("|---|---|---|---|")
    print(f"| training, tiny model (baseline; step {t['step_s_median'] * 1e3:,.0f} ms) | {fmt_rate(t['tokens_per_s'])} | 1x | |")
    names = {"packed": "loader: packed built-in shards", "mixture": "loader: mixture builtin/text/sft, T=2, phase switch"}
    for key, label in names.items():
        d = res["loader"][key]
        lo, hi = min(d["rounds"]), max(d["rounds"])
        print(f"| {label} | {fmt_rate(d['tokens_per_s'])} ({fmt_rate(lo)}-{fmt_rate(hi)}) | {d['ratio']:,.0f}x | "
              f"{'pass' if d['ratio'] >= TARGET else 'FAIL'} |")
    for key, label in (("no_prefetch", "mixture, consumer wait, prefetch off"), ("prefetch", "mixture, consumer wait, prefetch on")):
        d = res["consumer_wait"][key]
        print(f"| {label}: {d['wait_s_mean'] * 1e3:.2f} ms wait/step (first step {d['first_s'] * 1e3:.1f} ms), "
              f"{d['step_s_mean'] * 1e3:,.0f} ms/step in all | "
              f"{fmt_rate(d['tokens_per_s'])} | {d['ratio']:,.0f}x | {'pass' if d['ratio'] >= TARGET else 'FAIL'} |")
    print()
    print(f"Training's own data wait (prefetch on, in Trainer.fit): median {t['data_wait_s_median'] * 1e3:.3f} ms/step "
          f"of a {t['step_s_median'] * 1e3:,.0f} ms step. Consumer work: {res['fake_work']['matmuls_512']} matmuls "
          f"(512 x 512) per step, calibrated to {res['fake_work']['target_s'] * 1e3:,.0f} ms (a training step, at most "
          f"{args.max_work_s * 1e3:,.0f} ms).")
    c = res["cache"]
    print(f"Tokenization cache (JSONL sources, {args.sample_rows} rows asked per file; write_samples {c['write_samples_s']:.2f} s, "
          f"import datasets {c['import_datasets_s']:.2f} s):")
    print("| source | first open (build) s | second open (hit) s | dataset |")
    print("|---|---|---|---|")
    for name in ("text", "sft"):
        print(f"| {name} | {c[f'{name}_build_s']:.2f} | {c[f'{name}_hit_s']:.3f} | {c[f'{name}_describe']} |")
    us = res["per_sample_us"]
    print("Per-sample __getitem__: " + ", ".join(f"{k} {v:,.0f} us ({res['samples_per_source'][k]:,} samples)" for k, v in us.items()))
    print(f"Wall clock: {res['wall_s']:.0f} s")
    if "profile" in res:
        print()
        print(res["profile"])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
