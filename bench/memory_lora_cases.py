"""LoRA against full training: peak RSS, optimizer state and tokens/s of one training step (issue 42).

    python bench/memory_lora_cases.py [--tokens 512] [--seq-len 512] [--steps 2] [--budget-gib 14]

Each case alone in a fresh process (peak RSS, ``ru_maxrss``, is a high-water mark): the model built as a run builds
it (``build_model``, fp32, a 32,000-token vocabulary), for LoRA PEFT's rank-16 adapters (alpha 32) on every linear
layer of the decoder (``apply_lora``, as ``[lora]`` does), AdamW over what trains, a warm-up step then ``--steps``
timed steps of ``optimizer_step`` on the local engine (one process: the figures are one rank's). Optimizer state:
``engine.memory_report()["optim"]`` after the steps.

Before a case runs, the bytes its weights, gradients and AdamW state need are counted on the meta device (no
memory): a case whose count alone exceeds ``--budget-gib`` is not run, and its row says what it would need. A case
that runs has its data segment capped at the budget (``RLIMIT_DATA``: a step that needs more fails to allocate and
its row says so): this machine is shared, and nothing here may push it past that. ``large`` is sized so that full
training cannot fit in this machine's 24 GiB while LoRA fits under the budget. ``lora_cases()`` returns the rows;
bench/memory.py prints them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 32_000
RANK, ALPHA = 16, 32.0
# 'large': a 1.6B Llama (hidden 2048, 32 layers): 16 bytes per parameter for fp32 weights, gradients and AdamW's
# two moments is ~24.5 GiB before any activation, more than this machine's memory.
MODELS = {
    "medium": {"preset": "medium"},
    "large": {"preset": "medium", "overrides": {"hidden_size": 2048, "intermediate_size": 5632,
                                                "num_hidden_layers": 32, "num_attention_heads": 16,
                                                "num_key_value_heads": 8}},
}
CASES = [(model, mode) for model in MODELS for mode in ("full", "lora")]


def _model(name: str, empty: bool = False):
    import torch

    from treadle.config import ModelConfig
    from treadle.models.hf import build_model

    torch.manual_seed(0)
    if empty:  # the parameters' shapes only: nothing allocated
        with torch.device("meta"):
            return build_model(ModelConfig(**MODELS[name]), VOCAB)
    return build_model(ModelConfig(**MODELS[name]), VOCAB)


def _lora(model):
    from treadle.config import LoraConfig
    from treadle.models.lora import apply_lora

    return apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA), {"fingerprint": "bench"}).model


def state_bytes(name: str, mode: str) -> dict:
    """Parameters, trainable parameters and the bytes of fp32 weights + gradients + AdamW state (two moments) of a
    case, counted on the meta device."""
    model = _model(name, empty=True)
    if mode == "lora":
        model = _lora(model)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": params, "trainable": trainable, "state_bytes": 4 * params + (4 + 8) * trainable}


def run_case(name: str, mode: str, tokens: int, seq_len: int, steps: int, budget_gib: float = 0.0) -> dict:
    """In the child: build, warm up, time ``steps`` steps; peak RSS, optimizer state and tokens/s."""
    import torch

    from treadle.engine.local import LocalEngine
    from treadle.train.step import optimizer_step

    torch.set_num_threads(2)
    if budget_gib:  # the heap and anonymous mappings, where tensors live
        cap = int(budget_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    model = _model(name)
    if mode == "lora":
        model = _lora(model)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = LocalEngine(model, torch.optim.AdamW(trainable, lr=1e-4), torch.device("cpu"))
    rows = tokens // seq_len
    ids = torch.randint(0, VOCAB, (rows, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len).repeat(rows, 1)}
    times = []
    for i in range(steps + 1):  # the first is the warm-up (AdamW's state appears there)
        t0 = time.perf_counter()
        optimizer_step(engine, [batch], grad_clip=1.0)
        if i:
            times.append(time.perf_counter() - t0)
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "optim_bytes": engine.memory_report()["optim"], "tokens_per_s": tokens / statistics.median(times)}


def lora_cases(tokens: int = 512, seq_len: int = 512, steps: int = 2, budget_gib: float = 14.0) -> list[dict]:
    rows = []
    for name, mode in CASES:
        row = {"model": name, "mode": mode, **state_bytes(name, mode)}
        if row["state_bytes"] > budget_gib * 2**30:
            row["skipped"] = f"needs {row['state_bytes'] / 2**30:.1f} GiB before activations"
        else:
            cmd = [sys.executable, __file__, "--case", f"{name}:{mode}", "--tokens", str(tokens), "--seq-len",
                   str(seq_len), "--steps", str(steps), "--budget-gib", str(budget_gib)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode and "MemoryError" not in done.stderr and "alloc" not in done.stderr:
                sys.exit(f"{name} {mode} failed:\n{done.stderr}")
            if done.returncode:
                row["skipped"] = f"a step needs more than {budget_gib:g} GiB"
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(row), file=sys.stderr, flush=True)  # each row as it comes: a long run keeps what it measured
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | training | parameters | trainable | weights+grads+AdamW (counted) GiB | peak RSS per rank GiB | "
          "optimizer state MiB | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            peak, optim, speed = f"not run: {r['skipped']}", "-", "-"
        else:
            peak, optim, speed = (f"{r['peak_bytes'] / 2**30:.2f}", f"{r['optim_bytes'] / 2**20:,.1f}",
                                  f"{r['tokens_per_s']:,.0f}")
        training = f"LoRA r={RANK}" if r["mode"] == "lora" else "full"
        print(f"| {r['model']} | {training} | {r['params'] / 1e6:,.0f}M | {r['trainable'] / 1e6:,.1f}M | "
              f"{r['state_bytes'] / 2**30:.2f} | {peak} | {optim} | {speed} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="tokens per step (rows x seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up (median reported)")
    ap.add_argument("--budget-gib", type=float, default=14.0,
                    help="GiB: a case whose counted state exceeds this is not run, the others are capped at it")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: run this case, print JSON
    args = ap.parse_args()
    if args.case:
        name, mode = args.case.split(":")
        print(json.dumps(run_case(name, mode, args.tokens, args.seq_len, args.steps, args.budget_gib)))
        return
    print_table(lora_cases(args.tokens, args.seq_len, args.steps, args.budget_gib))


if __name__ == "__main__":
    main()
