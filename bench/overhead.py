"""treadle's loop against a bare hand-written PyTorch loop and against Hugging Face's Trainer: same model, data and
steps.

Throughput: every loop runs in this one process, interleaved round by round (bare, treadle, HF Trainer, ...) so
that drift of the machine, or a neighbour's job, hits all alike; the table reports the median round. The HF
Trainer runs in a thread of its own, handed the turn for a round's steps by a callback (no re-initialisation
between rounds). Loops compared:

- identical settings, fp32 and bf16 autocast: treadle and the Trainer with the same model, batch, lr, betas,
  weight decay, warmup, cosine decay, clip 1.0, fused AdamW;
- each one's defaults: ``treadle train``'s (model.dtype and model.compile = auto) against ``TrainingArguments``'
  (fp32) on the same device, model, data and batch; only what a run needs is set (output directory, steps,
  batch) plus progress bars off on both (the loop is measured, not the terminal).

Peak memory: bare and treadle each run alone in a child process (peak RSS is a high-water mark, so it cannot be
interleaved). The HF columns need ``accelerate`` (the Trainer's requirement; ``pip install -e .[bench]``).

    python bench/overhead.py [--steps 10] [--rounds 5] [--dtype fp32|bf16] [--no-memory]

Targets: treadle >= 0.97x the bare loop's tokens/s, <= 1.05x its peak memory (issue 2); >= 1.0x the HF Trainer at
identical settings, >= 1.5x at defaults where bf16 is fast on the machine, never slower than fp32 where not (issue 18).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from treadle import corpus
from treadle.config import load_config
from treadle.data.builtin import builtin_shards
from treadle.data.mixture import SampleOrder
from treadle.data.packed import PackedDataset
from treadle.models.autotune import cpu_flags
from treadle.models.hf import build_model
from treadle.train.run import build_trainer

LR, BETAS, WEIGHT_DECAY, WARMUP = 1e-3, (0.9, 0.95), 0.1, 10  # the identical settings (bare, treadle, HF Trainer)


def total_steps(args) -> int:
    """Steps each loop runs: two warm-up, the rounds, and one spare (the HF Trainer must not finish)."""
    return 2 + args.rounds * args.steps + 1


def warmup(args) -> int:
    return min(WARMUP, total_steps(args) // 2)


def config(args, out, dtype: str | None):
    """treadle's config: the identical settings at ``dtype``, or (None) treadle's defaults for everything but the
    run's size and where it writes."""
    size = [f"--train.output_dir={out}", f"--train.micro_batch_size={args.batch}", f"--data.seq_len={args.seq_len}",
            f"--train.max_steps={total_steps(args)}", "--data.val=[]", "--checkpoint.export_hf=false",
            "--checkpoint.resume=none", "--checkpoint.every_minutes=0"]
    if dtype is None:
        return load_config(None, size)
    return load_config(None, size + [
        f"--model.dtype={dtype}", "--model.compile=false", "--train.log_every=10", "--train.threads=2",
        f"--schedule.warmup_steps={warmup(args)}", f"--optim.lr={LR}", f"--optim.betas={list(BETAS)}",
        f"--optim.weight_decay={WEIGHT_DECAY}",
    ])


class Bare:
    """What a person writes by hand: sample, forward, mean CE, backward, clip, step."""

    def __init__(self, args):
        torch.manual_seed(0)
        tok_dir = corpus.builtin_tokenizer_dir()
        self.data = PackedDataset([builtin_shards("train", tok_dir)], args.seq_len)
        self.order = SampleOrder(len(self.data), seed=0)
        self.model = build_model(load_config().model, self.data.vocab_size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
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
    def __init__(self, args, out, dtype: str | None):
        self.trainer = build_trainer(config(args, out, dtype), live=False)
        self.trainer.console.enabled = False  # measure the loop, not the terminal
        self.trainer.callbacks = [cb for cb in self.trainer.callbacks if type(cb).__name__ == "MetricsCallback"]
        self.dtype = self.trainer.cfg.model.dtype  # auto resolved
        self.compile = self.trainer.cfg.model.compile

    def steps(self, n: int) -> None:
        self.trainer.max_steps = self.trainer.state.step + n
        self.trainer.fit()


class Rows(torch.utils.data.Dataset):
    """The built-in corpus's samples in the bare loop's order, as the HF Trainer takes them (labels = the inputs:
    HF models shift them themselves)."""

    def __init__(self, args):
        self.data = PackedDataset([builtin_shards("train", corpus.builtin_tokenizer_dir())], args.seq_len)
        self.order = SampleOrder(len(self.data), seed=0).indices(0, total_steps(args) * args.batch)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        item = self.data[int(self.order[i])]
        return {"input_ids": item["input_ids"], "position_ids": item["position_ids"], "labels": item["input_ids"]}


class HFTrainer:
    """transformers.Trainer at the identical settings (``dtype`` fp32 / bf16) or at its defaults (None), run in a
    thread that a callback pauses after each round's steps."""

    def __init__(self, args, out, dtype: str | None):
        from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

        torch.manual_seed(0)
        rows = Rows(args)
        model = build_model(load_config().model, rows.data.vocab_size)
        needed = dict(output_dir=out, max_steps=total_steps(args), per_device_train_batch_size=args.batch,
                      save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available())
        identical = dict(bf16=dtype == "bf16", learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                         weight_decay=WEIGHT_DECAY, warmup_steps=warmup(args), lr_scheduler_type="cosine",
                         max_grad_norm=1.0, optim="adamw_torch_fused", logging_steps=10)
        targs = TrainingArguments(**needed, **(identical if dtype else {}))
        self.dtype = dtype or ("bf16" if targs.bf16 else "fp32")
        self.todo, self.go, self.done = 0, threading.Semaphore(0), threading.Semaphore(0)
        runner = self

        class Baton(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                runner.todo -= 1
                if runner.todo == 0:  # the round is over: hand the turn back and wait for the next
                    runner.done.release()
                    runner.go.acquire()

        self.trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=default_data_collator,
                               callbacks=[Baton()])
        self.thread = threading.Thread(target=self._train, daemon=True)  # left waiting at the end

    def _train(self) -> None:
        torch.set_num_threads(2)
        self.go.acquire()
        self.trainer.train()

    def steps(self, n: int) -> None:
        self.todo = n
        if not self.thread.is_alive():
            self.thread.start()
        self.go.release()
        self.done.acquire()


def timed(runner, steps: int) -> float:
    t0 = time.perf_counter()
    runner.steps(steps)
    return time.perf_counter() - t0


def child(args) -> None:
    """Run one loop alone and report its peak RSS."""
    import tempfile

    torch.set_num_threads(2)
    runner = Bare(args) if args.child == "bare" else Treadle(args, tempfile.mkdtemp(), args.dtype)
    runner.steps(args.steps * 2)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def hf_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:  # the Trainer refuses to start without it
        print("# the HF Trainer columns need accelerate (pip install -e .[bench]); measuring bare and treadle only")
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of the bare loop and the memory check")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--child", choices=["bare", "treadle"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    import tempfile

    torch.set_num_threads(2)
    loops = {"bare": Bare(args), f"treadle {args.dtype}": Treadle(args, tempfile.mkdtemp(), args.dtype)}
    if hf_available():
        for dtype in ("fp32", "bf16"):
            loops.setdefault(f"treadle {dtype}", Treadle(args, tempfile.mkdtemp(), dtype))
            loops[f"HF Trainer {dtype}"] = HFTrainer(args, tempfile.mkdtemp(), dtype)
        loops["treadle defaults"] = Treadle(args, tempfile.mkdtemp(), None)
        loops["HF Trainer defaults"] = HFTrainer(args, tempfile.mkdtemp(), None)
    tokens = args.steps * args.batch * args.seq_len
    for runner in loops.values():  # warm-up: allocator, first-call paths, the Trainer's set-up
        timed(runner, 2)
    rates = {k: [] for k in loops}
    for _ in range(args.rounds):
        for k, runner in loops.items():
            rates[k].append(tokens / timed(runner, args.steps))
    described = {k: f"{getattr(r, 'dtype', args.dtype)}" + (", compile" if getattr(r, "compile", False) is True else "")
                 for k, r in loops.items()}
    loops.clear()

    mem = {}
    if not args.no_memory:
        for name in ("bare", "treadle"):
            cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--batch", str(args.batch),
                   "--seq-len", str(args.seq_len), "--dtype", args.dtype]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            mem[name] = json.loads(out)["peak_rss_mb"]

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"# overhead: {args.rounds} interleaved rounds x {args.steps} steps, batch {args.batch} x {args.seq_len}, "
          f"tiny Llama, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, os.cpu_count() {os.cpu_count()}")
    print(f"# CPU flags (bf16-related): {' '.join(cpu_flags()) or 'none'}")
    print("| loop | dtype | tokens/s (median) | tokens/s (min-max) |")
    print("|---|---|---|---|")
    for k in rates:
        print(f"| {k} | {described[k]} | {med[k]:,.0f} | {min(rates[k]):,.0f}-{max(rates[k]):,.0f} |")
    ratios = [(f"treadle {args.dtype} / bare", f"treadle {args.dtype}", "bare"),
              ("treadle / HF Trainer, fp32 (identical settings)", "treadle fp32", "HF Trainer fp32"),
              ("treadle / HF Trainer, bf16 autocast (identical settings)", "treadle bf16", "HF Trainer bf16"),
              ("treadle defaults / HF Trainer defaults", "treadle defaults", "HF Trainer defaults"),
              ("treadle defaults / treadle fp32", "treadle defaults", "treadle fp32")]
    print("| ratio of medians | |")
    print("|---|---|")
    for label, a, b in ratios:
        if a in med and b in med:
            print(f"| {label} | {med[a] / med[b]:.3f}x |")
    if mem:
        print(f"| peak RSS MiB, bare / treadle {args.dtype} | {mem['bare']:,.0f} / {mem['treadle']:,.0f} "
              f"({mem['treadle'] / mem['bare']:.3f}x) |")


if __name__ == "__main__":
    main()
