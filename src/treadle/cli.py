"""``treadle train | config | prepare | samples | export | spec-eval | generate | features | report``.

Bad input ends as one line on stderr and exit code 2 (``UserError``); anything
else is a bug and keeps its traceback.

Start-up stays light: this module imports no torch, and a command's module is imported only when that command
runs (or its --help is asked for), so ``treadle --help``, ``--version``, ``treadle config`` and every config error
answer in well under a second (bench/startup.py measures it; tests/test_cli.py checks that torch stays out).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from treadle import __version__
from treadle.errors import (
    EXIT_INTERRUPTED,
    EXIT_STOPPED_RESUMABLE,
    EXIT_TRAINING_FAILED,
    EXIT_USAGE,
    CheckpointWriteError,
    TrainingFailed,
    UserError,
)
from treadle.versions import check_versions

_OVERRIDES = "[config.toml] [--section.key=value ...]"
_LOCAL_RANK = re.compile(r"^--local[_-]rank(=\d+)?$")


def _config_and_overrides(args: argparse.Namespace, options: tuple[str, ...] = ()) -> tuple[str | None, list[str]]:
    """train's and config's ``[config.toml] [--section.key=value ...]``, read from the command line in its order.

    Not from argparse: it takes an override that holds a space (``'--optim.betas=[0.9, 0.95]'``) for the config
    file, and would take the 5 of ``--train.max_steps 5`` too. ``options``: the command's own flags, skipped.
    Anything that is not an override is one line saying what to type.
    """
    words = args.argv[args.argv.index(args.command) + 1:]
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    words = [w for w in words if w not in options and not _LOCAL_RANK.match(w)]
    overrides = [w for w in words if w.startswith("-")]
    for arg in overrides:
        key, eq, value = arg.partition("=")
        if "." not in key:  # --max_steps=5: a key without its section
            from treadle.config import foreign_hint, nearest_key

            hint = foreign_hint(key, value if eq else None)  # --learning_rate=3e-4: a Hugging Face name
            if hint is not None:
                raise UserError(f"{arg} is not a treadle key; {hint}; every key: treadle config --explain")
            near = nearest_key(key.lstrip("-"))
            if near is not None and "." in near:
                raise UserError(f"{arg} names no section; did you mean --{near}={value if eq else 'VALUE'}? "
                                f"(accepted: --section.key=value; every key: treadle config --explain)")
        if not (arg.startswith("--") and "." in key):
            raise UserError(f"unexpected argument {arg!r}; accepted: {_OVERRIDES}")
        if not eq:  # `--train.max_steps 5` (a space, not '=')
            raise UserError(f"{arg} has no value; accepted: {arg}=VALUE (one argument, joined by '=')")
    files = [w for w in words if not w.startswith("-")]
    if len(files) > 1:
        raise UserError(f"unexpected argument {files[1]!r}; accepted: {_OVERRIDES} (one config file)")
    return (files[0] if files else None), overrides


def _check_paths(cfg) -> None:
    """Every path the config names (models, drafts, a store, data files, a tokenizer), checked before torch and the
    training stack load (seconds): a mistyped path is one line at once, as a mistyped key is."""
    from treadle.data.paths import check_data_paths
    from treadle.model_dirs import check_model_paths

    check_model_paths(cfg)
    check_data_paths(cfg)


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from treadle.config import load_config

    cfg = load_config(*_config_and_overrides(args))
    _check_paths(cfg)
    from treadle.train.run import run_training  # torch and the rest, once the config and its paths are good

    summary = run_training(cfg)
    if summary.rank != 0 or summary.finished_before:  # rank 0 reports; a finished run said "nothing to do"
        return EXIT_STOPPED_RESUMABLE if summary.stop_reason is not None else 0
    if summary.stop_reason is not None:
        print(f"treadle: stopped at step {summary.steps} ({summary.stop_reason}); a checkpoint is written and "
              f"the same command resumes the run (exit code {EXIT_STOPPED_RESUMABLE})", file=sys.stderr)
        return EXIT_STOPPED_RESUMABLE
    _print_summary(summary)
    return 0


def _config(args: argparse.Namespace, extra: list[str]) -> int:
    from treadle.config import load_config, to_toml

    if args.reference:  # the models' reference (docs/configuration.md), not a config
        from treadle.config.reference import reference

        if _config_and_overrides(args, ("--reference",)) != (None, []):
            raise UserError("treadle config --reference takes no config file or overrides: it documents every key")
        sys.stdout.write(reference())
        return 0
    cfg = load_config(*_config_and_overrides(args, ("--explain",)))
    if args.explain:
        print("# treadle config --explain: every key with its description, default and accepted values; a key that "
              "is\n# unset is commented out. `treadle train` reads this file as it is.\n")
    sys.stdout.write(to_toml(cfg, explain=args.explain))
    return 0


def _progress(first: dict | None, last: dict, key: str, digits: int) -> str:
    """'A at step 0 -> B at step 200', or 'B at step 200' when the run measured once."""
    end = f"{last[key]:.{digits}f} at step {last['step']}"
    return f"{first[key]:.{digits}f} at step {first['step']} -> {end}" if first and first["step"] != last["step"] else end


def _rates(values: list[float], unit: str) -> str:
    """'0.62 0.41 at positions 1..2' (a draft's rates per position or slot)."""
    where = f"{unit} 1" if len(values) == 1 else f"{unit}s 1..{len(values)}"
    return " ".join(f"{v:.2f}" for v in values) + f" at {where}"


def _draft_headline(table, s) -> None:
    """A draft run's rows before its losses: tau_sim, the chain's acceptance per position (the last acceptance eval)
    and the draft's top-1 agreement with the target per slot (the last validation eval)."""
    from treadle.metrics.agreement import per_slot, reached

    first, last = s.acceptance
    if last is not None:
        table.add_row("tau_sim", _progress(first, last, "tau_sim", 3) + " (simulated tokens per verification call)")
        accept, counts = per_slot(last, "accept"), reached(last)
        if accept:
            n = f", over {', '.join(map(str, counts))} rounds" if counts else ""
            table.add_row("acceptance", f"{_rates(accept, 'position')}, step {last['step']} "
                          f"(P(position k accepted | 1..k-1 were){n})")
    agreement = per_slot(s.last_eval or {}, "eval_acc")
    if agreement:
        eal = s.last_eval.get("eval_eal")
        table.add_row("top-1 agreement", f"{_rates(agreement, 'slot')}, step "
                      f"{s.last_eval['step']} (the draft's argmax is the target's, on the val batches"
                      + (f"; {eal:.2f} drafts accepted per block)" if eal is not None else ")"))


def _print_summary(s) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"treadle run: {s.steps} steps, {s.parameters / 1e6:.2f}M trainable parameters", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    draft = s.acceptance is not None
    if draft:  # first, what a draft's user reads: how many tokens a verification takes, and where the chain breaks
        _draft_headline(table, s)
    if s.first_loss is not None:
        table.add_row("train loss", f"{s.first_loss:.4f} (first step) -> {s.last_loss:.4f} (last step): {s.loss_label}")
    if s.last_eval is not None:
        table.add_row("val loss", _progress(s.first_eval, s.last_eval, "eval_loss", 4) + f": {s.eval_loss_label}")
        if not draft:  # a draft's eval loss is no model's per-token CE: its exp is no perplexity
            table.add_row("val perplexity", f"{math.exp(s.last_eval['eval_loss']):.2f}")
        if "eval_target_loss" in s.last_eval:  # a draft run: the frozen target's own figure, beside the draft's
            table.add_row("target val loss", f"{s.last_eval['eval_target_loss']:.4f} at step {s.last_eval['step']}: "
                          "the frozen target's cross-entropy on the data per label token")
    table.add_row("throughput", f"{s.tokens_per_s:,.0f} tokens/s ({s.tokens:,} tokens in {s.elapsed_s:.1f} s of training)")
    table.add_row("run directory", str(s.output_dir))
    table.add_row("metrics", str(s.output_dir / "metrics.jsonl"))
    where = s.checkpoints[0].parent if s.checkpoints else s.output_dir / "checkpoints"  # checkpoint.dir: anywhere
    table.add_row("checkpoints", ", ".join(p.name for p in s.checkpoints) + f" in {where}")
    if s.draft_dir is not None:  # a draft trained beside its target: the target, then its draft
        table.add_row("exported model", f"{s.export_dir} (AutoModelForCausalLM.from_pretrained)")
        table.add_row("exported draft",
                      f"{s.draft_dir} (treadle spec-eval --target {s.export_dir} --draft {s.draft_dir})")
    elif s.export_dir is not None and s.acceptance is not None and s.export_dir.name == "adapter":  # a draft's adapter
        table.add_row("exported adapter", f"{s.export_dir} (of the base draft draft.init names: treadle spec-eval "
                      f"--draft BASE --adapter {s.export_dir}; treadle export --merge for one merged draft)")
    elif s.export_dir is not None and s.acceptance is not None:
        table.add_row("exported draft", f"{s.export_dir} (treadle spec-eval --draft {s.export_dir})")
    elif s.export_dir is not None and s.export_dir.name == "adapter":  # a LoRA run (AdapterExportCallback)
        table.add_row("exported adapter", f"{s.export_dir} (PeftModel.from_pretrained; vllm serve BASE --enable-lora "
                      f"--lora-modules NAME={s.export_dir}; treadle export --merge for one merged model)")
    elif s.export_dir is not None:
        table.add_row("exported model", f"{s.export_dir} (AutoModelForCausalLM.from_pretrained)")
    Console().print(table)


def _export(args: argparse.Namespace) -> int:
    from treadle.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.source, Path(args.out), dtype=args.dtype, to=args.to, merge=args.merge,
                            base_name=args.base_name)
    print(f"exported {args.source} -> {out}")
    return 0


def _features(args: argparse.Namespace, extra: list[str]) -> int:
    """``treadle features [config.toml] [--section.key=value ...] --out DIR [--dtype D] [--shard-samples N]``: the
    config read as `treadle train` reads it, its own flags (parsed by argparse) left out."""
    from treadle.config import load_config

    own, words, skip = ("--out", "--dtype", "--shard-samples"), [], False
    for w in args.argv:
        if skip or w in own or w.split("=", 1)[0] in own:
            skip = not skip and w in own
            continue
        words.append(w)
    cfg = load_config(*_config_and_overrides(argparse.Namespace(argv=words, command=args.command)))
    # this command writes the store a draft run's draft.features will name: it need not exist yet
    _check_paths(cfg.model_copy(update={"draft": cfg.draft.model_copy(update={"features": None})}))
    from treadle.train.features import write_features

    report = write_features(cfg, Path(args.out), args.dtype, args.shard_samples)
    print(report.summary_line(), flush=True)
    return 0


def _no_extra(name: str, run):
    """A subcommand handler that refuses arguments argparse did not know (only `train` takes overrides)."""
    def handler(args: argparse.Namespace, extra: list[str]) -> int:
        if extra:
            raise UserError(f"unexpected argument {extra[0]!r} for treadle {name}")
        return run(args)
    return handler


# Commands whose module provides ``add_arguments(parser)`` and ``run(args)``, in the order `treadle --help` lists
# them after train, config and export. Each module is imported only when its command is used (``_command_module``).
_MODULE_COMMANDS = {
    "prepare": "tokenize text / JSONL into a shard directory",
    "samples": "write small chat / prompt-completion / text / prompt JSONL files from the built-in corpus",
    "spec-eval": "speculative decoding of a target with a draft: tau, acceptance, speed, lossless check",
    "generate": "answer every prompt of a JSONL file with a model: an SFT file (draft training data)",
    "features": "run a draft run's target once and store what the draft reads from it (draft.features)",
    "report": "plot runs' metrics (loss, lr, grad norm, tokens/s, tau_sim ...) into one PNG, runs overlaid",
}


def _command_module(name: str):
    # Spelled out, not importlib: tests/test_layers.py sees these imports.
    if name == "prepare":
        from treadle.data import prepare as module
    elif name == "samples":
        from treadle.data import samples as module
    elif name == "spec-eval":
        from treadle.speculative import evaluate as module
    elif name == "report":
        from treadle.metrics import report as module
    elif name == "features":  # its arguments alone: train/features.py (torch) loads once the paths are checked
        from treadle.drafts.features import cli_args as module
    else:
        from treadle.data import generate as module
    return module


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI. Only the module commands named in ``commands`` (all when None) get their arguments, which
    imports their modules: ``main`` passes the one on the command line, so `treadle train` never imports generate."""
    parser = argparse.ArgumentParser(prog="treadle", description="Train LLMs and their speculative-decoding draft models.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"treadle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a model (no config: the built-in default)", allow_abbrev=False,
        usage=f"treadle train [-h] {_OVERRIDES}",
        description="Config sources, in order: defaults, CONFIG, --section.key=value overrides.",
        epilog="Every key with its description, default and accepted values: treadle config --explain. "
               "The resolved config of a command line, without running it: treadle config [config.toml] "
               "[--section.key=value ...].")
    train.add_argument("config", nargs="?", help="TOML config file")
    train.set_defaults(func=_train)

    config = sub.add_parser(
        "config", help="print the resolved config as TOML (--explain: what each key means); runs nothing",
        allow_abbrev=False, usage=f"treadle config [-h] [--explain | --reference] {_OVERRIDES}",
        description="The config `treadle train` would run with the same arguments, as TOML it reads back: "
                    "defaults, CONFIG, --section.key=value overrides, validated the same way.")
    config.add_argument("config", nargs="?", help="TOML config file")
    config.add_argument("--explain", action="store_true",
                        help="a comment above each key: its description, default and accepted values")
    config.add_argument("--reference", action="store_true",
                        help="print the reference of every key as Markdown (docs/configuration.md is this)")
    config.set_defaults(func=_config)

    export = sub.add_parser("export", help="write a Hugging Face model directory (a draft export, a LoRA adapter) "
                            "from a checkpoint",
                            allow_abbrev=False)
    export.add_argument("source", help="run directory or checkpoint directory")
    export.add_argument("--to", choices=["auto", "hf", "draft", "speculators"], default="auto",
                        help="auto: what the checkpoint was trained as; hf: a model run; draft: a draft run's draft; "
                             "speculators: a draft run's draft in the speculators format (the kinds it defines: "
                             "eagle3, dflash, dflash2, dspark, mtp ...)")
    export.add_argument("out", help="output directory")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the floating-point weights written, recorded in config.json (default: fp32, "
                             "the weights as trained; bf16 or fp16 halve the size); a draft's vocabulary map keeps "
                             "its integer dtype")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run: the base with the adapters merged in, as a Hugging Face model directory "
                             "(default: the PEFT adapter directory alone)")
    export.add_argument("--base-name", metavar="NAME",
                        help="a LoRA adapter: the base it records (adapter_config.json base_model_name_or_path), e.g. "
                             "a hub id (default: the run's lora.base_name, else the base's absolute path)")
    export.set_defaults(func=_no_extra("export", _export))

    for name, help in _MODULE_COMMANDS.items():
        command = sub.add_parser(name, help=help, allow_abbrev=False)
        if commands is None or name in commands:
            module = _command_module(name)
            module.add_arguments(command)
            command.set_defaults(func=_features if name == "features" else _no_extra(name, module.run))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first word that is not an option (the top level has only --help and --version).
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([command] if command else [])
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    try:
        check_versions()
        return args.func(args, extra)
    except (TrainingFailed, CheckpointWriteError) as exc:  # before UserError: a full disk is not bad input
        print(f"treadle: training failed: {exc}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except UserError as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("treadle: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
