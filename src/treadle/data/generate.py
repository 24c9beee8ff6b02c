"""``treadle generate``: answer every row of a prompts file with a target model (draft-model training data).

Input: JSONL, one row per non-blank line, either ``{"prompt": str, ...}`` or an
SFT conversation ``{"messages": [...], ...}``, encoded for generation by
``treadle.data.sft.encode_prompt`` (a conversation loses its trailing
assistant message(s) and ends with the assistant header). Output: JSONL that is
itself an SFT file. Each output row is its input row with every field kept,
plus ``completion`` (a prompt row; an existing one is replaced) or the
conversation up to its last non-assistant message followed by
``{"role": "assistant", "content": ...}`` (a messages row), and ``index`` (the
row's 0-based position among the input's non-blank lines) and ``finish``
(``"eos"`` or ``"length"``). The generated text is the new tokens up to, not
including, the first end token, decoded with ``skip_special_tokens=True``.
End tokens are the tokenizer's eos and the special tokens that the model's
``generation_config.json`` names as eos (chat models end a turn with their own
token). The rest of ``generation_config.json`` (sampling defaults, repetition
penalties) is ignored: the data must be the model's own distribution, shaped
only by our flags.

Batches. The rows that can be generated are sorted by prompt length (then
index) and cut into batches of ``--batch-size``, left-padded. The batches depend
only on the input and the flags, never on what an earlier run finished, so a
resumed run computes exactly the batches an uninterrupted run would: a batch
some of whose rows are already done is computed whole again and only its
missing rows are written. The out file is therefore in batch order (shortest
prompts first), not input order; ``index`` says where each row came from.

Sampling (``--temperature`` > 0) is argmax(logits / T, top-p filtered, + Gumbel
noise), which is a draw from the filtered softmax, with the noise of each row
from its own generator seeded by (``--seed``, index). With the same flags a
row's output is therefore the same whether or not the run was interrupted, the
same as greedy decoding (``--temperature 0``) is. Changing ``--batch-size``
changes the padding around a row and so its floating-point rounding, which can
flip a near-tie: compare runs with the same flags.

Resumption and accounting. Every batch's rows are appended in one write,
flushed and fsynced. Before the first one, the flags that shape a row (the
model's fingerprint, ``--max-new-tokens``, ``--temperature``, ``--top-p``,
``--seed``, ``--chat-template``, ``--max-prompt-tokens``; not ``--batch-size``
or ``--device``, which change rounding, not the distribution, and a resume
after running out of memory must be able to lower the batch) are recorded in
``<out>.settings.json``. A run over an out file that holds rows refuses other
flags (each named, old -> new), and refuses an out file (or a file beside it)
that treadle generate did not write. On start, the rows already in ``--out``
are "skipped"; a torn last line (an interrupted write: no newline at the end,
or not JSON) is cut off first. Rows that cannot be generated (not JSON, not an
object, rejected by ``encode_prompt``, a prompt longer than
``--max-prompt-tokens``, or an exception while generating it alone, after its
batch failed and was retried row by row) are "failed" and listed in
``<out>.failed.jsonl`` ({"index", "line", "reason"}), rewritten by every run
(removed when a run has none). One summary line says where every row went:
succeeded + failed + skipped (+ not reached, when interrupted) == input rows.

Exit codes: 0 every row succeeded or was skipped; 1 some rows failed (the rest
are written); 2 bad input (nothing written); 130 interrupted by SIGINT /
SIGTERM: the batch in flight is abandoned, the out file holds whole rows only,
and the same command continues.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from treadle.data.generation_batches import Stop

from treadle.data.generation_files import (
    check_settings,
    claim_out,
    cut_torn_line,
    encode_rows,
    failures_path,
    read_rows,
    scan_out,
    write_failures,
    write_settings,
)
from treadle.errors import UserError

EXIT_ROWS_FAILED = 1
EXIT_INTERRUPTED = 130
_MAX_SEED = 2**32
CHAT_TEMPLATES = ("auto", "builtin")  # data.chat_template's values
DEVICES = ("auto", "cpu", "cuda")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, metavar="DIR",
                        help="Hugging Face model directory (with its tokenizer), or a treadle run directory (its hf/ export)")
    parser.add_argument("--prompts", required=True, type=Path, metavar="FILE.jsonl",
                        help="JSONL rows with a 'prompt' string or SFT 'messages'")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE.jsonl",
                        help="output JSONL (an SFT file); an existing one is continued, its rows are not generated again")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per row at most (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1.0, off)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per generate call (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed; row i draws from its own (seed, i) stream (default: 0)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longer prompts are failed rows (default: the model's context minus --max-new-tokens)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATES, default="auto",
                        help="messages rows: auto = the tokenizer's chat template if it has one, else treadle's built-in one")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="auto = cuda if available (default)")


# --------------------------------------------------------------------------- report


@dataclass
class GenerateReport:
    """Where every input row went: ``succeeded + failed + skipped + not_reached == total``."""

    total: int
    out: Path
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    not_reached: int = 0
    failed_path: Path | None = None  # None: no failed rows (and no failures file)
    torn_bytes: int = 0  # bytes of a torn last line cut from the out file before appending
    interrupted: bool = False

    def summary_line(self) -> str:
        line = (f"generate: {self.total} input rows: {self.succeeded} succeeded, {self.failed} failed, "
                f"{self.skipped} skipped (already in {self.out})")
        if self.interrupted:
            line += f", {self.not_reached} not reached (interrupted; run again to continue)"
        return line

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_ROWS_FAILED if self.failed else 0


# --------------------------------------------------------------------------- stopping


@contextmanager
def _stop_on_signals() -> Iterator[Stop]:
    from treadle.data.generation_batches import Stop

    stop = Stop()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may install handlers
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:  # a second signal: do not wait for the current step
            raise KeyboardInterrupt
        stop.signal = signal.Signals(signum).name
        print(f"treadle: generate: {stop.signal}: stopping after the current decoding step; "
              "the rows written so far are kept", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- command


def _check_args(args: _Flags) -> None:
    for flag, value, accepted in (("--chat-template", args.chat_template, CHAT_TEMPLATES), ("--device", args.device, DEVICES)):
        if value not in accepted:  # argparse's choices, for callers from Python
            raise UserError(f"{flag} {value!r}: accepted: {', '.join(accepted)}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if not args.temperature >= 0:  # also refuses nan
        raise UserError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be >= 1")
    if not 0 <= args.seed < _MAX_SEED:
        raise UserError(f"--seed {args.seed}: must be in [0, {_MAX_SEED})")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise UserError(f"--max-prompt-tokens {args.max_prompt_tokens}: must be >= 1")
    if not args.prompts.is_file():
        raise UserError(f"--prompts {args.prompts}: no such file")
    if not args.out.parent.is_dir():
        raise UserError(f"--out {args.out}: directory {args.out.parent} does not exist")
    if args.out.exists() and not args.out.is_file():
        raise UserError(f"--out {args.out}: not a regular file")
    if args.out.exists() and args.out.samefile(args.prompts):
        raise UserError(f"--out {args.out}: is the --prompts file itself; choose another output path")
    if args.device == "cuda":
        import torch  # only here: the other checks answer before torch loads

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available; accepted: --device cpu or auto")


def _prompt_limit(args: _Flags, model) -> tuple[int, str]:
    """The longest prompt accepted, and how to name that limit in a failure reason."""
    if args.max_prompt_tokens is not None:
        return args.max_prompt_tokens, f"--max-prompt-tokens {args.max_prompt_tokens}"
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context is None:
        return sys.maxsize, "no limit"
    limit = context - args.max_new_tokens
    if limit < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: leaves no room for a prompt in the model's "
                        f"context of {context} tokens")
    return limit, f"the model's context of {context} tokens minus --max-new-tokens {args.max_new_tokens} ({limit})"


def _end_tokens(tokenizer, model) -> list[int]:
    """The tokenizer's eos, then the special tokens the model's generation config names as eos.

    Chat models often end a turn with a token other than the tokenizer's eos
    (Llama 3's <|eot_id|>, Qwen's <|im_end|> / <|endoftext|>). A generation
    config naming an ordinary text token (a randomly initialised config's
    default eos 2) is not believed: cutting there would truncate text.
    """
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    configured = getattr(model.generation_config, "eos_token_id", None)
    for t in configured if isinstance(configured, (list, tuple)) else [configured]:
        if t is not None and int(t) in special and int(t) not in ids:
            ids.append(int(t))
    return ids


def _recorded_flags(args: _Flags, model_dir: Path) -> dict:
    """What shapes every row (``generation_files.FLAGS``), as recorded beside the out file."""
    from treadle.model_dirs import model_fingerprint

    return {"model": model_fingerprint(model_dir), "model_dir": str(model_dir.absolute()),
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed, "chat_template": args.chat_template, "max_prompt_tokens": args.max_prompt_tokens}


@dataclass(frozen=True)
class _Flags:
    """The command's flags, by their argparse names."""

    model: Path
    prompts: Path
    out: Path
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int
    seed: int
    max_prompt_tokens: int | None
    chat_template: str
    device: str


def run(args: argparse.Namespace) -> int:
    """The generate command; the exit code is ``GenerateReport.exit_code``."""
    report = generate(**{f.name: getattr(args, f.name) for f in fields(_Flags)})
    print(report.summary_line(), flush=True)
    if report.failed_path is not None:
        print(f"treadle: generate: the failed rows and why are in {report.failed_path}", file=sys.stderr)
    return report.exit_code


def generate(model: Path, prompts: Path, out: Path, *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, batch_size: int = 8, seed: int = 0, max_prompt_tokens: int | None = None,
             chat_template: str = "auto", device: str = "auto") -> GenerateReport:
    """Check everything (``UserError``, nothing written), then generate what ``out`` lacks.

    The keywords are the command's flags; its defaults are theirs (a test compares them).
    """
    args = _Flags(Path(model), Path(prompts), Path(out), max_new_tokens, temperature, top_p, batch_size, seed,
                  max_prompt_tokens, chat_template, device)
    _check_args(args)  # before torch and transformers load: a bad flag answers at once
    import torch
    from transformers import GenerationConfig

    from treadle.data.generation_batches import Settings, generate_rows
    from treadle.data.sft import load_tokenizer
    from treadle.model_dirs import resolve_model_dir
    from treadle.models.hf import load_causal_lm

    recorded = claim_out(args.out)
    rows = read_rows(args.prompts)
    done, torn_at = scan_out(args.out, rows, args.prompts)
    model_dir = resolve_model_dir(args.model, "--model")
    settings_now = _recorded_flags(args, model_dir)
    check_settings(args.out, recorded, settings_now)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, "--model")
    limit, limit_why = _prompt_limit(args, model)
    eos_ids = _end_tokens(tokenizer, model)
    if not eos_ids:
        raise UserError(f"--model {model_dir}: neither its tokenizer nor its generation config names an eos token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    encode_rows(rows, tokenizer, args.chat_template, limit, limit_why)

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    model.to(device)
    model.generation_config = GenerationConfig()  # the model's own defaults would reshape its distribution
    settings = Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed, pad_id, eos_ids, device)

    # Everything is checked: from here on the out file may change, and the settings go first.
    if settings_now != recorded:
        write_settings(args.out, settings_now)
    report = GenerateReport(total=len(rows), out=args.out)
    if torn_at is not None:
        report.torn_bytes = cut_torn_line(args.out, torn_at)
        print(f"treadle: generate: cut a torn last line ({report.torn_bytes} bytes, an interrupted write) from "
              f"{args.out}; its row is generated again", file=sys.stderr)
    report.skipped = len(done)
    with _stop_on_signals() as stop:
        try:
            generate_rows(model, tokenizer, rows, done, settings, args.batch_size, args.out, report, stop)
        except KeyboardInterrupt:  # a second signal mid-step: the out file holds whole lines (or one torn last one)
            stop.signal = stop.signal or "SIGINT"
    report.failed = sum(r.reason is not None and r.index not in done for r in rows)
    report.interrupted = stop.requested
    # Every row is succeeded, failed, skipped or, only after a stop, not reached.
    report.not_reached = report.total - report.succeeded - report.failed - report.skipped
    assert report.interrupted or report.not_reached == 0, report
    report.failed_path = write_failures(failures_path(args.out), [r for r in rows if r.index not in done])
    return report
