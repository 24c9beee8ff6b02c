"""The built-in corpus and its tokenizer: everything a first run needs, no download.

The corpus is the running interpreter's own standard library (``.py`` sources).
It is on every machine that can run treadle, it is ~20-30 MB of real code with
comments and docstrings, and it is byte-for-byte fixed for a given Python build,
so tokenizers and shards built from it can be cached and shared by key.

Caching rules (they hold for the tokenizer and for the shards):

* A cache entry's name is a hash of everything that determines its content
  (Python version, the corpus file list with sizes, vocab size, format
  version, and for shards the tokenizer fingerprint). Changing any input gives
  a new entry; nothing is ever updated in place.
* An entry is built in a private temporary directory and ``os.rename``-d into
  place, so a reader sees either no entry or a complete one. If two processes
  build the same entry concurrently, the loser of the rename throws its copy
  away and uses the winner's (both are identical because training and
  tokenization are deterministic).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

# Bump when the tokenizer recipe or the shard layout changes, so stale cache
# entries are simply not found any more (rather than silently reused).
FORMAT_VERSION = 1

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.02
SPLITS = ("train", "val")

# Directories of the stdlib tree that are not the standard library itself.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """Root of treadle's cache: $TREADLE_CACHE, else $XDG_CACHE_HOME/treadle, else ~/.cache/treadle."""
    if os.environ.get("TREADLE_CACHE"):
        return Path(os.environ["TREADLE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "treadle"
    return Path.home() / ".cache" / "treadle"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_py_files() -> list[tuple[str, Path]]:
    """All stdlib ``.py`` files as (posix relpath, abs path), sorted by relpath.

    Cheap (directory walk only): used for cache keys, which must be computable
    on every run without reading 30 MB.
    """
    root = _stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend into third-party packages
        # (their presence differs between machines with the same Python).
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                # Posix relpaths: the split hash must not depend on the OS separator.
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def corpus_files() -> list[tuple[str, Path]]:
    """The built-in corpus: (relpath, abs path) of every UTF-8 stdlib ``.py`` file, sorted.

    A handful of stdlib test files are deliberately written in other encodings;
    they are skipped so that every document is valid text for the tokenizer.
    """
    return [(rel, path) for rel, path in _stdlib_py_files() if _is_utf8(path)]


def split_of(relpath: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """"train" or "val" for a corpus file, stable across processes and machines.

    Uses sha256 rather than ``hash()``, which is salted per process.
    """
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64  # uniform in [0, 1)
    return "val" if u < val_fraction else "train"


def split_files(split: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> list[Path]:
    from treadle.errors import UserError

    if split not in SPLITS:
        raise UserError(f"unknown corpus split {split!r}: expected one of {', '.join(SPLITS)}")
    return [path for rel, path in corpus_files() if split_of(rel, val_fraction) == split]


def _short_hash(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        # Length-prefix each part so ("ab", "c") and ("a", "bc") differ.
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:16]


def _corpus_key_parts() -> list[str]:
    parts = [f"format={FORMAT_VERSION}", f"python={sys.version}"]
    for rel, path in _stdlib_py_files():
        parts.append(f"{rel}:{path.stat().st_size}")
    return parts


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(files: Iterable[Path], out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE on ``files`` and save it as a HF tokenizer directory at ``out_dir``.

    Deterministic: the same files (in the same order) and vocab size give a
    byte-identical ``tokenizer.json``. Files that are not UTF-8 are skipped.
    ``out_dir`` is written directly; callers that need atomicity write into a
    temporary directory and rename it (see ``builtin_tokenizer_dir``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts: list[str] = []
    for path in files:
        try:
            texts.append(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    if not texts:
        raise ValueError("train_tokenizer: no UTF-8 text among the given files")

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code is whitespace sensitive, and encode/decode
    # must round-trip exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 byte symbols up front: any byte sequence is encodable even if
        # it never occurs in the training text.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    # Imported late: transformers costs seconds to import and is only needed to
    # write the files that AutoTokenizer.from_pretrained expects.
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def _publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a finished ``tmp`` directory to ``final``; if another process won, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        # ENOTEMPTY/EEXIST: a concurrent builder published first. Its content
        # is identical (deterministic build), so use it and drop ours.
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return final


def corpus_key(*parts: str) -> str:
    """A cache key for something built from the corpus: the corpus itself plus ``parts`` (what else decides it)."""
    return _short_hash(_corpus_key_parts() + list(parts))


def build_cached(final: Path, marker: str, build: Callable[[Path], object], what: str) -> Path:
    """``final`` if it holds ``marker``; else ``build(tmp)`` into a private directory, then published (module docstring)."""
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted run with our pid
    log.info("%s into %s", what, final)
    try:
        build(tmp)
        return _publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_builtin_tokenizer(path) -> bool:
    """Whether ``path`` is one of the built-in tokenizers' cached directories (``builtin_tokenizer_dir``); cheap:
    the corpus is not hashed again."""
    path = Path(path).absolute()
    return path.parent == cache_dir().absolute() and path.name.startswith("tokenizer-")


def builtin_tokenizer_dir(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """The built-in tokenizer (byte-level BPE on the corpus train split), trained once and cached."""
    final = cache_dir() / f"tokenizer-{corpus_key(f'vocab={vocab_size}')}"
    return build_cached(final, "tokenizer.json", lambda tmp: train_tokenizer(split_files("train"), tmp, vocab_size),
                        f"training the built-in tokenizer (vocab {vocab_size})")
