"""Issue 40's side-by-side (bench/gpu.py's `side-by-side` items): one training loop per process, the same model,
packed rows, batch, steps and timer for all.

Loops, each a child process of its own (bench/gpu.py runs them):

- treadle: ``treadle train bench/side_by_side.toml`` (the command a user types; that file only adds ``StepTimer``
  below as a ``[[callbacks]]`` entry); bench/gpu.py builds its command lines (defaults, best settings).
- ``python bench/gpu_loops.py hf [--compile]``: transformers' ``Trainer`` with ``bf16=True`` (and
  ``torch_compile=True``), fused AdamW, fed the same packed rows with their ``position_ids`` (documents restart
  there; the labels of each document's first token are -100, as ``DataCollatorWithFlattening`` makes them).
- ``python bench/gpu_loops.py bare``: a hand-written loop over the same rows: bf16 autocast, each decoder layer
  ``.compile()``d, mean cross-entropy, clip, fused AdamW.

The timer is the same for all: wall clock, synchronized with the device, over a run's last ``TIMED`` steps (16-40
of 40; the first steps hold compiles and warm-up), and the peak memory at that last step
(``torch.cuda.max_memory_allocated`` over the process; on a CPU its peak RSS). MFU uses treadle's formula
(metrics/flops.py: 6N + causal attention over the row, the device's bf16 peak) for every loop. Each child writes
one JSON file; on a CPU (bench/gpu.py ``--device cpu --tiny``) compile is skipped and MFU is empty.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from treadle.train.callbacks import Callback


TIMED = 25  # the last 25 steps of a run are timed: steps 16-40 of 40 (issue 40's setup); at least step 1 is not
RESULT = "step_timer.json"  # written into the loop's output directory


class Timer:
    """Steps counted from 1, marked at their end: the clock runs from the end of step ``first - 1`` to the end of
    step ``last`` (the run's last; first = the TIMED-th step before it, never step 1); the figures are written to
    ``<out_dir>/step_timer.json`` at ``last``."""

    def __init__(self, out_dir: str, last: int, tokens_per_step: int, device: torch.device):
        if last < 2:
            raise ValueError(f"a run of {last} step(s); accepted: 2 or more (the first step starts the clock)")
        self.out, self.first, self.last = Path(out_dir) / RESULT, max(2, last - TIMED + 1), last
        self.tokens_per_step, self.device = tokens_per_step, device
        self.start: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step_end(self, step: int, model: torch.nn.Module, seq_len: int, logged_peak_gib: float = 0.0,
                 **extra) -> bool:
        """Mark the end of ``step``; True once the figures are written (step ``last``). ``logged_peak_gib``: the
        highest peak a loop's own metrics saw (treadle resets CUDA's peak at every log step)."""
        if step == self.first - 1:
            self.start = self._now()
        if step != self.last:
            return False
        seconds = self._now() - self.start
        tokens_per_s = (self.last - self.first + 1) * self.tokens_per_step / seconds
        peak = peak_memory(self.device)
        peak["peak_gib"] = max(peak["peak_gib"], logged_peak_gib)
        self.out.write_text(json.dumps({"tokens_per_s": tokens_per_s, "seconds": seconds, "steps": [self.first, self.last],
                                        **peak, **utilization(model, seq_len, tokens_per_s, self.device),
                                        "torch": torch.__version__, **extra}) + "\n")
        return True


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_gib": torch.cuda.max_memory_allocated(device) / 2**30, "peak_kind": "alloc"}
    from treadle.metrics.flops import memory_window

    return {"peak_gib": memory_window(device)["peak_rss_gib"], "peak_kind": "RSS"}


def utilization(model: torch.nn.Module, seq_len: int, tokens_per_s: float, device: torch.device) -> dict:
    """MFU by treadle's formula, the same for every loop (no peak known, as on a CPU: none)."""
    from treadle.metrics.flops import attention_dims, matmul_parameters, peak_tflops, train_flops_per_token

    flops = train_flops_per_token(matmul_parameters(model), *attention_dims(model.config), seq_len)
    peak = peak_tflops(device, "bf16", None)  # every loop trains under bf16 autocast
    return {"mfu": tokens_per_s * flops / (peak * 1e12) if peak else None}


class StepTimer(Callback):
    """The timer in ``treadle train`` (a ``[[callbacks]]`` entry). Once it has written its figures the process ends:
    the run's final checkpoint and export (12 GiB at 1.1B) are not what is measured, and would cost device time."""

    def __init__(self):
        self.timer: Timer | None = None
        self.peak = 0.0  # the highest peak the run's log windows recorded so far (GiB)

    def on_train_start(self, trainer) -> None:
        from treadle.models.chunked_ce import chunked_head

        self.timer = Timer(trainer.cfg.train.output_dir, trainer.max_steps, trainer.tokens_per_step,
                           trainer.engine.device)
        cfg, model = trainer.cfg.model, trainer.engine.module
        self.settings = (f"dtype {cfg.dtype}, compile {cfg.compile} (auto resolved), attention "
                         f"{model.config._attn_implementation}, chunked loss {'on' if chunked_head(model) else 'off'}")

    def on_step_end(self, trainer, result) -> None:
        if self.timer.step_end(trainer.state.step, trainer.engine.module, trainer.cfg.data.seq_len,
                               logged_peak_gib=self.logged_peak(trainer), settings=self.settings):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def logged_peak(self, trainer) -> float:
        """The run's peak so far as its metrics logged it: each log step records CUDA's peak since the last one and
        resets it, so the Timer alone would see only what was allocated after the last log (the third GPU run read
        a 1.1B full-training peak of 12.4 GiB, its weights and optimizer state at rest, for this reason)."""
        logged = trainer.last_records.get("step", {}).get("memory_allocated_gib", 0.0)
        self.peak = max(self.peak, logged)
        return self.peak


class ProfileWindow:
    """torch.profiler over one step of the Trainer's or the bare loop (treadle's own: ``[profile]``), before the
    timed steps, its Chrome trace written to ``<out>/profile/trace.json`` (bench/trace_summary.py reads it)."""

    def __init__(self, step: int | None, out: str):
        self.step, self.out, self.prof = step, Path(out) / "profile", None

    def begin(self, step: int) -> None:
        if step == self.step:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()

    def end(self, step: int) -> None:
        if self.prof is not None and step == self.step:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out / "trace.json"))
            self.prof = None


# --------------------------------------------------------------------------- the other loops' data and model


def packed_rows(seq_len: int):
    """The built-in corpus packed as treadle packs it (data/packed.py)."""
    from treadle import corpus
    from treadle.data.builtin import builtin_shards
    from treadle.data.packed import PackedDataset

    return PackedDataset([builtin_shards("train", corpus.builtin_tokenizer_dir())], seq_len)


class HFRows(torch.utils.data.Dataset):
    """The same rows for the Trainer: HF models shift the labels themselves, so labels = the inputs, with each
    document's first token -100 (no loss across a boundary), as DataCollatorWithFlattening writes them."""

    def __init__(self, seq_len: int, count: int):
        self.data, self.count = packed_rows(seq_len), count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        row = self.data[i % len(self.data)]
        labels = row["input_ids"].clone()
        labels[row["position_ids"] == 0] = -100
        return {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "labels": labels}


def build(args, vocab: int) -> torch.nn.Module:
    """The model every loop trains (treadle's builder: the same init, use_cache off for packed rows)."""
    from treadle.config import ModelConfig
    from treadle.models.hf import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(overrides=json.loads(args.overrides)), vocab)


def hf_loop(args, device: torch.device) -> None:
    if importlib.util.find_spec("accelerate") is None:  # the Trainer's requirement: one line, not its traceback
        raise SystemExit(f"hf: transformers' Trainer needs accelerate, which {sys.executable} lacks; install "
                         "'accelerate>=1.2' (pyproject's [bench] extra; the GPU image has its own)")
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    rows = HFRows(args.seq, args.steps * args.batch)
    model = build(args, rows.data.vocab_size)
    compiled = args.compile and device.type == "cuda"  # compile skipped on a CPU (toy run: the plan's test)
    timer = Timer(args.out, args.steps, args.batch * args.seq, device)
    settings = f"transformers {transformers.__version__}, bf16=True, torch_compile={compiled}, adamw_torch_fused, " \
               f"attention {model.config._attn_implementation}"

    window = ProfileWindow(args.profile_step, args.out)

    class Mark(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            window.begin(state.global_step + 1)

        def on_step_end(self, targs, state, control, **kwargs):
            window.end(state.global_step)
            timer.step_end(state.global_step, model, args.seq, settings=settings)

    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps,
                              per_device_train_batch_size=args.batch, bf16=True, torch_compile=compiled,
                              optim="adamw_torch_fused", learning_rate=3e-4, max_grad_norm=1.0, save_strategy="no",
                              report_to="none", disable_tqdm=True, logging_steps=10, use_cpu=device.type != "cuda")
    Trainer(model=model, args=targs, train_dataset=rows, data_collator=default_data_collator,
            callbacks=[Mark()]).train()


def bare_loop(args, device: torch.device) -> None:
    import torch.nn.functional as F

    from treadle.data.packed import IGNORE_INDEX
    from treadle.models.hf import decoder_layers

    data = packed_rows(args.seq)
    model = build(args, data.vocab_size).to(device).train()
    compiled = device.type == "cuda"
    if compiled:
        for layer in decoder_layers(model):
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    timer = Timer(args.out, args.steps, args.batch * args.seq, device)
    settings = f"bf16 autocast, each decoder layer compiled: {compiled}, fused AdamW, attention " \
               f"{model.config._attn_implementation}"
    batches = [{k: torch.stack([data[s * args.batch + j][k] for j in range(args.batch)]) for k in data[0]}
               for s in range(args.steps)]  # read before the clock: the loop is measured, not the disk
    window = ProfileWindow(args.profile_step, args.out)
    for step, batch in enumerate(batches, 1):
        window.begin(step)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.end(step)
        timer.step_end(step, model, args.seq, settings=settings)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # a typo is an error
    p.add_argument("loop", choices=["hf", "bare"])
    p.add_argument("--compile", action="store_true", help="hf: torch_compile=True (on CUDA)")
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--overrides", required=True, help="the model: HF config fields over the tiny preset, as JSON")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help=f"steps run; the last {TIMED} are timed")
    p.add_argument("--profile-step", type=int, help="profile this step (before the timed ones): <out>/profile/")
    p.add_argument("--out", required=True, help=f"the loop's directory: {RESULT} goes there")
    return p


def main() -> None:
    args = parser().parse_args()
    json.loads(args.overrides)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (hf_loop if args.loop == "hf" else bare_loop)(args, device)
    if not (Path(args.out) / RESULT).exists():
        raise SystemExit(f"{args.loop}: the loop ended before step {args.steps}; nothing timed")


if __name__ == "__main__":
    main()
