"""Shard directories: the on-disk token format every training source ends up in.

A shard directory (written by ``treadle prepare``, or by a file source's
tokenization cache) holds

* ``tokens.bin``    - every document's token ids back to back (uint16 when the
  vocabulary fits, else uint32);
* ``offsets.npy``   - int64, ``num_documents + 1`` entries: document ``d`` is
  ``tokens[offsets[d]:offsets[d+1]]``;
* ``loss_mask.bin`` - optional (SFT): one uint8 per token, 1 where the token is
  a target whose prediction carries loss (an assistant's or a completion's
  token), 0 for prompts, role headers and system text;
* ``meta.json``     - dtype, vocab size, tokenizer fingerprint, counts, and ``max_token_id`` (the largest id
  in tokens.bin, null when there is none; a run compares it with its model's vocabulary before it starts).
  Shards without it (older treadle, other tools) are still read: the loader then checks each micro-batch.

Everything is memory-mapped: a source larger than memory costs no memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from treadle.errors import UserError, first_line
from treadle.fsutil import fsync_tree

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FORMAT_VERSION = 1
KIND = "shards"  # the kind in the marker of a shard directory treadle prepared
FILES = ("tokens.bin", "offsets.npy", "loss_mask.bin", "meta.json")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest dtype holding every id of a vocabulary: ids run 0..vocab_size-1, uint16 holds 0..65535."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    # A plain ndarray view of the map: slicing a np.memmap subclass costs more than reading the tokens.
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)


# meta.json: key -> (accepted types, what it is). Ints are non-negative (vocab_size positive); optional keys
# may be null. Keys not listed are kept as they are (other writers' notes).
_REQUIRED = {"dtype": (str, "'uint16' or 'uint32'"), "num_tokens": (int, "a non-negative integer"),
             "vocab_size": (int, "a positive integer"), "tokenizer_fingerprint": (str, "a string")}
_OPTIONAL = {"format_version": (int, f"{FORMAT_VERSION}"), "num_documents": (int, "a non-negative integer"),
             "max_token_id": (int, "a non-negative integer (the largest token id in tokens.bin)"),
             "eos_id": (int, "a non-negative integer"), "tokenizer_dir": (str, "a path"),
             "loss_mask": (bool, "true or false"), "kind": (str, "a string"),
             "skipped_rows": (int, "a non-negative integer"), "skip_examples": (list, "a list")}
_EXPECTED = ("expected the JSON object `treadle prepare` writes, with dtype ('uint16' or 'uint32'), num_tokens, "
             "vocab_size and tokenizer_fingerprint")


def _fits(value, kind: type) -> bool:
    if kind is int:  # JSON true/false are Python bools, which are ints
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, kind)


def read_meta(directory: Path) -> dict:
    """A shard directory's meta.json, checked key by key; anything wrong is one ``UserError`` naming the file."""
    meta_file = Path(directory) / "meta.json"
    if not meta_file.is_file():
        raise UserError(f"{meta_file}: missing (expected a shard directory written by `treadle prepare`)")
    try:
        text = meta_file.read_bytes().decode("utf-8")
        meta = json.loads(text)
    except OSError as e:
        raise UserError(f"{meta_file}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{meta_file}: not UTF-8 text; {_EXPECTED}") from None
    except json.JSONDecodeError as e:
        what = "empty" if not text.strip() else f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        raise UserError(f"{meta_file}: {what}; {_EXPECTED}") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_file}: a JSON {type(meta).__name__}, not an object; {_EXPECTED}")
    missing = [key for key in _REQUIRED if key not in meta]
    if missing:
        raise UserError(f"{meta_file}: missing key {missing[0]!r}; {_EXPECTED}")
    for key, (kind, accepted) in (_REQUIRED | _OPTIONAL).items():
        value = meta.get(key)
        if (key in _REQUIRED or value is not None) and not _fits(value, kind):
            raise UserError(f"{meta_file}: {key} = {json.dumps(value)[:60]} is not {accepted}")
    if meta["dtype"] not in DTYPES:
        raise UserError(f"{meta_file}: dtype = {json.dumps(meta['dtype'])[:60]} is not one of {', '.join(map(repr, DTYPES))}")
    if meta["vocab_size"] == 0:
        raise UserError(f"{meta_file}: vocab_size = 0 is not a positive integer")
    if meta.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise UserError(f"{meta_file}: format_version {meta['format_version']} is not one this treadle reads "
                        f"({FORMAT_VERSION}); re-run `treadle prepare` with this version")
    return meta


def unmarked_shard_dir(path: Path) -> bool:
    """A shard directory written before they carried a marker: shard files only, meta.json with a format version."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        names = [p.name for p in path.iterdir()]
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format_version" in meta and all(n in FILES for n in names)


class Shard:
    """One validated shard directory. Its tokens (and loss mask) are memory-mapped lazily (cheap to pickle)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"shard directory {self.path}: does not exist (expected the --out of `treadle prepare`)")
        meta = read_meta(self.path)
        self.meta = meta
        self.dtype = np.dtype(DTYPES[meta["dtype"]])
        self.num_tokens = meta["num_tokens"]
        # The largest token id, recorded by treadle since it checks them against the model's vocabulary when a
        # run starts; None in shards of older versions or other tools (the loader checks every batch instead).
        self.max_token_id: int | None = meta.get("max_token_id")

        tokens_file = self.path / "tokens.bin"
        if not tokens_file.is_file():
            raise UserError(f"{tokens_file}: missing (expected {self.num_tokens} {self.dtype.name} tokens)")
        expected = self.num_tokens * self.dtype.itemsize
        actual = tokens_file.stat().st_size
        if actual != expected:
            raise UserError(
                f"{tokens_file}: {actual} bytes, expected {expected} "
                f"({self.num_tokens} {self.dtype.name} tokens per meta.json); the shard is truncated or stale"
            )

        offsets_file = self.path / "offsets.npy"
        if not offsets_file.is_file():
            raise UserError(f"{offsets_file}: missing (expected int64 document offsets)")
        try:
            offsets = np.load(offsets_file, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:  # numpy: ValueError for most damage, EOFError for an empty file
            raise UserError(f"{offsets_file}: not a readable .npy array ({first_line(e)}); "
                            f"expected int64 document offsets from 0 to num_tokens={self.num_tokens}") from None
        n_docs = meta.get("num_documents")
        if (
            offsets.ndim != 1
            or offsets.size < 1
            or not np.issubdtype(offsets.dtype, np.integer)
            or offsets[0] != 0
            or offsets[-1] != self.num_tokens
            or np.any(np.diff(offsets) < 0)
            or (n_docs is not None and offsets.size != n_docs + 1)
        ):
            raise UserError(
                f"{offsets_file}: expected non-decreasing int64 offsets from 0 to num_tokens={self.num_tokens}"
                + (f" with num_documents+1={n_docs + 1} entries" if n_docs is not None else "")
            )
        self.offsets = offsets.astype(np.int64, copy=False)
        self.has_loss_mask = bool(meta.get("loss_mask"))
        if self.has_loss_mask:
            mask_file = self.path / "loss_mask.bin"
            if not mask_file.is_file() or mask_file.stat().st_size != self.num_tokens:
                raise UserError(f"{mask_file}: missing or not {self.num_tokens} bytes (one uint8 per token, as meta.json says)")
        self._tokens: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = _map(self.path / "tokens.bin", self.dtype, self.num_tokens)
        return self._tokens

    @property
    def loss_mask(self) -> np.ndarray | None:
        """uint8 per token, 1 where the token is a target that carries loss (SFT shards); None: every token."""
        if self.has_loss_mask and self._mask is None:
            self._mask = _map(self.path / "loss_mask.bin", np.uint8, self.num_tokens)
        return self._mask

    def __getstate__(self):
        # Pickling a memmap copies its whole content; re-open it on the other side instead.
        state = dict(self.__dict__)
        state["_tokens"] = state["_mask"] = None
        return state


class ShardWriter:
    """Appends documents (and their loss masks) to a new shard directory; ``finish`` writes the index and meta.

    Used for a file source's tokenization cache, document by document, so a
    source larger than memory streams through it.
    """

    def __init__(self, directory: Path, vocab_size: int, with_loss_mask: bool):
        self.directory = Path(directory)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self._tokens = open(self.directory / "tokens.bin", "wb")
        self._mask = open(self.directory / "loss_mask.bin", "wb") if with_loss_mask else None
        self._lengths: list[int] = []
        self.num_tokens = 0
        self.max_token_id: int | None = None

    def add(self, ids, mask=None) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {self.vocab_size}")
        if ids.size:
            self.max_token_id = max(int(ids.max()), self.max_token_id or 0)
        self._tokens.write(ids.astype(self.dtype).tobytes())
        if self._mask is not None:
            self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self._lengths.append(int(ids.size))
        self.num_tokens += int(ids.size)

    def finish(self, meta: dict) -> dict:
        """Close the files, write offsets.npy and meta.json (``meta`` adds to the counts), flush to disk."""
        self._tokens.close()
        if self._mask is not None:
            self._mask.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        np.save(self.directory / "offsets.npy", offsets)
        meta = {"format_version": FORMAT_VERSION, "dtype": self.dtype.name, "vocab_size": int(self.vocab_size),
                "num_tokens": self.num_tokens, "num_documents": len(self._lengths), "max_token_id": self.max_token_id,
                "loss_mask": self._mask is not None, **meta}
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        fsync_tree(self.directory)
        return meta
