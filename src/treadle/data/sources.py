"""Training sources: what a ``[[data.sources]]`` entry (or ``data.train``) points at, opened as a dataset.

A source's ``path`` is one or more of

* ``builtin``           - the built-in corpus (its train or val split);
* a shard directory     - the output of ``treadle prepare`` (or of this module's cache), used as it is;
* data files            - ``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` files, named one by one,
  as a directory (every such file in it, recursively, sorted) or as a glob.

Data files are read with Hugging Face ``datasets`` in streaming mode (row batches;
a file is never held in memory) and tokenized once into a shard directory in
treadle's cache (``$TREADLE_CACHE/sources/<key>``). The key covers each file's
path, size and mtime, the tokenizer's fingerprint and chat template, the format
and the row policy, so a second run reuses the shards and any change re-tokenizes.
Training then memory-maps the shards: sources larger than memory cost none.

Formats (``format = "auto"`` looks at the first row): ``text`` (a string field,
``text_field``: pre-training, packed as a token stream) and ``sft`` (``messages``
or ``prompt``/``completion``: loss on assistant / completion tokens only, packed as
whole examples; see ``treadle.data.sft``).

With ``data.val_fraction`` a source is split by document (``treadle.data.holdout``): the
dataset holds the training documents, ``held_out`` the rest, which the run evaluates on.

Bad rows (not UTF-8, not JSON, not an object, a missing or ill-typed field, no assistant
turn) stop the run with ``file:line: what is wrong`` under ``data.bad_rows =
"error"``; under ``"skip"`` they are skipped, counted in the cache's meta.json
and reported when the run starts. An empty file is a bad file either way; a
source with no usable row is always an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from treadle import corpus
from treadle.data.builtin import builtin_shards
from treadle.data.holdout import held_out
from treadle.data.jsonl import numbered_lines
from treadle.data.packed import ExampleDataset, PackedDataset
from treadle.data.paths import FILE_FORMATS, check_tokenizer_dir, data_files, is_shard_dir
from treadle.data.shards import ShardWriter, read_meta
from treadle.errors import UserError, first_line
from treadle.tokenizer import tokenizer_fingerprint

CACHE_VERSION = 3  # 2: special-token text in rows encoded as plain text; meta.json records max_token_id;
# 3: the built-in chat template rendered whole and tokenized once; meta.json records chat_template_text
_BATCH_ROWS = 1024
_REPORTED_SKIPS = 5  # skipped rows named in meta.json and on the console; the rest are counted


@dataclass
class OpenedSource:
    name: str
    dataset: PackedDataset | ExampleDataset
    kind: str  # "tokens" | "text" | "sft"
    skipped: int = 0  # rows skipped under data.bad_rows = "skip"
    skip_examples: list[str] = field(default_factory=list)
    held_out: PackedDataset | ExampleDataset | None = None  # its documents kept out of training (data.val_fraction)

    def describe(self) -> str:
        ds = self.dataset
        text = f"{self.name}: {self.kind}, {len(ds):,} samples, {ds.num_tokens:,} tokens"
        if isinstance(ds, ExampleDataset):
            s = ds.stats
            text += f", {s['examples']:,} examples ({s['truncated']} truncated, {s['dropped']} dropped: data.overlong)"
        if self.skipped:
            text += f", {self.skipped} bad rows skipped (e.g. {self.skip_examples[0]})"
        if self.held_out is not None:
            text += f", {len(self.held_out):,} samples held out for validation (data.val_fraction)"
        return text


# ----------------------------------------------------------------------------- resolving paths


def resolve(entries: list[str], split: str, key: str) -> tuple[list[Path], list[Path]]:
    """(shard directories, data files) named by a source's path entries."""
    shard_dirs, files = [], []
    for entry in entries:
        if entry == "builtin":
            shard_dirs.append(builtin_shards(split, corpus.builtin_tokenizer_dir()))
        elif is_shard_dir(entry):
            shard_dirs.append(Path(entry).expanduser())
        else:
            files += data_files(entry, key)
    if shard_dirs and files:
        raise UserError(f"{key}: mixes shard directories and data files in one source; accepted: one kind per source "
                        "(make them two sources)")
    if len({FILE_FORMATS[f.suffix] for f in files}) > 1:
        raise UserError(f"{key}: mixes file formats ({', '.join(sorted({f.suffix for f in files}))}); accepted: one format per source")
    return shard_dirs, files


# ----------------------------------------------------------------------------- reading rows


def _line_of(path: Path, row: int) -> str:
    """``path:line`` of the ``row``-th row of a JSON-lines file (blank lines hold no row), else ``path row N``."""
    if path.suffix == ".jsonl":
        for seen, (lineno, _) in enumerate(numbered_lines(path)):
            if seen == row:
                return f"{path}:{lineno}"
    return f"{path} row {row + 1}"


def _json_lines(path: Path, skip_rows: int) -> Iterator[tuple[str, object]]:
    """(where, row or what is wrong with it) line by line, after the first ``skip_rows`` rows: the exact-line
    fallback. A line that is not UTF-8 is a bad row (never read with replacement characters)."""
    for row, (lineno, line) in enumerate(numbered_lines(path)):
        if row < skip_rows:
            continue
        if isinstance(line, ValueError):
            yield f"{path}:{lineno}", line
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{lineno}", ValueError(f"not valid JSON ({_json_error(e)})")


def _json_error(e: json.JSONDecodeError) -> str:
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"  # "Invalid control character at" ends with "at"


def _is_json_lines(path: Path) -> bool:
    """A .json file holding one JSON value per line (as datasets reads it too): its first line is a whole object."""
    for _, line in numbered_lines(path):
        try:
            return isinstance(line, str) and isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            return False
    return False


def _json_document_error(path: Path, exc: Exception) -> UserError:
    """Where a .json document (not JSON lines) stops being JSON, by line: pyarrow counts 0-based rows of a batch."""
    try:
        json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        return UserError(f"{path}:{e.lineno}: not valid JSON ({_json_error(e)})")
    except ValueError as e:  # not UTF-8
        return UserError(f"{path}: not valid JSON ({first_line(e)})")
    return UserError(f"{path}: cannot be read as json ({first_line(exc)})")


def _rows(path: Path) -> Iterator[tuple[int | str, object]]:
    """(row number, or where for the fallback; row) of one data file, streamed through Hugging Face datasets.

    Rows come in batches and are never all in memory. pyarrow gives up on a JSON file at
    its first bad line (or at a field whose type changes, or at a batch holding bytes that
    are not UTF-8: a UnicodeDecodeError); a JSON-lines file is then read on line by line
    from the first row not yet given, which names exact lines.
    """
    import datasets

    from treadle.quiet import hf_quiet

    done = 0
    try:
        with hf_quiet():  # until the stream ends: the host's own settings come back then
            # datasets logs its reader's failure as an error, in pyarrow's words (0-based rows of a batch, text cut
            # off), once per read: treadle names the file and line itself (below), so only its line reaches the user.
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)
            stream = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=[str(path)], split="train", streaming=True)
            for batch in stream.iter(batch_size=_BATCH_ROWS):
                names = list(batch)
                for values in zip(*batch.values()):
                    yield done, dict(zip(names, values))
                    done += 1
    except Exception as exc:
        if path.suffix == ".json" and not _is_json_lines(path):
            raise _json_document_error(path, exc) from None
        if path.suffix not in (".jsonl", ".json"):
            raise UserError(f"{path}: cannot be read as {FILE_FORMATS[path.suffix]} ({first_line(exc)})") from None
        yield from _json_lines(path, skip_rows=done)


# ----------------------------------------------------------------------------- tokenizing into the cache


class _Encoder:
    """One row -> (token ids, loss mask or None); a ValueError names what is wrong with the row."""

    def __init__(self, kind: str, tokenizer_dir: Path, text_field: str, template: str):
        from treadle.data import sft

        self.kind, self.text_field, self.template = kind, text_field, template
        self.tokenizer = sft.load_tokenizer(tokenizer_dir)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise UserError(f"tokenizer {tokenizer_dir}: has no eos token (needed to end documents and answers)")

    def __call__(self, row: object) -> tuple[list[int], list[int] | None]:
        from treadle.data import sft

        if isinstance(row, Exception):
            raise ValueError(str(row))
        if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        if self.kind == "sft":
            return sft.encode_sft(self.tokenizer, row, self.template)
        text = row.get(self.text_field)
        if not isinstance(text, str) or not text:
            what = "missing" if text is None else ("empty" if text == "" else f"a {type(text).__name__}, not a string")
            raise ValueError(f"field {self.text_field!r} is {what} (choose the field with text_field)")
        # The text's own "<|endoftext|>" (or any special token's text) is text: documents end where rows do.
        return sft.encode_text(self.tokenizer, text) + [self.eos_id], None


def detect_format(files: list[Path], fmt: str, key: str) -> str:
    """'text' or 'sft': as configured, or from the first row of the first file that has one."""
    if fmt in ("text", "sft"):
        return fmt
    from treadle.data.sft import row_kind

    for path in files:
        for where, row in _rows(path):
            kind = row_kind(row) if isinstance(row, dict) else None
            if kind is None:
                at = where if isinstance(where, str) else _line_of(path, where)
                raise UserError(f"{at}: format = 'auto' cannot tell the format from this row (fields "
                                f"{sorted(row) if isinstance(row, dict) else type(row).__name__}); accepted: rows with "
                                "'text', 'messages' or 'prompt'/'completion', or set the source's format and text_field")
            return "sft" if kind in ("messages", "prompt_completion") else "text"
    raise UserError(f"{key}: its files hold no rows")


def _cache_key(files: list[Path], tokenizer, kind: str, text_field: str, template: str, bad_rows: str) -> str:
    h = hashlib.sha256()
    chat = getattr(tokenizer, "chat_template", None) if kind == "sft" else None
    parts = [f"v{CACHE_VERSION}", kind, text_field if kind == "text" else template, bad_rows,
             tokenizer_fingerprint(tokenizer), json.dumps(chat, sort_keys=True)]
    for f in files:
        st = f.stat()
        parts += [str(f.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    h.update("\0".join(parts).encode("utf-8"))
    return h.hexdigest()[:20]


def tokenize_files(files: list[Path], kind: str, tokenizer_dir: Path, text_field: str = "text",
                   template: str = "auto", bad_rows: str = "error", key: str = "data") -> Path:
    """The cached shard directory of ``files`` tokenized as ``kind``; built (streaming) on first use."""
    from treadle.data import sft

    encode = _Encoder(kind, tokenizer_dir, text_field, template)
    final = corpus.cache_dir() / "sources" / _cache_key(files, encode.tokenizer, kind, text_field, template, bad_rows)

    def build(tmp: Path) -> None:
        tmp.mkdir()
        writer = ShardWriter(tmp, len(encode.tokenizer), with_loss_mask=kind == "sft")
        rows = skipped = 0
        examples: list[str] = []

        def bad(where: str, reason: str) -> None:
            nonlocal skipped
            if bad_rows == "error":
                raise UserError(f"{where}: {reason} (data.bad_rows = 'skip' skips and counts such rows)")
            skipped += 1
            if len(examples) < _REPORTED_SKIPS:
                examples.append(f"{where}: {reason}")

        for path in files:
            seen = 0
            for where, row in _rows(path):
                seen += 1
                try:
                    ids, mask = encode(row)
                    if mask is not None and not any(mask):
                        raise ValueError("no token carries loss (nothing to learn from this example)")
                    writer.add(ids, mask)
                    rows += 1
                except ValueError as e:
                    bad(where if isinstance(where, str) else _line_of(path, where), str(e))
            if seen == 0:
                bad(str(path), "empty file (no rows)")
        if rows == 0:
            raise UserError(f"{key}: no usable row in {len(files)} file(s) ({skipped} skipped)")
        writer.finish({"kind": kind, "tokenizer_fingerprint": tokenizer_fingerprint(encode.tokenizer),
                       "tokenizer_dir": str(Path(tokenizer_dir).absolute()), "eos_id": encode.eos_id,
                       "files": [str(f) for f in files], "rows": rows, "skipped_rows": skipped,
                       "skip_examples": examples, "text_field": text_field, "chat_template": template,
                       # the Jinja a conversation was rendered with: the run's export gives it to the tokenizer
                       "chat_template_text": sft.chat_template_text(encode.tokenizer, template) if kind == "sft" else None})

    return corpus.build_cached(final, "meta.json", build, f"tokenizing {len(files)} file(s) of {key}")


# ----------------------------------------------------------------------------- opening a source


def file_tokenizer(setting: str, candidates: list[Path | None]) -> Path:
    """The tokenizer for data files: ``data.tokenizer``, else the first candidate holding one, else the built-in."""
    if setting != "auto":
        return check_tokenizer_dir(setting)
    for c in candidates:
        if c is not None and (Path(c) / "tokenizer.json").is_file():
            return Path(c)
    return corpus.builtin_tokenizer_dir()


def open_source(name: str, entries: list[str], split: str, fmt: str, text_field: str, seq_len: int,
                data, tokenizer: Path | None, key: str,
                resolved: tuple[list[Path], list[Path]] | None = None, val_fraction: float = 0.0) -> OpenedSource:
    """A source as a dataset: shard directories as they are, data files through the tokenization cache.

    ``data`` is the run's ``DataConfig`` (seq_len policies, bad rows, chat template); ``resolved``
    is ``resolve(entries, split, key)`` when the caller has it already. With ``val_fraction``, that
    fraction of the source's documents is held out (``holdout.held_out``): ``dataset`` is the rest.
    """
    shard_dirs, files = resolved or resolve(entries, split, key)
    if files:
        if fmt == "tokens":
            raise UserError(f"{key}: format = 'tokens' needs shard directories, got data files such as {files[0]}")
        kind = detect_format(files, fmt, key)
        shard_dirs = [tokenize_files(files, kind, tokenizer or corpus.builtin_tokenizer_dir(), text_field,
                                     data.chat_template, data.bad_rows, key)]
    else:
        metas = [read_meta(d) for d in shard_dirs]
        kind = fmt if fmt in ("sft", "text") else ("sft" if all(m.get("kind") == "sft" for m in metas) else "tokens")
    if kind == "sft":
        def make(documents=None, part=""):
            return ExampleDataset(shard_dirs, seq_len, data.overlong, documents, part)
    else:
        def make(documents=None, part=""):
            return PackedDataset(shard_dirs, seq_len, data.mask_cross_doc, documents, part)
    if val_fraction:
        @functools.cache  # both datasets ask for the mask of the same n documents: computed once
        def val(n: int):
            return held_out(n, val_fraction, key)

        dataset = make(lambda n: ~val(n), f"{key}: its training documents, data.val_fraction = {val_fraction} held out")
        held = make(val, f"{key}: the documents held out by data.val_fraction = {val_fraction}")
    else:
        dataset, held = make(), None
    meta = dataset.meta
    return OpenedSource(name, dataset, kind, int(meta.get("skipped_rows", 0)), list(meta.get("skip_examples", [])), held)
