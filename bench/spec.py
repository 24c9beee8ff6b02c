"""Which drafter makes a target fastest: GLIDE (each objective) vs an independent LM vs prompt lookup.

Every trained drafter sees the same data for the same number of steps with the same
batch; then each one decodes the same held-out prompts greedily with gamma draft
tokens per verification call against the same frozen target, and ``spec-eval``'s
lossless check must hold for all of them.

    python bench/spec.py [--target runs/demo] [--steps 200] [--gamma 4] [--only glide-kl,lm]

``glide-kl-regen`` trains the same GLIDE draft on *regenerated* data: prompts cut
from the built-in corpus' train split, answered greedily by the target itself
(``treadle generate``), trained as SFT (loss on the target's answers only). Its
row against ``glide-kl`` (original data) shows what regeneration is worth.

The target defaults to the demo's (``make demo`` writes runs/demo). Results go to
stdout as a table and to ``runs/bench-spec/results.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from treadle.config import load_config
from treadle.corpus import corpus_files, split_of
from treadle.models.glide import load_glide
from treadle.model_dirs import resolve_model_dir
from treadle.models.hf import load_causal_lm
from treadle.speculative.drafters import ModelDrafter, PromptLookupDrafter
from treadle.speculative.evaluate import evaluate_drafter
from treadle.speculative.glide_drafter import GlideDrafter
from treadle.speculative.prompts import heldout_prompts
from treadle.train.run import run_training

# An independent draft LM of about GLIDE's trainable size (~0.9M for the tiny target):
# one tied embedding/head of width 96 plus two thin layers.
LM_DRAFT = "{hidden_size=96,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,tie_word_embeddings=true}"


def regenerate(args) -> Path:
    """Train-split prompts answered greedily by the target: an SFT file of the target's own outputs (cached)."""
    out = args.out / f"regen-{args.regen_prompts}x{args.regen_new_tokens}.jsonl"
    prompts = args.out / f"regen-prompts-{args.regen_prompts}.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(Path(args.target), "--target"))
    windows = train_windows(tokenizer, args.regen_prompts, args.prompt_len)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": tokenizer.decode(w)}) + "\n" for w in windows))
    # Resumable: a finished file is only read back (every row skipped), an interrupted one is continued.
    subprocess.run([sys.executable, "-m", "treadle", "generate", "--model", str(args.target), "--prompts", str(prompts),
                    "--out", str(out), "--max-new-tokens", str(args.regen_new_tokens), "--batch-size", "32"], check=True)
    return out


def train_windows(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompt windows from the built-in corpus' *train* split (the eval prompts come from val)."""
    files = [path for rel, path in corpus_files() if split_of(rel) == "train"]
    random.Random(0).shuffle(files)
    windows = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        windows += [ids[s : s + prompt_len] for s in range(0, len(ids) - prompt_len, 4 * prompt_len)][:4]
        if len(windows) >= n:
            return windows[:n]
    return windows


def train_args(args, name: str) -> list[str]:
    data = f'--data.sources=[{{name="regen",path="{args.regen}"}}]' if name.endswith("-regen") else f"--data.train={args.data}"
    common = [
        f"--train.output_dir={args.out / name}", f"--train.max_steps={args.steps}", "--train.micro_batch_size=8",
        "--data.seq_len=256", "--train.threads=2", "--train.log_every=50", f"--train.eval_every={args.steps}",
        "--train.eval_batches=4", "--schedule.warmup_steps=20", "--optim.lr=3e-3", "--checkpoint.resume=none",
        "--data.val=builtin", data,
    ]
    if name.startswith("glide-"):
        return common + ["--draft.kind=glide", f"--draft.target={args.target}", f"--draft.loss={name.split('-')[1]}",
                         f"--draft.gamma={args.gamma}"]
    return common + [f"--model.overrides={LM_DRAFT}"]


def train(args, name: str) -> dict:
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)  # each bench run trains from scratch
    summary = run_training(load_config(None, train_args(args, name)), live=False)
    return {"trainable_params": summary.parameters, "train_s": summary.elapsed_s,
            "train_tokens_per_s": summary.tokens_per_s, "run": str(out)}


def drafter_for(name: str, run: Path | None, target):
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name.startswith("glide-"):
        return GlideDrafter(load_glide(run / "draft", target))
    return ModelDrafter(load_causal_lm(run / "hf", "lm draft"), name="lm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="runs/demo", help="target: HF dir or treadle run dir (default runs/demo)")
    parser.add_argument("--data", default="builtin", help="draft training data: shard dir or 'builtin'")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--only", default="glide-ce,glide-kl,glide-mix,glide-kl-regen,lm,prompt-lookup")
    parser.add_argument("--regen-prompts", type=int, default=512, help="glide-kl-regen: prompts the target answers")
    parser.add_argument("--regen-new-tokens", type=int, default=192, help="glide-kl-regen: tokens per answer")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-spec"))
    args = parser.parse_args()
    names = args.only.split(",")
    torch.set_num_threads(2)

    args.regen = regenerate(args) if any(n.endswith("-regen") for n in names) else None
    rows = {}
    for name in names:
        if name != "prompt-lookup":
            print(f"training {name} for {args.steps} steps ...", file=sys.stderr, flush=True)
            rows[name] = train(args, name)
        else:
            rows[name] = {"trainable_params": 0, "train_s": 0.0, "train_tokens_per_s": None, "run": None}

    target = load_causal_lm(Path(args.target), "--target")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(Path(args.target), "--target"))
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    for name in names:
        run = Path(rows[name]["run"]) if rows[name]["run"] else None
        got = evaluate_drafter(target, drafter_for(name, run, target), prompts, args.gamma, args.max_new_tokens,
                               tokenizer.eos_token_id)
        rows[name].update({k: got[k] for k in ("tau", "acceptance_conditional", "acceptance_unconditional",
                                               "tokens_per_s_spec", "tokens_per_s_target", "speedup", "lossless")})

    print(f"\nspec bench: target {args.target}, gamma {args.gamma}, {args.prompts} held-out prompts x "
          f"{args.max_new_tokens} new tokens, {args.steps} training steps of 8 x 256 tokens; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| drafter | trainable params | train s | tau | acceptance (conditional, k=1..{args.gamma}) | spec tok/s | target tok/s | speedup | lossless |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        acc = ", ".join(f"{a:.2f}" if a is not None else "n/a" for a in r["acceptance_conditional"])
        print(f"| {name} | {r['trainable_params'] / 1e6:.2f}M | {r['train_s']:.0f} | {r['tau']:.2f} | {acc} | "
              f"{r['tokens_per_s_spec']:.0f} | {r['tokens_per_s_target']:.0f} | {r['speedup']:.2f}x | {r['lossless']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["lossless"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
