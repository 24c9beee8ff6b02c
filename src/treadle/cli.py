"""``treadle train | prepare | samples | export | spec-eval | generate``.

Bad input ends as one line on stderr and exit code 2 (``UserError``); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from treadle.errors import EXIT_USAGE, UserError


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from treadle.config import load_config
    from treadle.train.run import run_training

    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    extra = [a for a in extra if not re.match(r"^--local[_-]rank(=\d+)?$", a)]
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if bad:
        raise UserError(f"unexpected argument {bad[0]!r}; accepted: [config.toml] [--section.key=value ...]")
    # `--train.max_steps 5` (a space, not '='): argparse would take 5 for the config file.
    valueless = [a for a in extra if "=" not in a]
    if valueless:
        raise UserError(f"{valueless[0]} has no value; accepted: {valueless[0]}=VALUE (one argument, joined by '=')")
    from treadle.train.resilience import EXIT_STOPPED_RESUMABLE

    cfg = load_config(args.config, extra)
    summary = run_training(cfg)
    if summary.rank != 0:  # under a launcher every rank returns the same summary: rank 0 reports it
        return EXIT_STOPPED_RESUMABLE if summary.stop_reason is not None else 0
    if summary.stop_reason is not None:
        print(f"treadle: stopped at step {summary.steps} ({summary.stop_reason}); a checkpoint is written and "
              f"the same command resumes the run (exit code {EXIT_STOPPED_RESUMABLE})", file=sys.stderr)
        return EXIT_STOPPED_RESUMABLE
    _print_summary(summary)
    return 0


def _print_summary(s) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"treadle run: {s.steps} steps, {s.parameters / 1e6:.2f}M trainable parameters", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    if s.first_loss is not None:
        table.add_row("train loss", f"{s.first_loss:.4f} (first step) -> {s.last_loss:.4f} (last step)")
    if s.last_eval is not None:
        first = s.first_eval
        start = f"{first['eval_loss']:.4f} at step {first['step']} -> " if first and first is not s.last_eval else ""
        table.add_row("val loss", f"{start}{s.last_eval['eval_loss']:.4f} at step {s.last_eval['step']}")
        table.add_row("val perplexity", f"{math.exp(s.last_eval['eval_loss']):.2f}")
    if s.acceptance is not None and s.acceptance[1] is not None:
        first, last = s.acceptance
        table.add_row("tau_sim", f"{first['tau_sim']:.3f} at step {first['step']} -> {last['tau_sim']:.3f} at step "
                                 f"{last['step']} (simulated tokens per verification call)")
    table.add_row("throughput", f"{s.tokens_per_s:,.0f} tokens/s ({s.tokens:,} tokens in {s.elapsed_s:.1f} s of training)")
    table.add_row("run directory", str(s.output_dir))
    table.add_row("metrics", str(s.output_dir / "metrics.jsonl"))
    table.add_row("checkpoints", ", ".join(p.name for p in s.checkpoints) + f" in {s.output_dir / 'checkpoints'}")
    if s.export_dir is not None and s.acceptance is not None:
        table.add_row("exported draft", f"{s.export_dir} (treadle spec-eval --draft {s.export_dir})")
    elif s.export_dir is not None:
        table.add_row("exported model", f"{s.export_dir} (AutoModelForCausalLM.from_pretrained)")
    Console().print(table)


def _export(args: argparse.Namespace) -> int:
    from treadle.checkpoint.export import export_checkpoint

    out = export_checkpoint(Path(args.source), Path(args.out), dtype=args.dtype, to=args.to)
    print(f"exported {args.source} -> {out}")
    return 0


def _no_extra(name: str, run):
    """A subcommand handler that refuses arguments argparse did not know (only `train` takes overrides)."""
    def handler(args: argparse.Namespace, extra: list[str]) -> int:
        if extra:
            raise UserError(f"unexpected argument {extra[0]!r} for treadle {name}")
        return run(args)
    return handler


def _module_command(sub, name: str, module, help: str) -> None:
    """A subcommand whose module provides ``add_arguments(parser)`` and ``run(args)``."""
    parser = sub.add_parser(name, help=help, allow_abbrev=False)
    module.add_arguments(parser)
    parser.set_defaults(func=_no_extra(name, module.run))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description="Train LLMs and their speculative-decoding draft models.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (no config: the built-in default)", allow_abbrev=False,
                           description="Config sources, in order: defaults, CONFIG, --section.key=value overrides.")
    train.add_argument("config", nargs="?", help="TOML config file")
    train.set_defaults(func=_train)

    from treadle.data import generate
    from treadle.data import prepare, samples
    from treadle.speculative import evaluate

    _module_command(sub, "prepare", prepare, "tokenize text / JSONL into a shard directory")
    _module_command(sub, "samples", samples, "write small chat / prompt-completion / text / prompt JSONL files from the built-in corpus")

    export = sub.add_parser("export", help="write a Hugging Face model directory (or a draft export) from a checkpoint",
                            allow_abbrev=False)
    export.add_argument("source", help="run directory or checkpoint directory")
    export.add_argument("--to", choices=["auto", "hf", "draft"], default="auto",
                        help="auto: what the checkpoint was trained as; hf: a model run; draft: a draft run's draft")
    export.add_argument("out", help="output directory")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    export.set_defaults(func=_no_extra("export", _export))

    _module_command(sub, "spec-eval", evaluate, "speculative decoding of a target with a draft: tau, acceptance, speed, lossless check")
    _module_command(sub, "generate", generate, "answer every prompt of a JSONL file with a model: an SFT file (draft training data)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from treadle.checkpoint.manager import CheckpointWriteError
    from treadle.train.resilience import EXIT_TRAINING_FAILED, TrainingFailed

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        return args.func(args, extra)
    except (TrainingFailed, CheckpointWriteError) as exc:  # before UserError: a full disk is not bad input
        print(f"treadle: training failed: {exc}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except UserError as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("treadle: interrupted", file=sys.stderr)
        return 130
