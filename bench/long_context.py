"""Long sequences across ranks on CPU: per-rank memory and tokens/s at context parallelism 1 and 2.

One sequence of ``--seq-len`` tokens per step (default 8192; the built-in corpus, packed: documents end and
start inside it, so the packed-causal mask is in use) trains the tiny Llama preset (4 layers, hidden 256,
4 heads; its positions raised to the sequence length). CP = 1 is one rank with both cores' threads; CP = 2 is
two ranks, one thread each, every rank holding half of the sequence (``distributed.context_parallel = 2``).
Both run FSDP2 under torchrun (a 1-rank group at CP = 1), so the engine is the same and only the split differs:
this script re-invokes itself under torchrun per launch.

Memory per rank: ``before`` is the resident set after the run is built (imports, model, optimizer, data maps),
``peak`` is ``ru_maxrss`` at the end (the high-water mark of the whole launch), and ``step`` = peak - before,
what the training steps added: activations, the attention mask, gradients and optimizer state (the last two are
sharded over ranks by FSDP2, and small for this model). Activations scale with the tokens a rank holds; the
mask (``[T, T]`` booleans per row, every rank builds it whole, since after the all-to-all every rank attends
over all ``T`` positions for its heads) does not.
Throughput: tokens per step / the median step time of ``--steps`` timed steps after ``--warmup`` (between
barriers, rank 0's clock).

    python bench/long_context.py [--seq-len 8192] [--steps 2] [--warmup 1] [--cp 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaling import machine  # bench/ is the script's own directory: on sys.path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def rss() -> int:
    """This process's resident set now, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> None:
    """One rank of one launch: build, train, measure, write <results>/cp<N>-rank<R>.json."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.train.callbacks import MetricsCallback
    from treadle.train.run import build_trainer

    signal.alarm(args.timeout)  # a hung launch (a peer stuck in a collective) ends itself
    rank, ws = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(REPO / "configs/demo.toml", [
        f"--train.output_dir={Path(args.results) / f'cp{ws}-run'}", "--train.device=cpu",
        f"--model.overrides={{max_position_embeddings={args.seq_len}}}", f"--data.seq_len={args.seq_len}",
        "--train.micro_batch_size=1", "--train.grad_accum_steps=1", f"--train.threads={2 // ws}",
        f"--train.max_steps={args.warmup + args.steps}", f"--train.log_every={10**6}",
        "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none", "--distributed.engine=fsdp2",
        f"--distributed.context_parallel={ws}", "--distributed.health_check_every=0",
    ])
    trainer = build_trainer(cfg, live=False)
    trainer.console.enabled = False
    trainer.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, MetricsCallback)]
    before = rss()
    trainer.max_steps = args.warmup
    trainer.fit()
    walls = []
    for _ in range(args.steps):  # one step per fit(), between barriers: the slowest rank's time of each step
        distributed.barrier()
        t0 = time.perf_counter()
        trainer.max_steps += 1
        trainer.fit()
        distributed.barrier()
        walls.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"cp": ws, "rank": rank, "tokens_per_s": trainer.tokens_per_step / statistics.median(walls),
           "step_s": walls, "before": before, "peak": peak, "threads": torch.get_num_threads()}
    trainer.metrics.close()
    distributed.destroy()
    (Path(args.results) / f"cp{ws}-rank{rank}.json").write_text(json.dumps(out))


def launch(cp: int, args, results: Path) -> dict:
    flags = [str(Path(__file__).resolve()), "--worker", "--results", str(results), "--seq-len", str(args.seq_len),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", *flags]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=args.timeout + 60)
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob(f"cp{cp}-rank*.json"))]
    if proc.returncode or len(ranks) != cp:
        lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines()
                 if re.match(r"^[\w.]+(Error|Exception)\b", ln.strip()) and "ChildFailedError" not in ln]
        return {"error": (lines[0] if lines else f"exit {proc.returncode}")[:160]}
    return {"tokens_per_s": ranks[0]["tokens_per_s"], "step_s": ranks[0]["step_s"], "threads": ranks[0]["threads"],
            **{k: max(r[k] for r in ranks) for k in ("before", "peak")},
            "step": max(r["peak"] - r["before"] for r in ranks)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (one sequence per step)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--cp", default="1,2", help="context-parallel sizes to run (each its own launch)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    rows = {}
    with tempfile.TemporaryDirectory(prefix="treadle-long-") as results:
        for cp in (int(c) for c in args.cp.split(",")):
            t0 = time.perf_counter()
            rows[cp] = launch(cp, args, Path(results))
            print(f"  cp{cp}: {time.perf_counter() - t0:.0f}s {rows[cp].get('error', 'ok')}", file=sys.stderr)

    print(f"# context parallelism: tiny Llama, one packed sequence of {args.seq_len} tokens per step, fp32, FSDP2, "
          f"{args.warmup} warm-up + {args.steps} timed steps; {machine()}; 2 threads at CP 1, 1 per rank at CP 2")
    print("| CP | tokens/rank | tokens/s (median step) | step s | RSS before MiB/rank | peak RSS MiB/rank | "
          "step peak - before MiB/rank | vs CP 1 |")
    print("|---|---|---|---|---|---|---|---|")
    base = rows.get(1, {}).get("step")
    for cp, row in rows.items():
        if "error" in row:
            print(f"| {cp} | FAILED: {row['error']} | | | | | | |")
            continue
        ratio = f"{row['step'] / base:.2f}x" if base else ""
        print(f"| {cp} | {args.seq_len // cp} | {row['tokens_per_s']:,.0f} | {statistics.median(row['step_s']):.1f} | "
              f"{row['before'] / MIB:,.0f} | {row['peak'] / MIB:,.0f} | {row['step'] / MIB:,.0f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "seq_len": args.seq_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
