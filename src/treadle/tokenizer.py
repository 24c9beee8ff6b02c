"""Tokenizer helpers every layer needs: a tokenizer's fingerprint (which shards and models agree) and its
``tokenizers.Tokenizer`` backend loaded without importing transformers where possible."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------- special ids a model states

ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_ids(tokenizer_dir) -> dict[str, int | None]:
    """The bos / eos / pad ids of the tokenizer in ``tokenizer_dir`` (None: it has no such token), as transformers
    reads them: what the tokenizer exported beside a model reports, which the model's configs must match."""
    from transformers import AutoTokenizer

    from treadle.quiet import hf_quiet

    try:
        with hf_quiet():
            tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer is one line
        raise UserError(f"tokenizer {tokenizer_dir}: cannot load it with AutoTokenizer ({e})") from None
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def stated_ids(current: dict, ids: dict, generation: bool) -> dict:
    """The bos / eos / pad entries a model's ``config.json`` (``generation=False``) or ``generation_config.json``
    states for a tokenizer with ``ids`` (only the keys known; the shards alone know the eos), given what the file
    holds now (``current``).

    - A list of eos ids (a chat model ending on its turn token or its document token) is kept when the tokenizer's
      eos is among them; anything else gives way to the tokenizer's.
    - ``config.json`` states no pad that is the eos or bos: transformers builds the input embedding with
      ``padding_idx = pad_token_id``, and ``torch.nn.Embedding`` never updates that row, so a pad shared with the
      eos would freeze the eos embedding in every later training of the export. ``generation_config.json`` states
      the pad as it is (``generate`` pads finished rows with it).
    """
    out = {}
    for key, value in ids.items():
        held = current.get(key)
        if key == "eos_token_id" and isinstance(held, list) and value in held:
            value = held
        elif key == "pad_token_id" and not generation and value is not None and value in (
                ids.get("eos_token_id"), ids.get("bos_token_id")):
            value = None
        out[key] = value
    return out


@dataclass
class RunTokenizer:
    """The tokenizer a run's data was made with, which a model built for the run must agree with."""

    size: int  # its vocabulary: every id in the data is below it
    directory: Path | None = None  # None: not at hand (shards whose tokenizer is gone, a model built in Python)
    eos_id: int | None = None  # the shards' eos, known without the directory

    @classmethod
    def from_meta(cls, meta: dict) -> RunTokenizer:
        """From what a run records (its meta, a checkpoint's)."""
        directory = meta.get("tokenizer_dir")
        return cls(meta["vocab_size"], Path(directory) if directory and Path(directory).is_dir() else None,
                   meta.get("eos_id"))

    @functools.cached_property
    def ids(self) -> dict:
        """bos / eos / pad (ID_KEYS) from its directory; without one, only the eos the shards know (or nothing)."""
        if self.directory is not None:
            return special_ids(self.directory)
        return {} if self.eos_id is None else {"eos_token_id": self.eos_id}

    def describe(self) -> str:
        """Its name for the run's lines."""
        from treadle.corpus import is_builtin_tokenizer

        if self.directory is None:
            name = "the data's tokenizer (its directory is not at hand)"
        else:
            name = "the built-in tokenizer" if is_builtin_tokenizer(self.directory) else f"tokenizer {self.directory}"
        return f"{name} ({self.size:,} tokens)"
