"""Adapters on a draft (issue 42): a base draft adapted to a second domain by LoRA adapters against full fine-tuning.

On bench/spec.py's target (configs/bench-target.toml's run, trained once and reused; ``--target-steps`` for a
shorter one), for each draft kind of ``--kinds`` (eagle3, dflash: bench/spec.py's recipes, same settings):

1. a base draft trained on the built-in corpus (domain 1: Python source) for ``--base-steps``;
2. that draft adapted to a second domain, the chat rows of ``treadle samples`` (a system prompt, a user asking for a
   function by signature and docstring, the assistant's answer: SFT rows, loss on the answers) for ``--adapt-steps``
   each, two ways at **equal training steps** (the same batches, learning rate and schedule, bench/spec.py's
   ``_train`` settings): ``lora``, PEFT adapters of rank 16 (alpha 32) on every linear layer of the draft but its
   head (``draft.init`` = the base draft, ``[lora]``), and ``full``, every weight of the base draft trained
   (``draft.init`` alone);
3. each of base, lora and full measured by speculative decoding against the frozen target (as ``treadle spec-eval``
   does, lossless checked) on both domains: ``chat`` prompts (chat rows the adaptation did not train on, rendered up
   to the assistant header) and ``code`` prompts (the built-in corpus' held-out split: what adapting may forget),
   greedy and at T = 1; beside tau, the trainable parameters, the bytes on disk of what each exports (the adapter
   directory, ``adapter/``; a whole draft, ``draft/``) and the training time (the steps at the run's own pace).

The adapters are written in PEFT's layout (adapter_config.json + adapter_model.safetensors): vLLM RFC #52038's
layout for draft adapters is not settled (docs/lora.md).

    python bench/lora_draft.py [--quick] [--kinds eagle3,dflash] [--target-steps N --target DIR] [--base-steps 300]
                               [--adapt-steps 150] [--prompts 8] [--max-new-tokens 64]

Results: a markdown table on stdout and ``<out>/results.json`` (default out: runs/bench-lora-draft).
``--quick`` is a smoke run of the whole pipeline (a 30-step target, 3 steps per draft, 2 prompts x 16 tokens, each
training run's own evaluation cut to one batch and 2 prompts).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec  # noqa: E402  bench/spec.py: the bench target, its draft recipes and training settings

from treadle.data.samples import write_samples  # noqa: E402
from treadle.data.sft import encode_prompt  # noqa: E402
from treadle.drafts.registry import drafter as exported_drafter  # noqa: E402
from treadle.model_dirs import resolve_model_dir  # noqa: E402
from treadle.models.hf import load_causal_lm  # noqa: E402
from treadle.speculative.evaluate import adapt_drafter, evaluate_drafter  # noqa: E402
from treadle.speculative.prompts import heldout_prompts  # noqa: E402

KINDS = ("eagle3", "dflash")
RANK, ALPHA = 16, 32  # docs/lora.md's draft example: alpha / r = 2
WAYS = ("base", "lora", "full")
MODES = {"greedy": spec.MODES["chain"], "T=1": spec.MODES["t1"]}
DOMAINS = ("chat", "code")
DEFAULTS = dict(target=spec.SUITES["spec"]["target"], out=Path("runs/bench-lora-draft"), target_steps=None,
                base_steps=300, adapt_steps=150, prompts=8, max_new_tokens=64, chat_rows=2000)
# --quick also evaluates each training run lightly (its own start and end evals: one batch, 2 prompts of 8 tokens):
# spec-eval's table is what the bench reads, and the runs' evals otherwise cost most of a smoke run.
QUICK_EVAL = ("--train.eval_batches=1", "--draft.eval_prompts=2", "--draft.eval_new_tokens=8")
QUICK = dict(target="runs/bench-quick-lora-draft/target", out=Path("runs/bench-quick-lora-draft"), target_steps=30,
             base_steps=3, adapt_steps=3, prompts=2, max_new_tokens=16, chat_rows=64)


def chat_data(args) -> tuple[Path, list[dict]]:
    """Domain 2: ``treadle samples``' chat rows, the last ``--prompts`` held out as prompts; (training file, held-out
    rows)."""
    paths = write_samples(args.out / "samples", n=args.chat_rows, seed=0)
    rows = paths["chat"].read_text().splitlines()
    train = args.out / "chat-train.jsonl"
    train.write_text("".join(line + "\n" for line in rows[: -args.prompts]))
    return train, [json.loads(line) for line in rows[-args.prompts:]]


def light_eval(recipe: spec.Recipe) -> spec.Recipe:
    """``recipe`` with --quick's light evaluation (later settings win)."""
    return spec.Recipe(recipe.name, lambda args: [*recipe.train_args(args), *QUICK_EVAL], recipe.drafter,
                       recipe.family, gamma=recipe.gamma)


def adapt_recipe(base: spec.Recipe, way: str, chat_train: Path, base_run: Path) -> spec.Recipe:
    """``base``'s recipe on the chat rows, started from ``base_run``'s draft: with rank-16 adapters, or in full."""
    lora = [f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}"] if way == "lora" else []

    def args_for(args) -> list[str]:
        on_chat = argparse.Namespace(**{**vars(args), "data": str(chat_train)})  # spec's _data_args reads args.data
        return [*base.train_args(on_chat), f"--draft.init={base_run}", *lora]

    return spec.Recipe(f"{base.name}-{way}", args_for, base.drafter, base.family, gamma=base.gamma)


def train(args, recipe: spec.Recipe, steps: int) -> dict:
    summary = spec._train(args, recipe, recipe.name, steps, eval_every=0)
    return {"trainable_params": summary.parameters, "steps": steps,
            "train_s": spec.TOKENS_PER_STEP * steps / summary.tokens_per_s, "wall_s": summary.elapsed_s,
            "run": str(args.out / recipe.name)}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def export_of(way: str, run: Path) -> Path:
    """What a way ships: the adapter directory (beside the base draft it names), or a whole draft."""
    return run / ("adapter" if way == "lora" else "draft")


def load(way: str, runs: dict, target):
    """The way's drafter: lora is the base draft with its adapter applied by PEFT (spec-eval's --adapter path)."""
    if way != "lora":
        return exported_drafter(Path(runs[way]) / "draft", target)
    found = exported_drafter(Path(runs["base"]) / "draft", target)
    adapt_drafter(found, runs["base"], export_of("lora", Path(runs["lora"])))
    return found


def bench_kind(args, kind: str, chat_train: Path, target, prompts: dict, eos_id) -> list[dict]:
    recipe = {r.name: r for r in spec.RECIPES}[kind]
    recipe = light_eval(recipe) if args.quick else recipe
    print(f"{kind}: base draft, {args.base_steps} steps on the built-in corpus ...", file=sys.stderr, flush=True)
    trained = {"base": train(args, recipe, args.base_steps)}
    for way in WAYS[1:]:
        print(f"{kind}: {way}, {args.adapt_steps} steps on the chat rows ...", file=sys.stderr, flush=True)
        trained[way] = train(args, adapt_recipe(recipe, way, chat_train, Path(trained["base"]["run"])), args.adapt_steps)
    runs = {way: t["run"] for way, t in trained.items()}
    gamma = recipe.gamma or args.gamma
    rows = []
    for way in WAYS:
        drafter = load(way, runs, target)
        tau, lossless = {}, True
        for domain in DOMAINS:
            for mode, settings in MODES.items():
                got = evaluate_drafter(target, drafter, prompts[domain], gamma, args.max_new_tokens, eos_id, **settings)
                tau[f"{domain} {mode}"] = got["tau"]
                lossless = lossless and got["lossless"] is not False
        export = export_of(way, Path(runs[way]))
        rows.append({"kind": kind, "way": way, "gamma": gamma, **trained[way], "export": str(export),
                     "bytes": dir_bytes(export), "tau": tau, "lossless": lossless})
    return rows


TAU_COLUMNS = [f"{d} {m}" for d in DOMAINS for m in MODES]
TRAINED_ON = {"base": "built-in corpus", "lora": "chat rows", "full": "chat rows"}


def table(rows: list[dict]) -> list[str]:
    """The markdown table: one row per kind and way, tau per domain and mode."""
    lines = ["| draft | way | trained on | trainable params | steps | train s | export | bytes on disk | "
             + " | ".join(f"tau {c}" for c in TAU_COLUMNS) + " | lossless |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(TAU_COLUMNS) + "---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['way']} | {TRAINED_ON[r['way']]} | {r['trainable_params']:,} | {r['steps']} | "
                     f"{r['train_s']:.0f} | {Path(r['export']).name}/ | {r['bytes']:,} | "
                     + " | ".join(f"{r['tau'][c]:.2f}" for c in TAU_COLUMNS) + f" | {r['lossless']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) +
                             " (explicit flags win)")
    parser.add_argument("--kinds", default="eagle3", help=f"draft kinds, of {', '.join(KINDS)} (default: eagle3)")
    parser.add_argument("--target", help=f"the bench target's run directory (default: {DEFAULTS['target']}, trained "
                                         "from configs/bench-target.toml when absent)")
    parser.add_argument("--target-steps", type=int, help="train the target this many steps instead of its config's "
                                                         "(name a --target of its own)")
    parser.add_argument("--base-steps", type=int, help="training steps of the base draft (built-in corpus)")
    parser.add_argument("--adapt-steps", type=int, help="training steps of each adaptation (lora, full): equal")
    parser.add_argument("--chat-rows", type=int, help="chat rows written by treadle samples (the last --prompts are "
                                                      "held out as prompts)")
    parser.add_argument("--prompts", type=int, help="prompts per domain")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per code prompt")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--gamma", type=int, default=4, help="chain length of EAGLE-3 (DFlash drafts its block's 7)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    kinds = args.kinds.split(",")
    if any(k not in KINDS for k in kinds):
        parser.error(f"--kinds {args.kinds}: accepted: {', '.join(KINDS)}")
    # what bench/spec.py's helpers read from its own arguments
    args.target_config = Path(__file__).resolve().parents[1] / spec.BENCH_TARGET  # from any working directory
    args.data, args.budget, args.regen_all = "builtin", "wall", False
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)

    spec.bench_target(args, *(("--train.eval_batches=1",) if args.quick else ()))
    chat_train, held_out = chat_data(args)
    target = load_causal_lm(Path(args.target), "--target")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(Path(args.target), "--target"))
    prompts = {"chat": [encode_prompt(tokenizer, row) for row in held_out],
               "code": heldout_prompts(tokenizer, args.prompts, args.prompt_len)}
    rows = [row for kind in kinds for row in bench_kind(args, kind, chat_train, target, prompts, tokenizer.eos_token_id)]

    lines = [f"lora_draft bench: target {args.target}; base drafts {args.base_steps} steps on the built-in corpus, "
             f"then {args.adapt_steps} steps each on {len(chat_train.read_text().splitlines())} chat rows (equal "
             f"steps; 8 x 256 tokens a step, lr 3e-3 cosine); LoRA rank {RANK}, alpha {ALPHA}; {args.prompts} "
             f"prompts per domain x {args.max_new_tokens} new tokens; "
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
             "", *table(rows)]
    print("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows}, indent=2) + "\n")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
