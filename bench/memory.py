"""Peak memory and tokens/s of one training step, case by case (each case in a fresh process).

    python bench/memory.py [--only ce] [--tokens 2048] [--seq-len 512] [--steps 3] [--device cpu]

A case is a model config (``ModelConfig`` fields: preset, loss_chunk_tokens, ...), a vocabulary
and what the loss is. Each runs alone in a child process: a warm-up step (one-time costs: the
optimizer's state, first calls), then ``--steps`` timed steps of ``optimizer_step`` on the local
engine; the child reports its peak memory (CPU: ``ru_maxrss``, a high-water mark, hence one
process per case; CUDA: ``max_memory_allocated``) and the median step's tokens/s.

The loss part of a case is its peak minus the peak of its group's ``decoder`` case, which runs
the same model with a loss on the hidden states (and the head's weight, so it has a gradient
and optimizer state too): what the LM head and the cross-entropy add to a step.

Add rows by appending ``Case``s to ``CASES`` (a new ``group`` gets its own baseline if it has a
case with ``loss="decoder"``).
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
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # rows compared with each other; the group's "decoder" case is their baseline
    vocab: int
    loss: str = "lm"  # "lm": the run's loss (loss_sum); "decoder": hidden states only (the baseline)
    model: dict = field(default_factory=dict)  # ModelConfig fields over the tiny preset's defaults


CASES = [
    case
    for vocab, tag in ((8192, "8k"), (32_000, "32k"), (128_256, "128k"))
    for case in (
        Case(f"ce-{tag}-decoder", f"ce-{tag}", vocab, loss="decoder"),
        Case(f"ce-{tag}-naive", f"ce-{tag}", vocab, model={"loss_chunk_tokens": 0}),
        Case(f"ce-{tag}-chunked", f"ce-{tag}", vocab, model={"loss_chunk_tokens": 1024}),
    )
]


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _decoder_loss(model, batch):
    """The baseline: the decoder's hidden states (and the head's weight, for its grad and Adam state) summed."""
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return hidden.last_hidden_state.float().pow(2).mean(-1).sum(-1) + 0.0 * model.lm_head.weight.sum()


def run_case(case: Case, tokens: int, seq_len: int, steps: int, device: torch.device) -> dict:
    """In the child: build, warm up, time ``steps`` steps; peak memory and tokens/s."""
    from treadle.config import ModelConfig
    from treadle.data.packed import IGNORE_INDEX
    from treadle.engine.local import LocalEngine
    from treadle.models.chunked_ce import resolve_chunk_tokens, use_chunked_loss
    from treadle.models.hf import build_model
    from treadle.train.step import loss_sum, optimizer_step

    torch.manual_seed(0)
    cfg = ModelConfig(**case.model)
    model = build_model(cfg, case.vocab)
    chunk = resolve_chunk_tokens(cfg.loss_chunk_tokens, case.vocab) if case.loss == "lm" else 0
    if chunk:  # as train/run.py does
        use_chunked_loss(model, chunk, IGNORE_INDEX)
    model.to(device).train()
    engine = LocalEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device)
    rows = tokens // seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case.vocab, (rows, seq_len + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len).repeat(rows, 1)}
    loss_fn = loss_sum if case.loss == "lm" else _decoder_loss
    times = []
    for i in range(steps + 1):  # the first is the warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        optimizer_step(engine, [batch], grad_clip=1.0, loss_fn=loss_fn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return {"peak_bytes": _peak_bytes(device), "step_s": statistics.median(times),
            "tokens_per_s": tokens / statistics.median(times), "chunk_tokens": chunk}


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu}, {torch.get_num_threads()} threads"
    return f"{where}; torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step (rows x seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up (median reported)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-ac", action="store_true", help="skip the activation checkpointing cases (bench/memory_ac_cases.py)")
    ap.add_argument("--no-loading", action="store_true",
                    help="skip the model-loading cases (bench/memory_loading_cases.py: torchrun, world size 1 and 2)")
    ap.add_argument("--no-eagle3", action="store_true",
                    help="skip the EAGLE-3 draft cases (bench/memory_eagle3_cases.py: T = 1k/4k/16k, before/after)")
    ap.add_argument("--no-lora", action="store_true",
                    help="skip the LoRA cases (bench/memory_lora_cases.py: medium and a 1.6B model, full vs rank 16)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: run this case, print JSON
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.case:
        case = next(c for c in CASES if c.name == args.case)
        print(json.dumps(run_case(case, args.tokens, args.seq_len, args.steps, device)))
        return

    results: dict[str, dict] = {}
    for case in (c for c in CASES if args.only in c.name):
        cmd = [sys.executable, __file__, "--case", case.name, "--tokens", str(args.tokens), "--seq-len",
               str(args.seq_len), "--steps", str(args.steps), "--device", args.device, "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{case.name} failed:\n{done.stderr}")
        results[case.name] = json.loads(done.stdout.strip().splitlines()[-1])

    print(f"# {machine(device)}; {args.tokens} tokens per step (seq_len {args.seq_len}), tiny preset, fp32, "
          f"median of {args.steps} steps after a warm-up")
    print("| case | vocab | chunk tokens | peak MiB | loss part MiB | loss part vs naive | tokens/s | vs naive |")
    print("|---|---|---|---|---|---|---|---|")
    for case in (c for c in CASES if c.name in results):
        r = results[case.name]
        base = next((results[c.name] for c in CASES if c.group == case.group and c.loss == "decoder"
                     and c.name in results), None)
        naive = next((results[c.name] for c in CASES if c.group == case.group and c.model.get("loss_chunk_tokens") == 0
                      and c.name in results), None)
        part = r["peak_bytes"] - base["peak_bytes"] if base and case.loss != "decoder" else None
        naive_part = naive["peak_bytes"] - base["peak_bytes"] if base and naive else None
        share = f"{part / naive_part:.0%}" if part is not None and naive_part else ""
        speed = f"{r['tokens_per_s'] / naive['tokens_per_s']:.2f}x" if naive and case.loss != "decoder" else ""
        print(f"| {case.name} | {case.vocab:,} | {r['chunk_tokens'] or '-'} | {r['peak_bytes'] / 2**20:,.0f} | "
              f"{'' if part is None else f'{part / 2**20:,.0f}'} | {share} | {r['tokens_per_s']:,.0f} | {speed} |")

    if not args.no_ac and not args.only:  # the second table: activation checkpointing none / selective / full
        import memory_ac_cases

        print()
        memory_ac_cases.print_table(memory_ac_cases.activation_checkpointing_cases())
    if not args.no_loading and not args.only:  # the third: peak RSS per rank loading model.path, world size 1 and 2
        import memory_loading_cases

        print()
        memory_loading_cases.print_table(*memory_loading_cases.loading_cases())
    if not args.no_eagle3 and not args.only:  # the fourth: an EAGLE-3 draft step at 1k/4k/16k, 128k vocabulary
        import memory_eagle3_cases

        print()
        memory_eagle3_cases.print_table(memory_eagle3_cases.eagle3_cases())
    if not args.no_lora and not args.only:  # the fifth: full training against LoRA r = 16, medium and larger
        import memory_lora_cases

        print()
        memory_lora_cases.print_table(memory_lora_cases.lora_cases())


if __name__ == "__main__":
    main()
