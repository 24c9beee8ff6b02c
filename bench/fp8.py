"""FP8 on Hopper (issue 40), `make gpu-check`'s `fp8` item: bf16 against torchao float8 (tensorwise, rowwise).

Two shapes, each trained by treadle's own loop (``build_trainer`` + ``fit``, what `treadle train` runs) with
``model.compile = true`` and the same seed, data and steps for every variant:

  1b        the 1.1B Llama of bench/gpu.py (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 32768)
  8b-slice  Llama-3-8B's width (hidden 4096, MLP 14336, 32/8 heads, vocab 32768) with 8 of its 32 layers: the
            shape where float8 is reported to pay (torchao/float8/README.md, torchtitan docs/float8.md)

Rows: tokens/s (the median over the steps after the first ``WARMUP``, which hold the compile), MFU (against
each dtype's own peak: fp8's is twice bf16's, metrics/flops.py) and peak allocated memory; each run's start lines
(in the item's log) say how many linear layers its recipe converted. Everything runs in one process to spend the GPU's time on steps rather than on
interpreters and checkpoints: the run's end-of-run checkpoint (tens of GiB at these sizes) is not written.

The loss check: 1b's bf16 and fp8-tensorwise runs go ``LOSS_STEPS`` steps; every 10-step mean loss from step 51 on
must lie within ``LOSS_TOLERANCE`` (relative) of bf16's. Why that bound: DeepSeek-V3's report (arXiv 2412.19437,
section 3.3) keeps fine-grained FP8 within 0.25% of its BF16 loss over a whole run; tensorwise scales are coarser,
and at step 50-200 a random-init model's loss still falls about 0.5% per 10 steps, so a curve a window behind
differs by that much: 2% (8x DeepSeek's bound) flags a recipe that diverges, not the noise of this early phase.
The first 50 steps (the steep fall from ln(vocab)) are shown, not judged. rowwise runs ``SPEED_STEPS`` only.

    python bench/fp8.py --out runs/gpu-check/fp8        # needs CUDA capability >= 8.9 and torchao
    python bench/fp8.py --dry-run                        # validate every run's config, run nothing

Without float8 hardware or torchao it says why in one line and writes {"skipped": why}; exit 0.
torchao on the GPU machine (which has no registry): carry its wheel, see docs/training.md (FP8).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu import LLAMA_1B  # noqa: E402  (the same 1.1B as the rest of the check)

SLICE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32768, max_position_embeddings=4096)
SHAPES = {"1b": (LLAMA_1B, 4), "8b-slice": (SLICE_8B, 4)}  # (the model, micro-batch rows of 2048 tokens)
VARIANTS = {"bf16": ["--model.dtype=bf16"],
            "fp8-tensorwise": ["--model.dtype=fp8", "--model.fp8_recipe=tensorwise"],
            "fp8-rowwise": ["--model.dtype=fp8", "--model.fp8_recipe=rowwise"]}
SEQ = 2048
LOSS_STEPS = 200
SPEED_STEPS = 40
WARMUP = 10  # steps left out of tokens/s: the first compiles
LOSS_TOLERANCE = 0.02
JUDGED_FROM = 51
WINDOW = 10


def runs(out: Path, shapes: tuple[str, ...] | None = None) -> list[tuple[str, str, list[str]]]:
    """(shape, variant, treadle overrides) of every run of ``shapes`` (None: all), in order."""
    found = []
    for shape in shapes or tuple(SHAPES):
        model, rows = SHAPES[shape]
        inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in model.items())
        for variant, dtype in VARIANTS.items():
            steps = LOSS_STEPS if shape == "1b" and variant != "fp8-rowwise" else SPEED_STEPS
            found.append((shape, variant, [
                f"--train.output_dir={out / f'{shape}-{variant}'}", "--model.preset=tiny",
                f"--model.overrides={{{inline}}}", *dtype, "--model.compile=true", "--train.device=cuda",
                "--train.threads=0", "--checkpoint.resume=none", "--checkpoint.export_hf=false",
                "--train.eval_at_start=false", "--train.eval_every=0", "--data.val=[]", f"--data.seq_len={SEQ}",
                f"--train.micro_batch_size={rows}", f"--train.max_steps={steps}", "--train.log_every=1",
                "--optim.lr=3e-4", "--schedule.warmup_proportion=0.1", "--train.seed=0"]))
    return found


def why_not_here() -> str | None:
    import torch

    from treadle.models.fp8 import MIN_CAPABILITY, torchao_version

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    cap = torch.cuda.get_device_capability(0)
    if cap < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(0)} has CUDA capability {cap[0]}.{cap[1]}, float8 needs 8.9"
    if torchao_version() is None:
        return "torchao does not import here (carry its wheel: docs/training.md, FP8)"
    return None


def train(argv: list[str]) -> dict:
    """One run through treadle's loop, its end-of-run checkpoint left out; its per-step records and peak memory."""
    import torch

    from treadle.config import load_config
    from treadle.train.callbacks import CheckpointCallback
    from treadle.train.run import build_trainer, close_trainer

    torch._dynamo.reset()  # each variant compiles its own layers: no earlier graph's cache entries in the way
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(load_config(None, argv), live=False)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, CheckpointCallback)]
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        close_trainer(trainer)
    wall = time.perf_counter() - t0
    run_dir = Path(trainer.cfg.train.output_dir)
    del trainer
    gc.collect()
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in steps if "tokens_per_s" in r]
    return {"steps": steps, "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "fit_s": wall}


def summary(result: dict) -> dict:
    timed = result["steps"][WARMUP:]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(mfu) if mfu else None, "peak_gib": result["peak_gib"], "fit_s": result["fit_s"],
            "loss": [r["loss"] for r in result["steps"]]}


def loss_check(bf16: list[float], fp8: list[float]) -> dict:
    """Each 10-step mean of ``fp8`` against ``bf16``'s; judged from step JUDGED_FROM on."""
    n = min(len(bf16), len(fp8)) // WINDOW * WINDOW
    windows = []
    for start in range(0, n, WINDOW):
        b, f = statistics.fmean(bf16[start:start + WINDOW]), statistics.fmean(fp8[start:start + WINDOW])
        windows.append({"steps": f"{start + 1}-{start + WINDOW}", "bf16": b, "fp8": f, "rel": abs(f - b) / b,
                        "judged": start + 1 >= JUDGED_FROM})
    judged = [w["rel"] for w in windows if w["judged"]]
    return {"windows": windows, "max_rel": max(judged) if judged else None, "tolerance": LOSS_TOLERANCE,
            "ok": bool(judged) and max(judged) <= LOSS_TOLERANCE}


def table(rows: dict, check: dict | None) -> str:
    lines = ["| shape | variant | tokens/s | vs bf16 | MFU | peak GiB (alloc) | fit s |", "|---|---|---|---|---|---|---|"]
    for (shape, variant), r in rows.items():
        base = rows.get((shape, "bf16"))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        lines.append(f"| {shape} | {variant} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {r['peak_gib']:.1f} | "
                     f"{r['fit_s']:.0f} |")
    if check is not None:
        verdict = "within" if check["ok"] else "OUTSIDE"
        lines += ["", f"Loss, 1b fp8-tensorwise against bf16 over {LOSS_STEPS} steps (10-step means): max relative "
                      f"difference {100 * check['max_rel']:.2f}% from step {JUDGED_FROM} on, {verdict} the "
                      f"{100 * LOSS_TOLERANCE:.0f}% tolerance", "",
                  "| steps | bf16 | fp8 | rel. diff |", "|---|---|---|---|"]
        lines += [f"| {w['steps']} | {w['bf16']:.4f} | {w['fp8']:.4f} | {100 * w['rel']:.2f}%"
                  f"{'' if w['judged'] else ' (not judged)'} |" for w in check["windows"]]
    return "\n".join(lines) + "\n"


def dry_run(out: Path, shapes: tuple[str, ...] | None = None) -> int:
    from treadle.config import load_config
    from treadle.errors import UserError

    bad = 0
    for shape, variant, argv in runs(out, shapes):
        try:
            load_config(None, argv)
            status = "ok"
        except UserError as exc:
            status, bad = f"INVALID: {exc}", bad + 1
        print(f"  fp8 {shape} {variant}: {status}")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check" / "fp8")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    shapes = tuple(args.shapes.split(","))
    if unknown := set(shapes) - set(SHAPES):
        p.error(f"--shapes: unknown {sorted(unknown)}; accepted: {', '.join(SHAPES)}")
    out = args.out.resolve()
    if args.dry_run:
        return dry_run(out, shapes)
    out.mkdir(parents=True, exist_ok=True)
    why = why_not_here()
    if why is not None:
        print(f"fp8: not run: {why}")
        (out / "fp8.json").write_text(json.dumps({"skipped": why}) + "\n")
        return 0
    rows = {}
    for shape, variant, argv in runs(out, shapes):
        print(f"fp8: {shape} {variant} ...", file=sys.stderr, flush=True)
        rows[(shape, variant)] = summary(train(argv))
    check = (loss_check(rows[("1b", "bf16")]["loss"], rows[("1b", "fp8-tensorwise")]["loss"]) if "1b" in shapes
             else None)
    text = table(rows, check)
    (out / "fp8.md").write_text(text)
    (out / "fp8.json").write_text(json.dumps({"rows": {f"{s} {v}": r for (s, v), r in rows.items()},
                                              "loss_check": check}, indent=1) + "\n")
    print(text, end="")
    return 0 if check is None or check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
