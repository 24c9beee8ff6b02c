"""EAGLE-3 draft steps at long sequences and a 128k vocabulary: peak memory and tokens/s, before and after.

    python bench/memory_eagle3_cases.py [--lengths 1024,4096,16384] [--steps 1] [--budget-mib 12288]

Before: the unroll's attention through dense masks over every step's keys and whole logits
(``Eagle3Model.dense_attention = True``, ``loss_chunk_tokens = 0``: the code path of main before the change).
After: the mask-free attention (drafts/eagle3/attention.py) and scores chunk by chunk (``loss_chunk_tokens`` 1024).

The target: a Llama with a 128,256-token vocabulary (Llama 3's) and a small body (hidden 64, 4 layers, 4 heads,
2 key/value heads) so that it runs on a CPU; the draft: EAGLE-3's default unroll (7 steps) and a 32,000-token head
(the public Llama-3 EAGLE-3 drafts'), loss "mix". One row of T tokens, one document, fp32, the local engine with
AdamW. Each case runs alone in a fresh process (peak RSS, ``ru_maxrss``, is a high-water mark): a warm-up step,
then ``--steps`` timed steps (median). A child's data segment is capped at ``--budget-mib`` (``RLIMIT_DATA``) so
that a case too big for the machine fails to allocate instead of pushing other processes out of memory: such a
case is reported as over the budget. ``eagle3_cases()`` returns the rows; bench/memory.py prints them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VOCAB, DRAFT_VOCAB, STEPS_K = 128_256, 32_000, 7
TARGET = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32_768, use_cache=False)
PATHS = {"before": (True, 0), "after": (False, 1024)}  # (dense_attention, loss_chunk_tokens)


def run_case(path: str, seq_len: int, steps: int) -> dict:
    """In the child: build, warm up, time ``steps`` steps; peak RSS and tokens/s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from treadle.config import DraftConfig
    from treadle.engine.local import LocalEngine
    from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model
    from treadle.drafts.eagle3.objective import Eagle3Objective
    from treadle.train.step import optimizer_step

    torch.set_num_threads(2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET))
    model = Eagle3Model(target, Eagle3Draft(target.config, (1, 2, 3), DRAFT_VOCAB))
    model.draft_model.set_vocabulary(torch.arange(DRAFT_VOCAB))
    model.dense_attention, model.loss_chunk_tokens = PATHS[path]
    model.train()
    engine = LocalEngine(model, torch.optim.AdamW(model.draft_model.parameters(), lr=1e-4), torch.device("cpu"))
    objective = Eagle3Objective(DraftConfig(kind="eagle3", target="x", loss="mix", ttt_steps=STEPS_K),
                                TARGET["max_position_embeddings"], seq_len)
    ids = torch.randint(0, VOCAB, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len)[None]}
    times = []
    for i in range(steps + 1):  # the first is the warm-up (``steps`` 0: the one step is timed, warm-up included)
        t0 = time.perf_counter()
        optimizer_step(engine, [batch], grad_clip=1.0, loss_fn=objective)
        if i or not steps:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": step_s,
            "tokens_per_s": seq_len / step_s}


def eagle3_cases(lengths=(1024, 4096, 16384), steps: int = 1, budget_mib: int = 12_288) -> list[dict]:
    """One row per (length, path), each from a fresh child process; ``over_budget`` where it failed to allocate."""
    rows = []
    for seq_len in lengths:
        for path in PATHS:
            cmd = [sys.executable, __file__, "--case", path, "--seq-len", str(seq_len), "--steps", str(steps),
                   "--budget-mib", str(budget_mib)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            row = {"path": path, "seq_len": seq_len, "budget_mib": budget_mib}
            if done.returncode:
                if "memory" not in done.stderr.lower() and "alloc" not in done.stderr.lower():
                    sys.exit(f"eagle3 {path} at {seq_len} failed:\n{done.stderr}")
                row["over_budget"] = True
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"# EAGLE-3 draft step: target vocab {VOCAB:,} (hidden 64, 4 layers), draft vocab {DRAFT_VOCAB:,}, "
          f"{STEPS_K} TTT steps, one row, fp32; before = dense masks + whole logits, after = mask-free attention + "
          "chunked scores (1024 rows)")
    print("| T | path | peak MiB | vs before | tokens/s | vs before |")
    print("|---|---|---|---|---|---|")
    before = {r["seq_len"]: r for r in rows if r["path"] == "before"}
    for r in rows:
        b = before.get(r["seq_len"])
        if r.get("over_budget"):
            print(f"| {r['seq_len']:,} | {r['path']} | > {r['budget_mib']:,} (over the budget) | | - | |")
            continue
        fit = b is not None and not b.get("over_budget") and r is not b
        mem = f"{r['peak_bytes'] / b['peak_bytes']:.2f}x" if fit else ""
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if fit else ""
        print(f"| {r['seq_len']:,} | {r['path']} | {r['peak_bytes'] / 2**20:,.0f} | {mem} | "
              f"{r['tokens_per_s']:,.0f} | {speed} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=1,
                    help="timed steps after the warm-up (median reported); 0: one step, timed with its warm-up")
    ap.add_argument("--budget-mib", type=int, default=12_288, help="each child's data-segment cap")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: run this path, print JSON
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        cap = args.budget_mib * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        print(json.dumps(run_case(args.case, args.seq_len, args.steps)))
        return
    print_table(eagle3_cases(tuple(int(x) for x in args.lengths.split(",")), args.steps, args.budget_mib))


if __name__ == "__main__":
    main()
