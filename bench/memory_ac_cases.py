"""Activation checkpointing: peak memory and step time of one training step, none / selective / full.

    python bench/memory_ac_cases.py [--seq-len 4096] [--budget-mib 1024] [--max-seq-len 16384]

Peak memory: each case alone in a fresh process (peak RSS, ``ru_maxrss``, is a high-water mark), two steps of
``optimizer_step`` on the local engine: the tiny preset with a 1,024-token vocabulary (so the decoder's
activations, not the logits, dominate the step's memory), one row of ``--seq-len`` tokens, fp32. Step time: the
three models in one process, one step each per round for ``--steps`` rounds after a warm-up round, median per
mode (other load on the machine then slows all alike).

The longest sequence: doubling from 1,024 tokens, then bisecting to a multiple of 1,024, one step in a child whose data segment is capped at
``--budget-mib`` (``RLIMIT_DATA``: the heap and anonymous mappings, where tensors live; a step that needs more fails
to allocate), up to ``--max-seq-len``. A cap instead of the machine's whole memory: the probe must not push other
processes out of memory. ``activation_checkpointing_cases()`` returns the rows; bench/memory.py can print them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 1024
MODES = ("none", "selective", "full")


def _engine_and_batch(mode: str, seq_len: int):
    import torch

    from treadle.config import ModelConfig
    from treadle.engine.local import LocalEngine
    from treadle.models.checkpointing import apply_activation_checkpointing
    from treadle.models.hf import build_model

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = ModelConfig(activation_checkpointing=mode, overrides={"max_position_embeddings": max(seq_len, 2048)})
    model = build_model(cfg, VOCAB)
    apply_activation_checkpointing(model, cfg)  # as train/run.py does
    model.train()
    engine = LocalEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return engine, {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len)[None]}


def _timed_step(engine, batch) -> float:
    from treadle.train.step import optimizer_step

    t0 = time.perf_counter()
    optimizer_step(engine, [batch], grad_clip=1.0)
    return time.perf_counter() - t0


def run_case(mode: str, seq_len: int, steps: int, budget_mib: int = 0) -> dict:
    """In the child: build the tiny model with ``mode``, train ``steps`` (+1 warm-up) steps; peak RSS and step time."""
    if budget_mib:
        limit = budget_mib * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    import torch

    from memory import _peak_bytes  # bench/memory.py's measure: ru_maxrss on CPU

    engine, batch = _engine_and_batch(mode, seq_len)
    before = _peak_bytes(torch.device("cpu"))  # interpreter, torch and the fp32 model, before any step
    times = [_timed_step(engine, batch) for _ in range(steps + 1)][1:]  # the first is the warm-up
    step_s = statistics.median(times) if times else None
    return {"peak_bytes": _peak_bytes(torch.device("cpu")), "before_bytes": before, "step_s": step_s}


def interleaved_step_times(seq_len: int, rounds: int) -> dict[str, float]:
    """In the child: every mode's model in one process, one step each per round (none, selective, full, none, ...),
    so that load from other processes hits all alike; the median step per mode."""
    runs = {mode: _engine_and_batch(mode, seq_len) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds + 1):  # round 0 warms up
        for mode, (engine, batch) in runs.items():
            t = _timed_step(engine, batch)
            if r:
                times[mode].append(t)
    return {mode: statistics.median(t) for mode, t in times.items()}


def _child(mode: str, seq_len: int, steps: int, budget_mib: int = 0) -> dict | None:
    cmd = [sys.executable, __file__, "--case", mode, "--seq-len", str(seq_len), "--steps", str(steps),
           "--budget-mib", str(budget_mib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        if budget_mib:  # did not fit
            return None
        sys.exit(f"{mode} at {seq_len} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def longest_seq_len(mode: str, budget_mib: int, max_seq_len: int, step: int = 1024) -> tuple[int | None, bool]:
    """The longest sequence (a multiple of ``step``) one step trains at within the budget: doubling from ``step``,
    then bisection between the last length that fitted and the first that did not; True if the search stopped at
    ``max_seq_len`` still fitting."""
    seq, best = step, None
    while seq <= max_seq_len and _child(mode, seq, 0, budget_mib) is not None:
        best, seq = seq, seq * 2
    if seq > max_seq_len or best is None:
        return best, seq > max_seq_len
    lo, hi = best, seq  # fits, does not fit
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if _child(mode, mid, 0, budget_mib) is not None else (lo, mid)
    return lo, False


def activation_checkpointing_cases(seq_len: int = 4096, steps: int = 3, budget_mib: int = 1024,
                                   max_seq_len: int = 16384) -> list[dict]:
    """One row per mode: peak RSS and step time at ``seq_len``, and the longest sequence within ``budget_mib``."""
    cmd = [sys.executable, __file__, "--interleaved", "--seq-len", str(seq_len), "--steps", str(steps)]
    step_s = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    rows = []
    for mode in MODES:
        r = _child(mode, seq_len, 1) | {"step_s": step_s[mode]}
        longest, capped = longest_seq_len(mode, budget_mib, max_seq_len) if budget_mib else (None, False)
        rows.append({"case": f"ac-{mode}", "seq_len": seq_len, "steps": steps, "peak_mib": r["peak_bytes"] / 2**20,
                     "before_mib": r["before_bytes"] / 2**20, "step_s": r["step_s"], "tokens_per_s": seq_len / r["step_s"],
                     "longest_seq_len": longest, "longest_capped": capped, "budget_mib": budget_mib})
    base = rows[0]
    for row in rows:
        row["peak_vs_none"] = row["peak_mib"] / base["peak_mib"]
        row["time_vs_none"] = row["step_s"] / base["step_s"]
    return rows


def print_table(rows: list[dict]) -> None:
    import torch

    from memory import machine  # bench/memory.py, the one script that runs these cases too

    first = rows[0]
    print(f"# {machine(torch.device('cpu'))}; tiny preset (4 layers, hidden 256), vocab {VOCAB:,}, 1 x "
          f"{first['seq_len']} tokens per step, fp32; peak RSS of a warm-up step and one more (before the first step: "
          f"the process with torch and the model); step time: median of {first['steps']} interleaved rounds")
    print(f"| activation checkpointing | RSS before step MiB | peak RSS MiB | vs none | step s | vs none | tokens/s | "
          f"longest seq_len within {first['budget_mib']:,} MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        longest = "-" if r["longest_seq_len"] is None else f"{'>= ' if r['longest_capped'] else ''}{r['longest_seq_len']:,}"
        print(f"| {r['case'].removeprefix('ac-')} | {r['before_mib']:,.0f} | {r['peak_mib']:,.0f} | {r['peak_vs_none']:.2f}x | "
              f"{r['step_s']:.2f} | {r['time_vs_none']:.2f}x | {r['tokens_per_s']:,.0f} | {longest} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed interleaved rounds after the warm-up (median reported)")
    ap.add_argument("--budget-mib", type=int, default=1024, help="data-segment cap of the longest-sequence probe; 0 = skip")
    ap.add_argument("--max-seq-len", type=int, default=16384, help="the probe stops doubling here")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: run this mode, print JSON
    ap.add_argument("--interleaved", action="store_true", help=argparse.SUPPRESS)  # the child timing all modes
    args = ap.parse_args()
    if args.interleaved:
        print(json.dumps(interleaved_step_times(args.seq_len, args.steps)))
        return
    if args.case:
        print(json.dumps(run_case(args.case, args.seq_len, args.steps, args.budget_mib)))
        return
    rows = activation_checkpointing_cases(args.seq_len, args.steps, args.budget_mib, args.max_seq_len)
    print_table(rows)

if __name__ == "__main__":
    main()
