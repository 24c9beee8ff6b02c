"""fp32, bf16 autocast and bf16 weights (fp32 masters) on the demo's model and data: loss curves and speed.

The three runs are built in this one process and trained interleaved, a chunk of steps each in turn, so their
tokens/s are comparable (a neighbour's job slows all alike); each writes its own metrics.jsonl, whose losses
give the curves. Same seed, data order and schedule: only the precision differs.

    python bench/precision.py [--steps 200] [--chunk 10] [--batch 8] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from treadle.config import load_config
from treadle.train.run import build_trainer, close_trainer

DTYPES = ("fp32", "bf16", "bf16-weights")


def trainer(args, dtype: str, out: Path):
    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo.toml", [
        f"--train.output_dir={out}", f"--train.max_steps={args.steps}", f"--train.micro_batch_size={args.batch}",
        f"--data.seq_len={args.seq_len}", f"--model.dtype={dtype}", "--model.compile=false", "--data.val=[]",
        "--checkpoint.export_hf=false", "--checkpoint.resume=none", "--checkpoint.every_minutes=0",
        f"--train.log_every={args.chunk}",
    ])
    t = build_trainer(cfg, live=False)
    t.console.enabled = False
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--chunk", type=int, default=10, help="steps per turn (and the logging interval)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    runs = {d: trainer(args, d, root / d) for d in DTYPES}
    rates: dict[str, list[float]] = {d: [] for d in DTYPES}
    tokens = args.chunk * args.batch * args.seq_len
    for start in range(0, args.steps, args.chunk):
        for d, t in runs.items():
            t.max_steps = min(start + args.chunk, args.steps)
            t0 = time.perf_counter()
            t.fit()
            if start:  # the first chunk holds first-call paths
                rates[d].append(tokens / (time.perf_counter() - t0))
    for t in runs.values():
        close_trainer(t)
    losses = {d: {r["step"]: r["loss"] for r in map(json.loads, (root / d / "metrics.jsonl").read_text().splitlines())
                  if "loss" in r} for d in DTYPES}
    print(f"# precision: {args.steps} steps, batch {args.batch} x {args.seq_len}, demo model and data, chunks of "
          f"{args.chunk} steps interleaved, torch {torch.__version__}, {torch.get_num_threads()} threads")
    logged = sorted(losses["fp32"])
    steps = sorted(set(logged[:: max(1, len(logged) // 5)] + [logged[-1]]))
    print("| dtype | tokens/s (median of chunks) | vs fp32 | " + " | ".join(f"loss at step {s}" for s in steps) + " |")
    print("|---|---|---|" + "---|" * len(steps))
    fp32 = statistics.median(rates["fp32"])
    for d in DTYPES:
        rate = statistics.median(rates[d])
        print(f"| {d} | {rate:,.0f} | {rate / fp32:.2f}x | " + " | ".join(f"{losses[d][s]:.3f}" for s in steps) + " |")
    worst = {d: max(abs(losses[d][s] - losses["fp32"][s]) for s in losses["fp32"]) for d in DTYPES[1:]}
    print("largest |loss - fp32 loss| over the logged steps: " + ", ".join(f"{d} {v:.3f}" for d, v in worst.items()))


if __name__ == "__main__":
    main()
