"""``model.attention``: tokens/s and peak memory of a training step, dense mask against each document by itself.

    python bench/attention.py [--seqs 4096,16384] [--kinds dense,varlen] [--steps 1] [--device cpu]
    python bench/attention.py --seqs 32768          # opt-in on CPU: dense there peaks near 17 GB and takes minutes

A case is one attention path (``dense``: transformers' ``[B, 1, T, T]`` mask; ``varlen`` and, on CUDA, ``flex``:
models/attention.py) at one row length. Its step is what ``treadle train`` runs: ``optimizer_step`` of the local
engine (forward, backward, clip, AdamW) over one row (micro-batch 1) of the built-in corpus packed by treadle's own
data path (``builtin_shards`` + ``PackedDataset``), so the row holds the documents, of the lengths, a run trains
on. Each case runs alone in a child process (bench/memory.py's helpers: peak RSS is a high-water mark; on CUDA
``max_memory_allocated``): a warm-up step (the optimizer's state, first calls, a compile), then ``--steps`` timed
steps on the following rows; the table has the median step's tokens/s, the peak, and each path against dense.

The model: the ``tiny`` preset in fp32 by default; bench/gpu.py passes ``--overrides`` (a slice of its 1.1B Llama)
and ``--dtype bf16`` for its attention rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import _peak_bytes, machine  # noqa: E402  (bench/ is not a package)

KINDS = ("dense", "varlen", "flex")


def packed_rows(seq_len: int, count: int) -> tuple[list[dict], int]:
    """The first ``count`` rows of the built-in corpus at ``seq_len``, as a run reads them; and its vocabulary."""
    from treadle import corpus
    from treadle.data.builtin import builtin_shards
    from treadle.data.packed import PackedDataset

    data = PackedDataset([builtin_shards("train", corpus.builtin_tokenizer_dir())], seq_len)
    return [{k: v[None] for k, v in data[i].items()} for i in range(count)], data.vocab_size


def documents(row: dict) -> list[int]:
    """The lengths of the documents (or their pieces) in a row: where its positions restart."""
    pos = row["position_ids"][0]
    starts = [0, *(torch.nonzero(pos[1:] <= pos[:-1]).flatten() + 1).tolist(), pos.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def run_case(kind: str, seq_len: int, steps: int, device: torch.device, dtype: str, overrides: dict) -> dict:
    """In the child: the model with ``kind`` attention, a warm-up step, ``steps`` timed steps; peak and tokens/s."""
    from treadle.config import ModelConfig
    from treadle.engine.local import LocalEngine
    from treadle.models import attention
    from treadle.models.hf import build_model
    from treadle.train.step import optimizer_step

    rows, vocab = packed_rows(seq_len, steps + 1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(overrides=overrides), vocab)
    attention.use(model, kind)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    engine = LocalEngine(model, optimizer, device)
    bf16 = dtype == "bf16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    times, losses = [], []
    for i, batch in enumerate(rows):  # the first is the warm-up; the engine moves each batch (as in training)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        result = optimizer_step(engine, [batch], grad_clip=1.0, autocast=autocast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        losses.append(result.loss)
        if i:
            times.append(time.perf_counter() - t0)
    lengths = [n for row in rows for n in documents(row)]
    return {"kind": kind, "seq_len": seq_len, "peak_bytes": _peak_bytes(device), "step_s": statistics.median(times),
            "tokens_per_s": seq_len / statistics.median(times), "loss": losses[0], "documents": len(lengths),
            "median_doc": statistics.median(lengths), "longest_doc": max(lengths)}


def child_command(kind: str, seq_len: int, args) -> list[str]:
    return [sys.executable, __file__, "--case", f"{kind}:{seq_len}", "--steps", str(args.steps), "--device",
            args.device, "--threads", str(args.threads), "--dtype", args.dtype, "--overrides", args.overrides]


def table(results: list[dict], title: str) -> str:
    """One row per case; each non-dense case against dense at its row length (the dense row's own ratio: 1.00x)."""
    dense = {r["seq_len"]: r for r in results if r["kind"] == "dense" and "error" not in r}
    lines = [f"# {title}",
             "| seq | attention | tokens/s | peak MiB | tokens/s vs dense | peak vs dense | step s | documents in the "
             "rows read (median / longest tokens) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['seq_len']:,} | {r['kind']} | FAIL | | | | | {r['error']} |")
            continue
        base = dense.get(r["seq_len"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        peak = f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" if base else ""
        lines.append(f"| {r['seq_len']:,} | {r['kind']} | {r['tokens_per_s']:,.0f} | {r['peak_bytes'] / 2**20:,.0f} | "
                     f"{speed} | {peak} | {r['step_s']:.2f} | {r['documents']} ({r['median_doc']:,.0f} / "
                     f"{r['longest_doc']:,}) |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # a typo is an error
    cuda = torch.cuda.is_available()
    ap.add_argument("--seqs", default="4096,16384", help="row lengths, comma-separated (default 4096,16384; "
                    "32768 is opt-in on a CPU: its dense case needs ~17 GB and several minutes)")
    ap.add_argument("--kinds", default="dense,varlen,flex" if cuda else "dense,varlen",
                    help=f"attention paths among {','.join(KINDS)} (flex: CUDA only, no FlexAttention backward on CPU)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up (median reported)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32, or bf16 autocast")
    ap.add_argument("--overrides", default="{}", help="HF config fields over the tiny preset, as JSON")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: KIND:SEQ, print JSON
    return ap


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    overrides = json.loads(args.overrides)
    if args.case:
        kind, seq = args.case.split(":")
        print(json.dumps(run_case(kind, int(seq), args.steps, device, args.dtype, overrides)))
        return 0
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kinds: {sorted(unknown)} unknown; accepted: {', '.join(KINDS)}")
    if "flex" in kinds and device.type != "cuda":
        ap.error("--kinds: flex needs CUDA (torch has no FlexAttention backward on CPU); accepted: dense,varlen")

    results = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for kind in kinds:
            print(f"attention: {kind} at {seq} ...", file=sys.stderr, flush=True)
            done = subprocess.run(child_command(kind, seq, args), capture_output=True, text=True)
            if done.returncode:
                lines = done.stderr.strip().splitlines() or ["no output"]
                # where it failed: the traceback's last two frames (the third GPU run got only "tensors on cuda:0
                # and cpu" back from flex at 32k, and no way to tell which tensor)
                frames = [ln.strip() for ln in lines if ln.strip().startswith('File "')][-2:]
                results.append({"kind": kind, "seq_len": seq, "error": f"exit {done.returncode}: {lines[-1]}"
                                + (f" (at {' <- '.join(reversed(frames))})" if frames else "")})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    model = f"tiny preset + {args.overrides}" if overrides else "tiny preset"
    title = (f"{machine(device)}; {model}, {args.dtype}, micro-batch 1, rows of the built-in corpus; median of "
             f"{args.steps} step(s) after a warm-up")
    print(table(results, title), end="")
    if args.json:
        args.json.write_text(json.dumps({"title": title, "results": results}, indent=1) + "\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
