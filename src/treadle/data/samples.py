"""``treadle samples``: small SFT, pretraining and prompt files made from the built-in corpus.

They let every recipe in docs/ run with no download. The corpus is the running
Python's standard library (see ``treadle.corpus``); the rows are made from its
functions with ``ast``:

* ``chat.jsonl``    - ``{"messages": [system?, user, assistant]}``: the user asks
  for a function by signature, module and the first line of its docstring; the
  assistant answers with the function's source.
* ``pairs.jsonl``   - ``{"prompt", "completion"}``: the prompt is a function's
  ``def`` line(s) and docstring, the completion the rest of its body. The
  functions are different ones from those in ``chat.jsonl``.
* ``text.jsonl``    - ``{"text"}``: whole modules, for pretraining-style runs.
* ``prompts.jsonl`` - ``{"prompt"}``: the first lines of functions from the
  corpus *val* split, to generate from.

Rows come from library code only (test suites are skipped) of the train split,
except ``prompts.jsonl``, which uses every val-split file. The output is
deterministic: the same ``n``, ``seed`` and Python build give byte-identical
files. Each file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from treadle.corpus import EOS_TOKEN, corpus_files, split_of
from treadle.errors import UserError
from treadle.fsutil import claim_output, read_marker, write_atomic, write_marker

NAMES = ("chat", "pairs", "text", "prompts")
KIND = "samples"  # the marker's kind: the files treadle samples wrote into --out
SYSTEM_PROMPT = "You write Python."
MAX_FUNCTION_CHARS = 1500
MAX_TEXT_ROWS = 300  # whole modules are big: a few hundred are plenty for a demo
MAX_MODULE_CHARS = 64_000
PROMPT_LINES = 10
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_LINE = re.compile(r".*?(?:\r\n|\r|\n)|.+", re.S)


@dataclass(frozen=True)
class _Function:
    module: str
    name: str  # "Class.method" for methods
    args: str
    source: str  # dedented, starting at the "def" line
    doc_first_line: str  # "" when the function has no docstring
    body_line: int  # index in source lines of the first statement after the docstring; 0 if none


# --------------------------------------------------------------------------- corpus walk


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _is_test_file(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in _TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def _shuffled(rels: list[tuple[str, Path]], seed: int) -> list[tuple[str, Path]]:
    # Keyed by a hash of the path, not random.shuffle, so the order of one file
    # does not depend on which other files exist.
    def key(item: tuple[str, Path]) -> str:
        return hashlib.sha256(f"{seed}:{item[0]}".encode()).hexdigest()

    return sorted(rels, key=key)


def _parse(path: Path) -> tuple[str, ast.Module] | None:
    try:
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            # Old escape sequences in some stdlib files warn; the tree is still fine.
            warnings.simplefilter("ignore")
            return text, ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, OSError, UnicodeDecodeError):
        return None


def _defs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and methods of module-level classes (nested functions are skipped)."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, funcs):
                    yield f"{node.name}.{item.name}", item


def _split_lines(text: str) -> list[str]:
    # Line breaks as the parser counts them (not str.splitlines, which also
    # breaks at form feeds, and stdlib sources contain some).
    return _LINE.findall(text)


def _segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment(padded=True)`` on pre-split lines: the stdlib one splits
    the whole file on every call, which is quadratic over a file's functions."""
    chunk = [line.encode("utf-8") for line in lines[node.lineno - 1 : node.end_lineno]]
    if not chunk:
        return ""
    # Offsets are in UTF-8 bytes; cut the end before the start (they may share a line).
    chunk[-1] = chunk[-1][: node.end_col_offset]
    chunk[0] = b" " * node.col_offset + chunk[0][node.col_offset :]
    return b"".join(chunk).decode("utf-8")


def _function(module: str, name: str, node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> _Function | None:
    segment = _segment(lines, node)
    if not segment:
        return None
    source = textwrap.dedent(segment).rstrip() + "\n"
    # A method whose lines are not all indented past its "def" (a multi-line
    # string at column 0) does not dedent to valid top-level code.
    if not source.startswith(("def ", "async def ")) or EOS_TOKEN in source:
        return None
    doc = ast.get_docstring(node)
    first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    body_line = 0
    if first and len(node.body) > 1 and node.body[1].lineno > node.body[0].end_lineno:
        body_line = node.body[1].lineno - node.lineno
    return _Function(module, name, ast.unparse(node.args), source, first, body_line)


def _functions(files: list[tuple[str, Path]]) -> Iterator[_Function]:
    for rel, path in files:
        parsed = _parse(path)
        if parsed is None:
            continue
        text, tree = parsed
        lines = _split_lines(text)
        for name, node in _defs(tree):
            f = _function(_module_name(rel), name, node, lines)
            if f is not None:
                yield f


# --------------------------------------------------------------------------- rows


def _chat_row(f: _Function, rng: random.Random) -> dict:
    request = f"Write a Python function `{f.name}({f.args})` from module `{f.module}`: {f.doc_first_line}"
    messages = [{"role": "user", "content": request}, {"role": "assistant", "content": f.source}]
    # About a third with a system message, so both conversation shapes occur.
    if rng.random() < 1 / 3:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return {"messages": messages}


def _pair_row(f: _Function) -> dict:
    lines = f.source.splitlines(keepends=True)
    return {"prompt": "".join(lines[: f.body_line]), "completion": "".join(lines[f.body_line:])}


def _sft_rows(train: list[tuple[str, Path]], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    chat: list[dict] = []
    pairs: list[dict] = []
    for f in _functions(train):
        if len(chat) >= n and len(pairs) >= n:
            break  # stop parsing early: this is most of the run time
        if not f.doc_first_line or len(f.source) >= MAX_FUNCTION_CHARS:
            continue
        # Alternate so both files sample the whole corpus; each function goes to one file only.
        to_pairs = f.body_line > 0 and len(pairs) < n and (len(chat) >= n or len(pairs) < len(chat))
        if to_pairs:
            pairs.append(_pair_row(f))
        elif len(chat) < n:
            chat.append(_chat_row(f, rng))
    return chat, pairs


def _text_rows(train: list[tuple[str, Path]], n: int) -> list[dict]:
    rows = []
    for _, path in train:
        if len(rows) >= min(n, MAX_TEXT_ROWS):
            break
        text = path.read_text(encoding="utf-8")
        if text.strip() and len(text) <= MAX_MODULE_CHARS and EOS_TOKEN not in text:
            rows.append({"text": text})
    return rows


def _prompt_rows(val: list[tuple[str, Path]], n: int) -> list[dict]:
    rows = []
    for f in _functions(val):
        if len(rows) >= n:
            break
        lines = f.source.splitlines(keepends=True)
        if len(lines) >= 3:  # a one-liner leaves nothing to continue
            rows.append({"prompt": "".join(lines[:PROMPT_LINES])})
    return rows


# --------------------------------------------------------------------------- files


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _check_out(out_dir: Path) -> None:
    """``out_dir`` may hold anything; only the files samples writes must be absent or its own earlier ones."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise UserError(f"--out {out_dir}: not a directory (expected a new or existing directory)")
    other = read_marker(out_dir)
    if other is not None and other["kind"] != KIND:  # its marker would be replaced by ours
        raise UserError(f"--out {out_dir}: holds treadle's {other['kind']} output; choose another directory")
    for name in NAMES:
        claim_output(out_dir / f"{name}.jsonl", "--out", KIND, file=True)


def write_samples(out_dir: Path, n: int = 2000, seed: int = 0) -> dict[str, Path]:
    """Write chat/pairs/text/prompts JSONL files (at most ``n`` rows each) into ``out_dir``."""
    if n < 1:
        raise UserError(f"samples: n must be at least 1, got {n}")
    out_dir = Path(out_dir)
    _check_out(out_dir)
    files = corpus_files()
    train = _shuffled([(r, p) for r, p in files if split_of(r) == "train" and not _is_test_file(r)], seed)
    val = _shuffled([(r, p) for r, p in files if split_of(r) == "val"], seed)

    chat, pairs = _sft_rows(train, n, seed)
    rows = {"chat": chat, "pairs": pairs, "text": _text_rows(train, n), "prompts": _prompt_rows(val, n)}

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in NAMES:
        paths[name] = out_dir / f"{name}.jsonl"
        _write_jsonl(paths[name], rows[name])
    write_marker(out_dir, KIND, "samples", [p.name for p in paths.values()])  # these four, not the rest of out_dir
    return paths


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the JSONL files (created if needed)")
    parser.add_argument("--n", type=int, default=2000, help="at most this many rows per file (default: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="which functions and modules are picked (default: 0)")


def run(args: argparse.Namespace) -> int:
    paths = write_samples(args.out, n=args.n, seed=args.seed)
    for name, path in paths.items():
        with open(path, "rb") as fh:
            count = sum(1 for _ in fh)
        print(f"{name:8s} {count:6,d} rows -> {path}")
    return 0
