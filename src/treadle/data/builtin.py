"""The built-in corpus as shard directories: prepared on first use and cached (``treadle.corpus`` caching rules)."""

from __future__ import annotations

from pathlib import Path

from treadle import corpus
from treadle.data.prepare import prepare
from treadle.tokenizer import tokenizer_fingerprint


def builtin_shards(split: str, tokenizer_dir: Path | None = None) -> Path:
    """Prepared shard directory for one split of the built-in corpus, built on first use and cached."""
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else corpus.builtin_tokenizer_dir()
    files = corpus.split_files(split)
    key = corpus.corpus_key(f"split={split}", f"val_fraction={corpus.DEFAULT_VAL_FRACTION}",
                            f"tok={tokenizer_fingerprint(tokenizer_dir)}")
    return corpus.build_cached(corpus.cache_dir() / f"corpus-{key}" / split, "meta.json",
                               lambda tmp: prepare([str(p) for p in files], tmp, tokenizer_dir),
                               f"tokenizing the built-in corpus ({split} split, {len(files)} files)")
