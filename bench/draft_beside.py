"""A draft trained beside its target (issue 49, ``draft.target = "self"``): what it costs and what it buys.

On the demo family (the tiny Llama on the built-in corpus; ``--quick``: a narrower one), one contract:

1. **Step time.** Short training runs, interleaved and repeated (``--repeats``): the target alone, the target with
   an EAGLE-3 draft beside it, and, for reference, a draft run of the same draft against the frozen target (which
   pays a second target forward every step). A run's step time is the median of its steps after the first, each
   from its start to the end of the draft's update (``StepClock``). The ratios to the target alone are per repeat
   (median, min-max). Goal:
   the draft beside costs no more than its own forward and backward, so ``beside - alone`` stays under the draft run's
   step, which is that forward and backward plus a target forward.
2. **Keeping a draft current when the target changes.** The target is pretrained on the built-in corpus
   (``--pretrain-steps``), then SFT-trained on ``treadle samples``' chat rows (``--sft-steps``). Three drafts, each
   trained for ``pretrain + sft`` draft steps in all (equal draft steps; the draft runs also pay a target forward a
   step, the beside draft none):
   - ``stale``: a draft run against the pretrained target on the corpus, all its steps before the change;
   - ``catch-up``: the same draft's first ``pretrain`` steps, then ``--draft.init=<it> --draft.target=<SFT target>``
     on the chat rows;
   - ``beside``: a draft beside the target throughout (beside the pretraining, then ``--draft.init`` = that draft
     beside the SFT).
   Each is decoded against the SFT target by spec-eval's Python API (``treadle.api.spec_eval``) on held-out chat
   prompts, greedy and at T = 1 (tau, lossless).
3. **MTP joint.** configs/bench-target-mtp.toml's GLM-4-MoE (an MTP layout) trained ``--mtp-steps`` alone and with
   an MTP head beside it whose loss (x 0.3) reaches the trunk: the target's validation loss at equal steps.

The machine's load (treadle.machine_load) is watched over the timed runs; a timing taken on a loaded machine is no
figure, and the table's header says so.

    python bench/draft_beside.py [--quick] [--pretrain-steps 200] [--sft-steps 100] [--time-steps 10] [--repeats 3]
                                 [--mtp-steps 100] [--prompts 8] [--max-new-tokens 64] [--out runs/bench-beside]

Results: markdown tables on stdout and ``<out>/results.json``. ``--quick`` is a smoke run of the whole pipeline
(a 4-layer width-64 target, 64-token rows, a few steps each): it checks that every row is made, not its values.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from treadle import api
from treadle.config import load_config
from treadle.data.samples import write_samples
from treadle.data.sft import encode_prompt
from treadle.machine_load import watch
from treadle.train.callbacks import Callback
from treadle.train.run import run_training

ROOT = Path(__file__).resolve().parents[1]
MTP_TARGET = ROOT / "configs" / "bench-target-mtp.toml"
DRAFT = ("--draft.kind=eagle3", "--draft.loss=kl", "--draft.gamma=4", "--draft.ttt_steps=4")
MTP_JOINT = ("--draft.kind=mtp", "--draft.target=self", "--draft.joint=true", "--draft.weight=0.3", "--draft.loss=ce",
             "--draft.ttt_steps=1", "--draft.gamma=1", "--draft.eval_prompts=2", "--draft.eval_new_tokens=8")
CORPUS = ("--data.train=builtin", "--data.val=builtin")  # the pretraining data and its validation rows
WAYS = ("stale", "catch-up", "beside")
MODES = {"T=0": 0.0, "T=1": 1.0}
DEFAULTS = dict(out=Path("runs/bench-beside"), pretrain_steps=200, sft_steps=100, time_steps=10, repeats=3,
                mtp_steps=100, prompts=8, max_new_tokens=64, chat_rows=2000, seq_len=256, batch=8, draft_vocab=2048,
                model="", threads=2)
# --quick: every stage at its smallest (explicit flags win); the model a narrow 4-layer Llama (EAGLE-3 fuses
# three of its layers) over the same tokenizer.
QUICK = dict(out=Path("runs/bench-quick-beside"), pretrain_steps=2, sft_steps=2, time_steps=3, repeats=2, mtp_steps=2,
             prompts=1, max_new_tokens=8, chat_rows=24, seq_len=64, batch=2, draft_vocab=256, threads=1,
             model="{hidden_size=64,intermediate_size=128,num_hidden_layers=4,num_attention_heads=4,"
                   "num_key_value_heads=2}")


def common(args, out: Path, steps: int, *, evals: bool = False) -> list[str]:
    """Every run's settings: the demo's lr and schedule shape, ``steps`` steps, no checkpoints; ``evals``: one
    evaluation at the end (the timed runs evaluate nothing)."""
    model = [f"--model.overrides={args.model}"] if args.model else []
    return [f"--train.output_dir={out}", f"--train.max_steps={steps}", f"--train.micro_batch_size={args.batch}",
            f"--data.seq_len={args.seq_len}", f"--train.threads={args.threads}",
            f"--train.log_every={max(1, steps // 4)}",
            f"--train.eval_every={steps if evals else 0}", "--train.eval_at_start=false",
            f"--train.eval_batches={1 if args.quick else 8}", "--schedule.warmup_proportion=0.1", "--optim.lr=2e-3",
            "--checkpoint.resume=none", "--checkpoint.every_minutes=0", "--model.compile=false",
            "--model.dtype=fp32", *model]  # auto measures per run: timings of runs in different dtypes compare nothing


def draft(args, target: str | Path, *extra: str) -> list[str]:
    """An EAGLE-3 draft against ``target`` ("self": beside the run's model): head over the ``--draft-vocab`` most
    frequent tokens, kl, an unroll as deep as the gamma-4 chain it is judged on; its own evaluation light."""
    return [*DRAFT, f"--draft.target={target}", f"--draft.vocab_size={args.draft_vocab}", "--draft.eval_prompts=2",
            "--draft.eval_new_tokens=8", *extra]


class StepClock(Callback):
    """Each step's wall seconds from its start to the end of the step's callbacks before this one: the draft's own
    update beside its target runs in one (train/cotrain.py DraftStepCallback), after the trainer's step timer."""

    def __init__(self):
        self.seconds: list[float] = []

    def on_step_start(self, trainer) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, trainer, result) -> None:
        self.seconds.append(time.perf_counter() - self.t0)


def train(argv: list[str], config: Path | None = None, clock: StepClock | None = None):
    out = Path(next(a for a in argv if a.startswith("--train.output_dir=")).split("=", 1)[1])
    shutil.rmtree(out, ignore_errors=True)  # each bench run trains from scratch
    return run_training(load_config(config, argv), live=False, callbacks=[clock] if clock else ())


def chat(args) -> list[str]:
    return [f'--data.sources=[{{name="chat",path="{args.chat_train}"}}]', "--data.val_fraction=0.05"]


def step_times(args, target: Path) -> dict:
    """Seconds per step of the target alone, with the draft beside it, and of a draft run against ``target``
    (frozen), interleaved ``--repeats`` times; the machine watched throughout."""
    ways = {"target alone": [*CORPUS], "target + draft beside": [*CORPUS, *draft(args, "self")],
            "draft run (frozen target)": [*CORPUS, *draft(args, target)]}
    seen: dict[str, list[float]] = {w: [] for w in ways}
    watching = watch()
    for r in range(args.repeats):
        for way, extra in ways.items():
            out = args.out / "timing" / f"{way.split()[-1].strip('()')}-{r}"
            clock = StepClock()
            train([*common(args, out, args.time_steps), "--checkpoint.export_hf=false", *extra], clock=clock)
            seen[way].append(statistics.median(clock.seconds[1:]))  # the first step warms up
            shutil.rmtree(out, ignore_errors=True)
    verdict = watching.verdict()
    return {"step_s": seen, "loaded": verdict.loaded, "load": verdict.why}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def timing_table(t: dict) -> list[str]:
    alone = t["step_s"]["target alone"]
    ratio = {w: [s / a for s, a in zip(v, alone)] for w, v in t["step_s"].items()}
    extra = [b - a for b, a in zip(t["step_s"]["target + draft beside"], alone)]
    state = (f"LOADED machine ({t['load']}): these timings are no figure, only the pipeline's"
             if t["loaded"] else f"quiet machine ({t['load']})")
    lines = [f"Step time, {len(alone)} interleaved repeats (each a run's median step after the first), median "
             f"(min-max); {state}", "",
             "| run | s/step | x target alone |", "|---|---|---|"]
    lines += [f"| {w} | {spread(v)} | {spread(ratio[w])} |" for w, v in t["step_s"].items()]
    # The draft's own forward and backward: a draft run's step less its target forward, taken as a third of the
    # target's training step (a forward and a backward of twice its cost).
    own = statistics.median(t["step_s"]["draft run (frozen target)"]) - statistics.median(alone) / 3
    met = statistics.median(extra) <= own
    lines += ["", f"draft beside, extra per step: {spread(extra)} s; goal: no more than the draft's own forward and "
                  f"backward, a draft run's step less a target forward (a third of the target's step): {own:.2f} s: "
                  + ("met" if met else "NOT met")]
    return lines


def held_out_prompts(args, target: Path, rows: list[dict]) -> Path:
    """The held-out chat rows rendered up to the assistant's turn, as a spec-eval prompts file."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    path = args.out / "chat-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": tokenizer.decode(encode_prompt(tokenizer, row))}) + "\n"
                            for row in rows))
    return path


def fresh_drafts(args) -> dict:
    """The target pretrained then SFT-trained, the three drafts of the module docstring, each decoded on the SFT
    target; rows of tau and the compute each way spent."""
    p, s = args.pretrain_steps, args.sft_steps
    runs = args.out
    print(f"pretraining the target {p} steps, a draft beside it ...", file=sys.stderr, flush=True)
    pre = train([*common(args, runs / "pretrain", p), *CORPUS, *draft(args, "self")])
    print(f"SFT {s} steps on the chat rows, the draft beside it ...", file=sys.stderr, flush=True)
    sft = train([*common(args, runs / "sft", s), *chat(args), f"--model.path={runs / 'pretrain' / 'hf'}",
                 *draft(args, "self"),
                 f"--draft.init={runs / 'pretrain'}", "--optim.lr=5e-4"])
    old, new = runs / "pretrain" / "hf", runs / "sft" / "hf"
    print("draft runs: before the change, stale, catch-up ...", file=sys.stderr, flush=True)
    before = train([*common(args, runs / "draft-before", p), *CORPUS, *draft(args, old)])
    stale = train([*common(args, runs / "stale", s), *CORPUS, *draft(args, old),
                   f"--draft.init={runs / 'draft-before'}"])
    catch = train([*common(args, runs / "catch-up", s), *chat(args), *draft(args, new),
                   f"--draft.init={runs / 'draft-before'}"])
    spent = {"stale": before.elapsed_s + stale.elapsed_s, "catch-up": before.elapsed_s + catch.elapsed_s,
             "beside": None}  # the beside draft's time is inside its target's steps (the timing table's extra)
    drafts = {"stale": runs / "stale" / "draft", "catch-up": runs / "catch-up" / "draft",
              "beside": runs / "sft" / "draft"}
    prompts = held_out_prompts(args, new, args.held_out)
    rows = []
    for way in WAYS:
        tau, lossless = {}, True
        for mode, temperature in MODES.items():
            got = api.spec_eval(new, drafts[way], gamma=4, prompts=prompts, num_prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens, temperature=temperature, repeats=1)
            tau[mode] = got["tau"]
            lossless = lossless and got.get("lossless") is not False
        rows.append({"way": way, "draft_steps": p + s, "target_forwards": 0 if way == "beside" else p + s,
                     "draft_run_s": spent[way], "tau": tau, "lossless": lossless})
    return {"rows": rows, "target_loss": {"pretrain": pre.last_loss, "sft": sft.last_loss}}


WHAT = {"stale": "draft run vs the pretrained target, all steps before the change",
        "catch-up": "draft run vs the pretrained target, then --draft.init vs the SFT target",
        "beside": "beside the target, pretraining then SFT"}


def fresh_table(f: dict) -> list[str]:
    lines = ["| draft | how | draft steps | extra target forwards | draft-run s | tau T=0 | tau T=1 | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in f["rows"]:
        secs = "in the target's steps" if r["draft_run_s"] is None else f"{r['draft_run_s']:.0f}"
        lines.append(f"| {r['way']} | {WHAT[r['way']]} | {r['draft_steps']} | {r['target_forwards']} | {secs} | "
                     f"{r['tau']['T=0']:.2f} | {r['tau']['T=1']:.2f} | {r['lossless']} |")
    return lines


def mtp_joint(args) -> dict:
    """configs/bench-target-mtp.toml's target, alone and with a joint MTP head, ``--mtp-steps`` each: the target's
    validation loss (the joint run's eval loss is the target's own, without the MTP term)."""
    found = {}
    for way, extra in (("no MTP loss", ()), ("MTP loss x 0.3 (joint)", MTP_JOINT)):
        out = args.out / ("mtp-joint" if "joint" in way else "mtp-alone")
        argv = [*common(args, out, args.mtp_steps, evals=True), *CORPUS, "--checkpoint.export_hf=false", *extra]
        if args.quick:  # the config's GLM-4-MoE at the narrow width (its MoE and MTP keys kept)
            argv = [a for a in argv if not a.startswith("--model.overrides=")] + [
                "--model.overrides.hidden_size=64", "--model.overrides.intermediate_size=128",
                "--model.overrides.num_hidden_layers=4",
                "--model.overrides.head_dim=16"]
        print(f"MTP target, {way}, {args.mtp_steps} steps ...", file=sys.stderr, flush=True)
        summary = train(argv, MTP_TARGET)
        found[way] = {"eval_loss": summary.last_eval["eval_loss"], "s": summary.elapsed_s}
    return found


def mtp_table(m: dict) -> list[str]:
    lines = ["| target | val loss (target's CE) | train s |", "|---|---|---|"]
    lines += [f"| {w} | {r['eval_loss']:.4f} | {r['s']:.0f} |" for w, r in m.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items() if k not in ("model", "threads"))
        + " (explicit flags win)")
    for key in ("pretrain_steps", "sft_steps", "time_steps", "repeats", "mtp_steps", "prompts", "max_new_tokens",
                "chat_rows"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int)
    parser.add_argument("--threads", type=int, help="torch threads of every run (--quick: 1, a tiny model's best)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.time_steps is not None and args.time_steps < 2:
        parser.error(f"--time-steps {args.time_steps}: must be >= 2 (the first step warms up and is not timed)")
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    rows = write_samples(args.out / "samples", n=args.chat_rows, seed=0)["chat"].read_text().splitlines()
    args.chat_train = args.out / "chat-train.jsonl"
    args.chat_train.write_text("".join(line + "\n" for line in rows[: -args.prompts]))
    args.held_out = [json.loads(line) for line in rows[-args.prompts:]]

    fresh = fresh_drafts(args)
    timing = step_times(args, args.out / "pretrain" / "hf")
    mtp = mtp_joint(args)
    size = "a 4-layer width-64 Llama" if args.quick else "the demo's tiny Llama"
    lines = [f"draft_beside bench: {size}, {args.batch} x {args.seq_len} tokens a step, EAGLE-3 draft (head "
             f"{args.draft_vocab}, kl, unroll 4); {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}, torch threads: {torch.get_num_threads()}", "",
             *timing_table(timing), "",
             f"Keeping a draft current: target pretrained {args.pretrain_steps} steps on the built-in corpus, then SFT "
             f"{args.sft_steps} steps on {len(rows) - args.prompts} chat rows; tau on the SFT target, "
             f"{args.prompts} held-out chat prompts x {args.max_new_tokens} tokens, gamma 4", "",
             *fresh_table(fresh), "",
             f"MTP joint (configs/bench-target-mtp.toml's GLM-4-MoE, {args.mtp_steps} steps each, MTP loss x 0.3):", "",
             *mtp_table(mtp)]
    print("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                       "timing": timing, "fresh": fresh, "mtp": mtp}, indent=2) + "\n")
    return 0 if all(r["lossless"] for r in fresh["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
