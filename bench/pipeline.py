"""Pipeline parallelism on CPU: 2 stages (gloo) against one process, per schedule.

A Llama of 8 decoder layers (hidden 256, vocab 512) trains on random packed batches of GA micro-batches of
2 x 256 tokens, through ``optimizer_step`` (the loop's own step) on ``LocalEngine`` (one process) and on
``PipelineEngine`` at pipeline_parallel = 2 (gpipe, 1f1b, interleaved_1f1b = 4 stages on 2 ranks), one torch
thread per rank. Each configuration is its own launch (this script re-invokes itself under torchrun).

Figures: tokens/s from the median step time (rank 0); peak RSS per rank (``ru_maxrss`` at the end, imports
included) and the parameter + gradient + optimizer bytes each rank holds (``memory_report`` during the last
step's clip); and the overhead of the pipeline over a perfect split, ``T_pp / (T_1 / 2) - 1`` with T_1 the
one-process step at one thread: the bubble (a stage idles while the pipeline fills and drains) plus the
activations sent between ranks. The bubble alone, in theory, is (p-1)/(m+p-1) of the step for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved (v = 2 stages per rank).

    python bench/pipeline.py [--ga 4,8] [--steps 5] [--warmup 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MIB = 2**20
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=4, use_cache=False, tie_word_embeddings=False)
MB, SEQ = 2, 256


def batches(step: int, ga: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, MODEL["vocab_size"], (ga * MB, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).repeat(ga * MB, 1)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": pos}
    return [{k: v[m * MB:(m + 1) * MB] for k, v in batch.items()} for m in range(ga)]


def worker(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from treadle.engine.local import LocalEngine
    from treadle.engine.optim import param_groups
    from treadle.train.step import optimizer_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    optimizer = lambda m: torch.optim.AdamW(param_groups(m, 0.1, False, False), lr=1e-3)  # noqa: E731
    cpu = torch.device("cpu")
    if args.schedule == "local":
        engine, rank = LocalEngine(model, optimizer(model), cpu), 0
    else:
        from treadle import distributed
        from treadle.engine.pipeline import PipelineEngine

        distributed.init_distributed("cpu", num_threads=args.threads)
        engine = PipelineEngine(model, optimizer, cpu, pipeline_parallel=2, schedule=args.schedule,
                                micro_batches=args.ga_one, autocast=contextlib.nullcontext)
        rank = engine.rank
    report = {}
    clip = engine.clip_grad_norm

    def clip_and_measure(max_norm):
        report.update(engine.memory_report())
        return clip(max_norm)

    engine.clip_grad_norm = clip_and_measure
    times = []
    for step in range(args.warmup + args.steps):
        if args.schedule != "local":
            torch.distributed.barrier()
        t0 = time.perf_counter()
        optimizer_step(engine, batches(step, args.ga_one), grad_clip=1.0)
        times.append(time.perf_counter() - t0)
    row = {"rank": rank, "step_s": statistics.median(times[args.warmup:]),
           "state": report["params"] + report["grads"] + report["optim"],
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(args.out, f"{args.schedule}-{args.threads}-{args.ga_one}-rank{rank}.json").write_text(json.dumps(row))
    if args.schedule != "local":
        torch.distributed.destroy_process_group()


def launch(schedule: str, threads: int, ga: int, args, out: str) -> list[dict]:
    common = ["--worker", "--schedule", schedule, "--threads", str(threads), "--ga-one", str(ga), "--out", out,
              "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(threads)}
    if schedule == "local":
        cmd = [sys.executable, __file__, *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), __file__, *common]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ranks = sorted(Path(out).glob(f"{schedule}-{threads}-{ga}-rank*.json"))
    return [json.loads(p.read_text()) for p in ranks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--schedule", default="local")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ga-one", type=int, default=4)
    p.add_argument("--out")
    p.add_argument("--ga", default="4,8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for ga in (int(g) for g in args.ga.split(",")):
            one = launch("local", 1, ga, args, out)[0]
            two = launch("local", 2, ga, args, out)[0]
            rows.append(dict(config=f"1 process, 1 thread", ga=ga, ranks=[one], ideal=None, bubble=None))
            rows.append(dict(config=f"1 process, 2 threads", ga=ga, ranks=[two], ideal=None, bubble=None))
            for schedule in SCHEDULES:
                ranks = launch(schedule, 1, ga, args, out)
                v = 2 if schedule == "interleaved_1f1b" else 1
                rows.append(dict(config=f"PP=2 {schedule}", ga=ga, ranks=ranks, ideal=one["step_s"] / 2,
                                 bubble=1 / (v * ga + 1)))
    tokens = lambda r: r["ga"] * MB * SEQ  # noqa: E731
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{MODEL['num_hidden_layers']} layers x hidden {MODEL['hidden_size']}, micro-batch {MB} x {SEQ} tokens\n")
    print("| configuration | GA | tokens/s | step s | overhead over a perfect 2-way split | theoretical bubble | "
          "state MiB/rank | peak RSS MiB/rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        step = r["ranks"][0]["step_s"]
        over = f"{step / r['ideal'] - 1:+.0%}" if r["ideal"] else ""
        bubble = f"{r['bubble']:.0%}" if r["bubble"] is not None else ""
        state = " / ".join(f"{x['state'] / MIB:.1f}" for x in r["ranks"])
        rss = " / ".join(f"{x['peak_rss'] / MIB:,.0f}" for x in r["ranks"])
        print(f"| {r['config']} | {r['ga']} | {tokens(r) / step:,.0f} | {step:.3f} | {over} | {bubble} | {state} | {rss} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
