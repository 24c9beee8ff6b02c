"""Data-parallel engines at world size 1 and 2 on CPU: total tokens/s and what each rank holds.

Every engine (local, ddp, fsdp2, deepspeed ZeRO-1/2/3) trains the tiny Llama from
configs/demo.toml with the same GLOBAL batch (8 x 256 tokens: micro-batch 4, grad
accumulation 2 at world size 1 and 1 at world size 2) on the machine's 2 cores
(2 torch threads at world size 1, 1 per rank at world size 2). Each (engine, world
size) is its own launch: this script re-invokes itself under torchrun (a 1-rank
process group at world size 1, so ddp/fsdp2/deepspeed run there too); `local`, the
baseline, runs in a plain subprocess.

Throughput: `Trainer.fit()` first runs the warm-up steps, then once per timed step
(max_steps + 1 each time), timed between barriers; tokens/s = global tokens per step /
the median step time (rank 0), so that a burst of another job on the two cores moves
it less than a mean would. Only the metrics callback is kept: no eval, checkpoint or
export runs inside the timing.
Memory: `engine.memory_report()` is taken inside `clip_grad_norm` of the last warm-up
step: every backward of the step has run and the optimizer state exists since the
first step; `optimizer_step` frees the gradients right after (`zero_grad`), so no
callback could see them. It is a snapshot, not a peak: by then FSDP2 and ZeRO-1/2/3
have reduced the gradients into this rank's partition (ZeRO-1's full gradients during
the last backward are gone) and FSDP2 has resharded its root, which stays gathered
from forward to the end of backward. DDP's gradient buckets, which memory_report does
not see, are printed below the table. Per-rank figures are the largest over the
ranks; peak RSS is `ru_maxrss` at the end of the launch (imports included).

    python bench/scaling.py [--steps 8] [--warmup 3] [--engines local,ddp,fsdp2,zero1,zero2,zero3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("local", "ddp", "fsdp2", "zero1", "zero2", "zero3")
MIB = 2**20


def worker(args) -> None:
    """One rank of one launch: train, measure, write <results>/<engine>-ws<N>-rank<R>.json."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.errors import first_line
    from treadle.train.callbacks import MetricsCallback
    from treadle.train.run import build_trainer

    signal.alarm(args.timeout)  # a hung launch (a peer stuck in a collective) ends itself; SIGALRM kills
    rank, ws = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(args.worker)
    out = {"engine": args.worker, "ws": ws, "rank": rank}
    try:
        cfg = load_config(REPO / "configs/demo.toml", [
            f"--train.output_dir={Path(args.results) / f'{args.worker}-ws{ws}-run'}",  # one run dir for all ranks
            "--train.device=cpu", "--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=4",
            f"--train.grad_accum_steps={2 // ws}", f"--train.threads={2 // ws}",  # same global batch, same 2 cores
            f"--train.max_steps={args.warmup + args.steps}", f"--train.log_every={10**6}", "--schedule.warmup_proportion=0",
            "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none",
            f"--distributed.engine={'deepspeed' if stage else args.worker}", f"--distributed.zero_stage={stage or 0}",
            "--distributed.health_check_every=0", "--distributed.timeout_s=120",  # a dead peer fails, not hangs
        ])
        trainer = build_trainer(cfg, live=False)
        trainer.console.enabled = False
        trainer.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, MetricsCallback)]
        engine, report = trainer.engine, {}
        clip = engine.clip_grad_norm

        def clip_and_measure(max_norm):
            if trainer.state.step == args.warmup - 1:  # the last warm-up step (state.step counts finished ones)
                report.update(engine.memory_report())
            return clip(max_norm)

        engine.clip_grad_norm = clip_and_measure
        barrier = distributed.barrier  # a no-op without a process group (local)
        trainer.max_steps = args.warmup
        trainer.fit()
        walls = []
        for _ in range(args.steps):  # one step per fit(), between barriers: the slowest rank's time of each step
            barrier()
            t0 = time.perf_counter()
            trainer.max_steps += 1
            trainer.fit()
            barrier()
            walls.append(time.perf_counter() - t0)
        out.update(tokens_per_s=trainer.tokens_per_step / statistics.median(walls),
                   step_tokens_per_s=[trainer.tokens_per_step / w for w in walls],
                   threads=torch.get_num_threads(), memory=report,
                   peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if args.worker == "ddp":  # DDP's reducer buckets: a second copy of the gradients memory_report cannot see
            sizes = engine.model._get_ddp_logging_data()["bucket_sizes"]  # "b1, b2, ..." in bytes
            out["ddp_buckets"] = sum(int(b) for b in sizes.split(",") if b.strip())
        trainer.metrics.close()
        distributed.destroy()
    except Exception as exc:  # reported as one line in the table; the other engines go on
        out["error"] = f"{type(exc).__name__}: {first_line(exc)}"
    (Path(args.results) / f"{args.worker}-ws{ws}-rank{rank}.json").write_text(json.dumps(out))
    if "error" in out:
        sys.exit(1)


def launch(engine: str, ws: int, args, results: Path) -> dict:
    """Run one (engine, world size); return its row, or {"error": first line}."""
    flags = [str(Path(__file__).resolve()), "--worker", engine, "--results", str(results),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
    cmd = [sys.executable] + ([] if engine == "local" else
                              ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}"]) + flags
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:  # each worker ends itself at --timeout (SIGALRM): torchrun runs them in sessions of their own
        log, _ = proc.communicate(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:  # torchrun itself hangs
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    timed_out = time.perf_counter() - t0 >= args.timeout
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob(f"{engine}-ws{ws}-rank*.json"))]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or proc.returncode or len(ranks) != ws:
        if timed_out:  # whatever the ranks wrote is the alarm's consequence (a peer gone), not the cause
            errors = [f"timed out after {args.timeout}s"]
        elif not errors:  # died before it could write: the first exception line of its output (not torchrun's)
            lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
            errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)
                      and "ChildFailedError" not in ln][:1] or lines[-1:] or ["?"]
        return {"error": errors[0][:160]}
    mem = {k: max(r["memory"].get(k, 0) for r in ranks) for k in ("params", "grads", "optim")}
    mem["state"] = max(sum(r["memory"].get(k, 0) for k in ("params", "grads", "optim")) for r in ranks)
    keep = ("tokens_per_s", "step_tokens_per_s", "threads", "ddp_buckets")  # rank 0's: the same on every rank
    return {**{k: v for k, v in ranks[0].items() if k in keep}, "memory": mem,
            "peak_rss": max(r["peak_rss"] for r in ranks)}


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2: optimizer state exists)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.warmup < 2:
        p.error("--warmup must be >= 2 (memory is measured on the last warm-up step, after the first update)")
    if args.worker:
        return worker(args)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; accepted: {','.join(ENGINES)}")

    rows = {}
    with tempfile.TemporaryDirectory(prefix="treadle-scaling-") as results:
        for engine in engines:
            for ws in (1,) if engine == "local" else (1, 2):
                t0 = time.perf_counter()
                rows[engine, ws] = launch(engine, ws, args, Path(results))
                print(f"  {engine} ws{ws}: {time.perf_counter() - t0:.0f}s {rows[engine, ws].get('error', 'ok')}",
                      file=sys.stderr)

    base = rows.get(("local", 1), {}).get("tokens_per_s")
    print(f"# scaling: tiny Llama, global batch 8 x 256 tokens, fp32, {args.warmup} warm-up + {args.steps} timed steps; "
          f"{machine()}; 2 threads at ws 1, 1 per rank at ws 2")
    print("| engine | ws | tokens/s total: median step (min-max) | vs local | ws2/ws1 tokens/s | params MiB/rank | "
          "grads MiB/rank | optim MiB/rank | state total MiB/rank | ws2/ws1 state | peak RSS MiB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (engine, ws), row in rows.items():
        if "error" in row:
            print(f"| {engine} | {ws} | FAILED: {row['error']} | | | | | | | | |")
            continue
        one = rows.get((engine, 1), {"error": ""}) if ws == 2 else {"error": ""}  # ws2/ws1 only on ws 2 rows
        speed = "" if "error" in one else f"{row['tokens_per_s'] / one['tokens_per_s']:.3f}x"
        state = "" if "error" in one else f"{row['memory']['state'] / one['memory']['state']:.3f}x"
        vs_local = f"{row['tokens_per_s'] / base:.3f}x" if base else ""
        m = {k: f"{v / MIB:.2f}" for k, v in row["memory"].items()}
        steps = row["step_tokens_per_s"]
        print(f"| {engine} | {ws} | {row['tokens_per_s']:,.0f} ({min(steps):,.0f}-{max(steps):,.0f}) | {vs_local} | "
              f"{speed} | {m['params']} | {m['grads']} | {m['optim']} | {m['state']} | {state} | "
              f"{row['peak_rss'] / MIB:,.0f} |")
    for (engine, ws), row in rows.items():
        if "ddp_buckets" in row:
            print(f"- ddp ws{ws}: DDP's gradient buckets hold another {row['ddp_buckets'] / MIB:.2f} MiB/rank "
                  "(gradient_as_bucket_view is off), not in the grads column")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "steps": args.steps, "warmup": args.warmup,
                                               "rows": [{"engine": e, "ws": w, **r} for (e, w), r in rows.items()]},
                                              indent=1))


if __name__ == "__main__":
    main()
