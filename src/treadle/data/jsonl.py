"""JSON-lines files read line by line the way JSON Lines defines a line: up to each ``"\\n"``, as UTF-8.

Two traps this module exists for:

* ``str.splitlines`` (and anything built on it) also breaks at U+2028, U+2029, U+0085, form feeds and
  other characters that JSON allows raw inside strings, so it cuts such a row in two.
* Reading with ``errors="replace"`` turns bytes that are not UTF-8 into U+FFFD silently; a line that is
  not UTF-8 is reported here, by number, and the caller decides (refuse the file, or skip the row).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

_JSON_WHITESPACE = " \t\r\n"  # what JSON itself skips: a line of only these holds no row


def not_utf8(line: bytes, at: int) -> str:
    """Why a line is refused: its first byte that is not UTF-8 (``at``, 0-based) and where it is."""
    return f"not UTF-8 (byte 0x{line[at]:02x} at byte {at + 1} of the line); only UTF-8 text is accepted"


def numbered_lines(path: Path) -> Iterator[tuple[int, str | ValueError]]:
    """(1-based line number, text) of each non-blank line of ``path``, streamed; the text of a line that is not
    UTF-8 is a ``ValueError`` saying so. Lines end at ``"\\n"`` only (a trailing ``"\\r"`` is JSON whitespace)."""
    with open(path, "rb") as f:  # binary iteration splits at b"\n" and nowhere else
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, ValueError(not_utf8(raw, e.start))
                continue
            if line.strip(_JSON_WHITESPACE):
                yield lineno, line

