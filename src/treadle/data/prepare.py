"""``treadle prepare``: tokenize text files into a shard directory.

Inputs are files, directories and glob patterns:

* a **file** named explicitly (or matched by a glob) is always taken;
* a **directory** is searched recursively for files ending in
  ``.txt .md .py .jsonl .json`` (hidden files and directories, i.e. names
  starting with ".", and ``__pycache__`` are skipped);
* every input must match at least one file.

A ``.jsonl`` file holds one JSON object per line and each object is one
document, its text in ``obj[text_field]`` (blank lines are ignored). Any other
file (``.json`` included) is one document: its whole UTF-8 text.

The output directory holds

* ``tokens.bin``  - every document's token ids back to back (uint16 when the
  vocabulary fits, i.e. ``len(tokenizer) <= 65536``, else uint32), each
  followed by the tokenizer's eos id unless ``--no-eos``;
* ``offsets.npy`` - int64, ``num_documents + 1`` entries: document ``d`` is
  ``tokens[offsets[d]:offsets[d+1]]`` and the last entry is ``num_tokens``;
* ``meta.json``   - dtype, vocab size, tokenizer fingerprint, counts and ``max_token_id`` (the largest id
  written, null for an empty output).

Special-token text inside a document (``<|endoftext|>``, ``<|im_end|>``) is
encoded as the plain characters it is made of, never as the special token: a
document ends where its file or JSONL row ends, and only there does the eos go.
A corpus that marks document boundaries with a literal ``<|endoftext|>`` inside
one file should be split into files or rows (one document each) first.

Determinism: files are deduplicated and sorted, and chunk results are
reassembled in input order, so the output is byte-identical whatever the
number of threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import numpy as np

from treadle.data.jsonl import not_utf8, numbered_lines
from treadle.data.sft import row_kind
from treadle.data.shards import FORMAT_VERSION, KIND, token_dtype, unmarked_shard_dir
from treadle.errors import UserError
from treadle.fsutil import claim_output, fsync_tree, replace_dir, write_marker

log = logging.getLogger(__name__)

DIRECTORY_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".json")
_GLOB_CHARS = set("*?[")
# Aim for several chunks per worker so one slow chunk does not leave the
# others idle at the end, but keep chunks big enough that the per-task
# overhead (a thread hand-off, a batch call into the tokenizer) stays small.
_CHUNKS_PER_WORKER = 8
_MIN_CHUNK_BYTES = 256 << 10


# --------------------------------------------------------------------------- helpers


def _is_wanted(path: Path) -> bool:
    return path.suffix in DIRECTORY_SUFFIXES


def _walk_dir(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and _is_wanted(path):
                found.append(path)
    return found


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Expand files, directories and globs into a sorted, deduplicated list of absolute file paths."""
    if not inputs:
        raise UserError("prepare: no inputs given (expected files, directories or glob patterns)")
    files: set[Path] = set()
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_file():
            matched = [path]
        elif path.is_dir():
            matched = _walk_dir(path)
            if not matched:
                raise UserError(
                    f"input directory {spec}: holds no files ending in {' '.join(DIRECTORY_SUFFIXES)}"
                )
        elif _GLOB_CHARS & set(spec):
            matched = []
            for hit in sorted(glob.glob(str(path), recursive=True)):
                hit_path = Path(hit)
                matched.extend(_walk_dir(hit_path) if hit_path.is_dir() else [hit_path])
            if not matched:
                raise UserError(f"input pattern {spec!r}: matches no files")
        else:
            raise UserError(f"input {spec}: no such file or directory (expected a file, a directory or a glob pattern)")
        files.update(p.resolve() for p in matched)
    return sorted(files, key=str)


def _chunk(files: list[Path], workers: int) -> list[list[Path]]:
    """Split the (ordered) file list into contiguous chunks of roughly equal byte size."""
    sizes = [f.stat().st_size for f in files]
    target = max(_MIN_CHUNK_BYTES, sum(sizes) // max(1, workers * _CHUNKS_PER_WORKER))
    chunks, current, current_bytes = [], [], 0
    for f, size in zip(files, sizes):
        current.append(f)
        current_bytes += size
        if current_bytes >= target:
            chunks.append(current)
            current, current_bytes = [], 0
    if current:
        chunks.append(current)
    return chunks


# --------------------------------------------------------------------------- worker side
# Chunks are tokenized on threads of the calling process, never in child processes. A process pool has to
# start its children with spawn (the parent holds torch/tokenizers thread pools a fork would copy mid-lock),
# and spawn re-imports the caller's ``__main__``: a notebook or a short script without an
# ``if __name__ == "__main__":`` guard then dies with BrokenProcessPool. Threads lose nothing here: the time
# goes to tokenizers' Rust batch encoding, which releases the GIL (the built-in corpus, 31 MB, took as long on
# 2 threads as on 2 spawned processes: docs/architecture.md, "Data preparation").

_local = threading.local()


def _tokenizer(tokenizer_dir: str):
    """This thread's tokenizer (one each: a thread never waits on another's encoder)."""
    tok = getattr(_local, "tokenizers", {}).get(tokenizer_dir)
    if tok is None:
        from treadle.tokenizer import load_backend_tokenizer

        tok = load_backend_tokenizer(Path(tokenizer_dir))
        # Text is text: a document that quotes "<|endoftext|>" (code about tokenizers, a chat log) keeps those
        # characters; documents end where files and rows end, with the eos appended below.
        tok.encode_special_tokens = True
        _local.tokenizers = {**getattr(_local, "tokenizers", {}), tokenizer_dir: tok}
    return tok


def _whole_file(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{lineno}: {not_utf8(raw[line_start:], e.start - line_start)}") from None


def _read_documents(path: Path, text_field: str) -> list[str]:
    if path.suffix != ".jsonl":
        return [_whole_file(path)]
    docs = []
    try:
        lines = list(numbered_lines(path))  # lines end at "\n" only: U+2028 and friends are legal inside strings
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    for lineno, line in lines:
        if isinstance(line, ValueError):
            raise UserError(f"{path}:{lineno}: {line}") from None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}:{lineno}: malformed JSON ({e.msg}); expected one JSON object per line "
                f"with a string field {text_field!r}"
            ) from None
        kind = row_kind(obj) if isinstance(obj, dict) and text_field not in obj else None
        if kind in ("messages", "prompt_completion"):
            # SFT needs a chat template and a loss mask, which a run applies when it reads the file itself.
            raise UserError(
                f"{path}:{lineno}: an SFT row ({'messages' if kind == 'messages' else 'prompt/completion'}); treadle "
                f"prepare makes pre-training shards from text, SFT files are trained from directly (tokenized once "
                f"into treadle's cache): data.train = [\"{path}\"] or [[data.sources]] path = \"{path}\""
            )
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            what = "not a JSON object" if not isinstance(obj, dict) else (
                f"field {text_field!r} is missing" if text_field not in obj
                else f"field {text_field!r} is {type(obj[text_field]).__name__}, not a string"
            )
            raise UserError(
                f"{path}:{lineno}: {what}; expected a JSON object with a string field {text_field!r} "
                f"(choose the field with --text-field)"
            )
        docs.append(obj[text_field])
    return docs


def _tokenize_chunk(tokenizer_dir: str, files: list[str], text_field: str, eos_id: int | None, vocab_size: int):
    """Tokenize one chunk of files; returns (tokens uint32, per-document lengths int64, n_empty)."""
    docs: list[str] = []
    for f in files:
        docs.extend(_read_documents(Path(f), text_field))
    n_empty = sum(1 for d in docs if not d)
    docs = [d for d in docs if d]
    encodings = _tokenizer(tokenizer_dir).encode_batch_fast(docs, add_special_tokens=False) if docs else []
    extra = 1 if eos_id is not None else 0
    lengths = np.fromiter((len(e.ids) + extra for e in encodings), dtype=np.int64, count=len(encodings))
    tokens = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for enc in encodings:
        n = len(enc.ids)
        tokens[pos : pos + n] = enc.ids
        pos += n
        if eos_id is not None:
            tokens[pos] = eos_id
            pos += 1
    if tokens.size and int(tokens.max()) >= vocab_size:
        # The dtype and every model embedding are sized from vocab_size; an id
        # past it would be silently truncated or crash much later in training.
        raise UserError(f"tokenizer produced id {int(tokens.max())} >= its vocabulary size {vocab_size}")
    return tokens, lengths, n_empty


# --------------------------------------------------------------------------- main entry


def _check_out(out: Path, overwrite: bool) -> None:
    """Only treadle's own shard directory may be replaced, and only with --overwrite: runs may be reading it."""
    claim_output(out, "--out", KIND, ours=unmarked_shard_dir)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: directory exists and is not empty: it holds an earlier treadle prepare "
                        "output (pass --overwrite to replace it)")


def _declared_eos(tokenizer_dir: Path) -> str | None:
    """The eos token string declared by tokenizer_config.json / special_tokens_map.json, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((tokenizer_dir / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):  # serialized AddedToken
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def _load_tokenizer_info(tokenizer_dir: Path):
    """(len(tokenizer), eos id or None, fingerprint) as transformers would see the tokenizer."""
    from treadle.tokenizer import load_backend_tokenizer, tokenizer_fingerprint

    backend = load_backend_tokenizer(tokenizer_dir)  # raises a UserError for a bad directory
    fingerprint = tokenizer_fingerprint(backend)
    # Fast path (no transformers import, which costs seconds): a tokenizer.json
    # plus a config naming an eos token that the vocabulary contains. This is
    # what transformers itself reads for fast tokenizers.
    eos = _declared_eos(tokenizer_dir) if tokenizer_dir.is_dir() else None
    if (tokenizer_dir / "tokenizer.json").is_file() and eos is not None and backend.token_to_id(eos) is not None:
        return backend.get_vocab_size(with_added_tokens=True), backend.token_to_id(eos), fingerprint
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return len(hf), hf.eos_token_id, fingerprint
    except Exception:
        # A bare tokenizer.json without a tokenizer_config.json: no declared eos.
        return backend.get_vocab_size(with_added_tokens=True), None, fingerprint


def prepare(
    inputs: list[str],
    out: Path,
    tokenizer_dir: Path,
    text_field: str = "text",
    workers: int | None = None,
    overwrite: bool = False,
    append_eos: bool = True,
) -> dict:
    """Tokenize ``inputs`` into the shard directory ``out``; returns the meta dict written there.

    Nothing at ``out`` is touched unless the whole output was produced: it is
    built in ``out.parent/.tmp-<name>-<pid>`` and renamed into place.
    """
    out = Path(out).expanduser().absolute()
    tokenizer_dir = Path(tokenizer_dir).expanduser().absolute()
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    if workers < 1:
        raise UserError(f"--workers {workers}: expected a positive number of tokenizer threads")

    # All validation happens before anything is written.
    _check_out(out, overwrite)
    files = resolve_inputs(list(inputs))
    vocab_size, eos_id, fingerprint = _load_tokenizer_info(tokenizer_dir)
    if append_eos and eos_id is None:
        raise UserError(f"tokenizer {tokenizer_dir}: has no eos token to append after documents (pass --no-eos)")
    dtype = token_dtype(vocab_size)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted run with our pid
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"--out {out}: cannot write in {out.parent} ({e.strerror})") from None

    try:
        chunks = _chunk(files, workers)
        workers = min(workers, len(chunks))
        all_lengths: list[np.ndarray] = []
        num_tokens = num_skipped = 0
        max_token_id = None
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="treadle-prepare") as pool, \
                open(tmp / "tokens.bin", "wb") as fout:
            futures = [
                pool.submit(_tokenize_chunk, str(tokenizer_dir), [str(f) for f in chunk], text_field,
                            eos_id if append_eos else None, vocab_size)
                for chunk in chunks
            ]
            try:
                # Consume in submission order: the output is the input order,
                # however the chunks were scheduled.
                for fut in futures:
                    tokens, lengths, n_empty = fut.result()
                    fout.write(tokens.astype(dtype, copy=False).tobytes())
                    all_lengths.append(lengths)
                    num_tokens += int(tokens.size)
                    num_skipped += n_empty
                    if tokens.size:
                        max_token_id = max(int(tokens.max()), max_token_id or 0)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise

        lengths = np.concatenate(all_lengths) if all_lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        assert offsets[-1] == num_tokens
        np.save(tmp / "offsets.npy", offsets)
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": int(vocab_size),
            "tokenizer_fingerprint": fingerprint,
            "tokenizer_dir": str(tokenizer_dir),
            "num_tokens": int(num_tokens),
            "num_documents": int(len(lengths)),
            "max_token_id": max_token_id,
            "num_skipped_empty": int(num_skipped),
            "sources": len(files),
            "eos_id": None if eos_id is None else int(eos_id),
            "append_eos": bool(append_eos),
            "text_field": text_field,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        write_marker(tmp, KIND, "prepare")
        fsync_tree(tmp)
        try:
            replace_dir(tmp, out)  # --overwrite was checked earlier; the old output is never half-replaced
        except OSError as e:
            raise UserError(f"--out {out}: cannot create it ({e.strerror}); another process may have written it") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="files, directories (searched for " + " ".join(DIRECTORY_SUFFIXES) + ") or glob patterns")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output shard directory (must be new or empty)")
    parser.add_argument("--tokenizer", default="builtin", metavar="DIR|builtin",
                        help="Hugging Face tokenizer directory, or 'builtin' for treadle's own (default)")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the document text (default: text)")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer threads (default: min(4, cpus))")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shard directory an earlier treadle prepare wrote at --out (never anything else)")
    parser.add_argument("--no-eos", dest="append_eos", action="store_false", help="do not append eos after each document")


def run(args: argparse.Namespace) -> int:
    if args.tokenizer == "builtin":
        from treadle.corpus import builtin_tokenizer_dir

        tokenizer_dir = builtin_tokenizer_dir()
    else:
        tokenizer_dir = Path(args.tokenizer)
    meta = prepare(
        args.inputs, args.out, tokenizer_dir,
        text_field=args.text_field, workers=args.workers,
        overwrite=args.overwrite, append_eos=args.append_eos,
    )
    print(
        f"prepared {meta['num_documents']:,} documents ({meta['num_skipped_empty']:,} empty skipped) "
        f"from {meta['sources']:,} files: {meta['num_tokens']:,} tokens, {meta['dtype']} -> {Path(args.out)}"
    )
    return 0
