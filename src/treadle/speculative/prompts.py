"""Prompts for speculative-decoding evaluation: the built-in corpus' held-out split, or a JSONL file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from treadle.corpus import corpus_files, split_of
from treadle.data.jsonl import numbered_lines
from treadle.errors import UserError
from treadle.tokenizer import load_backend_tokenizer


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    """``text -> ids`` (no special tokens) for a tokenizer directory, a HF tokenizer or a ``tokenizers.Tokenizer``."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_backend_tokenizer(Path(tokenizer))
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)

    def encode(text: str) -> list[int]:
        out = backend.encode(text, add_special_tokens=False)
        return list(getattr(out, "ids", out))  # tokenizers gives an Encoding, slow HF tokenizers a list

    return encode


def _windows(ids: list[int], prompt_len: int) -> list[list[int]]:
    """Non-overlapping ``prompt_len`` windows of one document, the middle one first.

    File beginnings are mostly licence headers and module docstrings, unlike
    the code a model continues at decode time.
    """
    windows = [ids[s : s + prompt_len] for s in range(0, len(ids) - prompt_len + 1, prompt_len)]
    middle = len(windows) // 2
    return windows[middle:] + windows[:middle]


def heldout_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` tokens from the built-in corpus' val split. Deterministic.

    Windows are taken round-robin over the val files (sorted by path), so the
    prompts come from as many different files as possible.
    """
    if n < 1 or prompt_len < 1:
        raise UserError(f"held-out prompts: need n >= 1 and prompt_len >= 1, got {n} and {prompt_len}")
    encode = _encoder(tokenizer)
    per_file = [
        _windows(encode(path.read_text(encoding="utf-8")), prompt_len)
        for rel, path in corpus_files()
        if split_of(rel) == "val"
    ]
    prompts: list[list[int]] = []
    for round_ in range(max(map(len, per_file), default=0)):
        prompts += [windows[round_] for windows in per_file if round_ < len(windows)]
    if len(prompts) < n:
        raise UserError(f"held-out prompts: the val split holds only {len(prompts)} windows of {prompt_len} tokens, "
                        f"{n} requested")
    return prompts[:n]


def _row_text(line: str, where: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise UserError(f"{where}: expected a JSON object with a string field 'prompt' or 'text'")
    return text


def load_prompts_jsonl(path: str | Path, tokenizer, prompt_len_max: int) -> list[list[int]]:
    """One prompt per non-blank line of a JSONL file ("prompt", else "text" field).

    A prompt longer than ``prompt_len_max`` tokens keeps its last tokens: the
    end of a prompt is what generation continues from.
    """
    if prompt_len_max < 1:
        raise UserError(f"--prompts: the prompt length limit must be >= 1, got {prompt_len_max}")
    path = Path(path)
    try:
        lines = list(numbered_lines(path))  # split at "\n" only: U+2028 and friends are legal inside JSON strings
    except OSError as e:
        raise UserError(f"--prompts {path}: cannot read it ({e.strerror})") from None
    encode = _encoder(tokenizer)
    prompts: list[list[int]] = []
    for lineno, line in lines:
        if isinstance(line, ValueError):
            raise UserError(f"--prompts {path}:{lineno}: {line}")
        ids = encode(_row_text(line, f"{path}:{lineno}"))
        if not ids:
            raise UserError(f"{path}:{lineno}: the prompt encodes to no tokens")
        prompts.append(ids[-prompt_len_max:])
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in it (expected JSONL rows with a 'prompt' or 'text' field)")
    return prompts
