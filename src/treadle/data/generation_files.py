"""The files of ``treadle generate``: the prompts file read into rows, the out file scanned on resume
(a torn last line cut, rows matched to their prompts), batches appended durably, the failures file, and
the settings file that records the flags the out file was generated with.
The formats are described in ``treadle.data.generate``'s docstring."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from treadle.data.jsonl import numbered_lines
from treadle.errors import UserError
from treadle.fsutil import claim_output, write_atomic

WRITTEN_BY = "treadle generate"
# The flags that shape a row (the settings file's keys): continuing an out file with others would mix two
# distributions in one file. --batch-size and --device are not among them: they change floating-point
# rounding, not what is sampled, and a resume after running out of memory must be able to lower the batch.
FLAGS = {"model": "--model", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_p": "--top-p", "seed": "--seed", "chat_template": "--chat-template",
         "max_prompt_tokens": "--max-prompt-tokens"}


# --------------------------------------------------------------------------- input rows


@dataclass
class Row:
    index: int  # among non-blank lines
    line: int  # 1-based line number in the prompts file
    data: dict | None = None  # the parsed object; None when the line is not one
    ids: list[int] | None = None  # the encoded prompt; None when the row failed before generation
    reason: str | None = None  # why the row failed


def trimmed_messages(messages: list) -> list:
    """A conversation without its trailing assistant message(s): what is being answered."""
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end]


def read_rows(path: Path) -> list[Row]:
    try:
        # Lines end at "\n" only: str.splitlines would also split at U+2028, U+0085 and others, legal inside JSON strings.
        lines = list(numbered_lines(path))
    except FileNotFoundError:
        raise UserError(f"--prompts {path}: no such file") from None
    except OSError as e:
        raise UserError(f"--prompts {path}: cannot read it ({e.strerror})") from None
    bad = next(((lineno, line) for lineno, line in lines if isinstance(line, ValueError)), None)
    if bad is not None:  # a file in another encoding: every row would be read wrong, so none is
        raise UserError(f"--prompts {path}:{bad[0]}: {bad[1]}")
    rows = []
    for lineno, line in lines:
        row = Row(index=len(rows), line=lineno)
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            row.reason = f"not valid JSON ({e.msg})"
        else:
            if isinstance(data, dict):
                row.data = data
            else:
                row.reason = "row is not a JSON object"
        rows.append(row)
    return rows


def encode_rows(rows: list[Row], tokenizer, template: str, max_prompt_tokens: int, limit_why: str) -> None:
    from treadle.data.sft import encode_prompt

    for row in rows:
        if row.data is None:
            continue
        try:
            ids = encode_prompt(tokenizer, row.data, template)
        except ValueError as e:
            row.reason = str(e)
            continue
        if not ids:
            row.reason = "the prompt encodes to no tokens"
        elif len(ids) > max_prompt_tokens:
            row.reason = f"prompt of {len(ids)} tokens exceeds {limit_why}"
        else:
            row.ids = ids


def output_row(row: Row, text: str, finish: str) -> dict:
    out = dict(row.data)
    if "messages" in out:
        out["messages"] = trimmed_messages(out["messages"]) + [{"role": "assistant", "content": text}]
    else:
        out["completion"] = text
    out["index"] = row.index
    out["finish"] = finish
    return out


# --------------------------------------------------------------------------- the out file and the files beside it


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def failures_path(out: Path) -> Path:
    return out.with_name(out.name + ".failed.jsonl")


def read_settings(out: Path) -> dict | None:
    """The flags recorded beside ``out`` by an earlier run, or None (no settings file, or not ours)."""
    try:
        record = json.loads(settings_path(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("written_by") == WRITTEN_BY and isinstance(record.get("settings"), dict)
    return record["settings"] if ok else None


def claim_out(out: Path) -> dict | None:
    """Refuse an ``out`` (or a file beside it) that an earlier treadle generate did not write; return the
    settings that run recorded. An out file is continued, a failures file rewritten, only when they are ours."""
    recorded = read_settings(out)
    for path in (settings_path(out), out, failures_path(out)):
        claim_output(path, "--out", "generate", ours=lambda _: recorded is not None, file=True)
    return recorded


def _shown(key: str, settings: dict) -> str:
    if key == "model":
        return f"{settings.get('model_dir')} (fingerprint {settings.get('model')})"
    return json.dumps(settings.get(key))


def check_settings(out: Path, recorded: dict | None, current: dict) -> None:
    """Refuse to continue an out file that holds rows with flags other than those it was generated with."""
    if recorded is None or not out.exists() or out.stat().st_size == 0:
        return
    changed = [key for key in FLAGS if recorded.get(key) != current[key]]
    if changed:
        what = ", ".join(f"{FLAGS[k]} {_shown(k, recorded)} -> {_shown(k, current)}" for k in changed)
        raise UserError(f"--out {out} was generated with other flags ({what}, recorded in "
                        f"{settings_path(out).name}); continuing would mix two settings in one file: "
                        "pass the recorded flags to continue it, or choose a new --out")


def write_settings(out: Path, settings: dict) -> None:
    write_atomic(settings_path(out), json.dumps({"written_by": WRITTEN_BY, "settings": settings}, indent=2) + "\n")


def same_source(done: dict, row: Row) -> bool:
    """Whether an out row was generated from this input row (a guard against mixing prompts files)."""
    data = row.data
    if data is None:
        return False
    if "messages" in data:
        messages, asked = done.get("messages"), data["messages"]
        return isinstance(messages, list) and isinstance(asked, list) and messages[:-1] == trimmed_messages(asked)
    return done.get("prompt") == data.get("prompt")


def scan_out(out: Path, rows: list[Row], prompts: Path) -> tuple[set[int], int | None]:
    """(indices already in ``out``, byte offset of a torn last line to cut, or None).

    Only the last line may be torn: a write interrupted by a crash leaves a
    partial line at the end and nowhere else. Anything wrong earlier is damage
    we cannot explain, so it is reported and the file is left alone.
    """
    if not out.exists():
        return set(), None
    try:
        data = out.read_bytes()
    except OSError as e:
        raise UserError(f"--out {out}: cannot read it ({e.strerror})") from None
    pieces = data.split(b"\n")  # the last piece is b"" exactly when the file ends with a newline
    last_nonblank = max((i for i, p in enumerate(pieces) if p.strip()), default=-1)
    done: dict[int, int] = {}
    offset = 0
    for i, piece in enumerate(pieces):
        start, offset = offset, offset + len(piece) + 1
        if not piece.strip():
            continue
        lineno = i + 1
        complete = i < len(pieces) - 1
        try:
            obj = json.loads(piece)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if i == last_nonblank and (not complete or obj is None):
            return set(done), start
        if obj is None:
            raise UserError(f"--out {out} line {lineno}: not valid JSON, and not the last line (an interrupted "
                            "write only tears the last one); repair or move the file")
        index = obj.get("index") if isinstance(obj, dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            raise UserError(f"--out {out} line {lineno}: not a treadle generate row (no integer 'index')")
        if not 0 <= index < len(rows):
            raise UserError(f"--out {out} line {lineno}: index {index}, but --prompts {prompts} has only "
                            f"{len(rows)} rows; was --out written from another prompts file? (use a new --out)")
        if index in done:
            raise UserError(f"--out {out} lines {done[index]} and {lineno}: both hold index {index}; "
                            "remove one of them")
        if not same_source(obj, rows[index]):
            raise UserError(f"--out {out} line {lineno}: its row (index {index}) does not match --prompts "
                            f"{prompts} line {rows[index].line}; was --out written from another prompts file? "
                            "(use a new --out)")
        done[index] = lineno
    return set(done), None


def cut_torn_line(out: Path, offset: int) -> int:
    """Truncate ``out`` to ``offset`` (durably); the number of bytes removed."""
    size = out.stat().st_size
    with open(out, "r+b") as f:
        f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())
    return size - offset


def json_line(row: dict) -> str:
    # UTF-8 as is, except the line separators JSON leaves raw in strings (U+0085, U+2028, U+2029): readers
    # that split lines with str.splitlines would cut a row there.
    text = json.dumps(row, ensure_ascii=False)
    return text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


def append_rows(f, rows: list[dict]) -> None:
    # One write of whole lines per batch, made durable before the next batch starts.
    f.write("".join(map(json_line, rows)).encode("utf-8"))
    f.flush()
    os.fsync(f.fileno())


def write_failures(path: Path, rows: list[Row]) -> Path | None:
    """Rewrite the failures file (atomically); remove a stale one when nothing failed."""
    failed = [r for r in rows if r.reason is not None]
    if not failed:
        path.unlink(missing_ok=True)
        return None
    write_atomic(path, "".join(json_line({"index": r.index, "line": r.line, "reason": r.reason}) for r in failed))
    return path
