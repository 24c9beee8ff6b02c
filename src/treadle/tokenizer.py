"""Tokenizer helpers every layer needs: a tokenizer's fingerprint (which shards and models agree) and its
``tokenizers.Tokenizer`` backend loaded without importing transformers where possible."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from treadle.errors import UserError


def _canonical_tokenizer_json(obj: dict) -> str:
    # Only the parts that decide which ids ``encode(text, add_special_tokens=False)``
    # produces (and how they decode). Truncation, padding and the post-processor
    # template are left out: transformers may rewrite them when it loads a
    # tokenizer (e.g. to add a BOS), which must not make the same tokenizer look
    # like a different one, and shards are always encoded without them.
    keep = {k: obj.get(k) for k in ("added_tokens", "normalizer", "pre_tokenizer", "model", "decoder")}
    return json.dumps(keep, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tokenizer_fingerprint(tokenizer) -> str:
    """Short sha256 identifying a tokenizer's encoding; used to catch shard/model mismatches.

    Accepts a tokenizer directory (or its ``tokenizer.json``), a
    ``tokenizers.Tokenizer``, or a transformers fast tokenizer. All three give
    the same fingerprint for the same tokenizer.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        text = load_backend_tokenizer(Path(tokenizer)).to_str()
    elif hasattr(tokenizer, "backend_tokenizer"):
        text = tokenizer.backend_tokenizer.to_str()
    elif hasattr(tokenizer, "to_str"):
        text = tokenizer.to_str()
    else:
        raise TypeError(f"tokenizer_fingerprint: cannot fingerprint {type(tokenizer).__name__}")
    canonical = _canonical_tokenizer_json(json.loads(text))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def load_backend_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` behind a HF tokenizer directory (or a tokenizer.json file).

    Reads ``tokenizer.json`` directly when present (fast, no transformers
    import: this runs in every prepare worker); otherwise lets transformers
    convert whatever the directory holds.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    json_file = path if path.is_file() else path / "tokenizer.json"
    if json_file.is_file():
        try:
            return Tokenizer.from_file(str(json_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise UserError(f"{json_file}: not a valid tokenizers JSON file ({e})") from None
    if not path.is_dir():
        raise UserError(f"tokenizer {path}: no such directory (expected a Hugging Face tokenizer directory or 'builtin')")
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise UserError(f"tokenizer {path}: cannot load it with AutoTokenizer ({e})") from None
    if not hasattr(fast, "backend_tokenizer"):
        raise UserError(f"tokenizer {path}: only fast (tokenizers-backed) tokenizers are supported")
    return fast.backend_tokenizer
