"""treadle's loop against a bare hand-written PyTorch loop: same model, data and steps.

Throughput: both loops run in this one process, interleaved round by round
(bare, treadle, bare, treadle, ...) so that drift of the machine hits both alike;
the table reports the median round. Peak memory: each loop runs alone in a
child process (peak RSS is a high-water mark, so it cannot be interleaved).

    python bench/overhead.py [--steps 10] [--rounds 5] [--dtype fp32|bf16]

Target (issue 2): treadle >= 0.97x the bare loop's tokens/s, <= 1.05x its peak memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from treadle import corpus
from treadle.config import load_config
from treadle.data.builtin import builtin_shards
from treadle.data.mixture import SampleOrder
from treadle.data.packed import PackedDataset
from treadle.models.hf import build_model
from treadle.train.run import build_trainer


def config(args, out):
    return load_config(None, [
        f"--train.output_dir={out}", f"--train.micro_batch_size={args.batch}", f"--data.seq_len={args.seq_len}",
        f"--model.dtype={args.dtype}", "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none",
        f"--train.max_steps={10**6}", "--train.log_every=10", "--train.threads=2", "--schedule.warmup_steps=10",
    ])


class Bare:
    """What a person writes by hand: sample, forward, mean CE, backward, clip, step."""

    def __init__(self, args):
        torch.manual_seed(0)
        tok_dir = corpus.builtin_tokenizer_dir()
        self.data = PackedDataset([builtin_shards("train", tok_dir)], args.seq_len)
        self.order = SampleOrder(len(self.data), seed=0)
        self.model = build_model(load_config().model, self.data.vocab_size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.batch, self.pos, self.bf16 = args.batch, 0, args.dtype == "bf16"

    def steps(self, n: int) -> None:
        for _ in range(n):
            idx = self.order.indices(self.pos, self.batch)
            self.pos += self.batch
            items = [self.data[int(i)] for i in idx]
            batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


class Treadle:
    def __init__(self, args, out):
        self.trainer = build_trainer(config(args, out), live=False)
        self.trainer.console.enabled = False  # measure the loop, not the terminal
        self.trainer.callbacks = [cb for cb in self.trainer.callbacks if type(cb).__name__ == "MetricsCallback"]

    def steps(self, n: int) -> None:
        self.trainer.max_steps = self.trainer.state.step + n
        self.trainer.fit()


def timed(runner, steps: int) -> float:
    t0 = time.perf_counter()
    runner.steps(steps)
    return time.perf_counter() - t0


def child(args) -> None:
    """Run one loop alone and report its peak RSS."""
    import tempfile

    torch.set_num_threads(2)
    runner = Bare(args) if args.child == "bare" else Treadle(args, tempfile.mkdtemp())
    runner.steps(args.steps * 2)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--child", choices=["bare", "treadle"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    import tempfile

    torch.set_num_threads(2)
    bare, tread = Bare(args), Treadle(args, tempfile.mkdtemp())
    tokens = args.steps * args.batch * args.seq_len
    timed(bare, 2), timed(tread, 2)  # warm-up: allocator, first-call paths
    rates = {"bare": [], "treadle": []}
    for _ in range(args.rounds):
        rates["bare"].append(tokens / timed(bare, args.steps))
        rates["treadle"].append(tokens / timed(tread, args.steps))
    del bare, tread

    mem = {}
    for name in ("bare", "treadle"):
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--dtype", args.dtype]
        mem[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])["peak_rss_mb"]

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"# overhead: {args.rounds} interleaved rounds x {args.steps} steps, batch {args.batch} x {args.seq_len}, "
          f"{args.dtype}, tiny Llama, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print("| loop | tokens/s (median) | tokens/s (min-max) | peak RSS MiB |")
    print("|---|---|---|---|")
    for k in ("bare", "treadle"):
        print(f"| {k} | {med[k]:,.0f} | {min(rates[k]):,.0f}-{max(rates[k]):,.0f} | {mem[k]:,.0f} |")
    print(f"| treadle / bare | {med['treadle'] / med['bare']:.3f}x | | {mem['treadle'] / mem['bare']:.3f}x |")


if __name__ == "__main__":
    main()
