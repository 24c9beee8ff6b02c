"""Where a run's data lives on disk: a source's path entries checked and expanded to data files.

Light on purpose (no torch, no datasets): the CLI checks every data path a config names (``check_data_paths``) before
it imports the training stack, so a mistyped file is one line at once, not after seconds of imports; the run itself
expands the same entries with the same function (``data.sources.resolve``), so the two cannot disagree.
"""

from __future__ import annotations

import glob
from pathlib import Path

from treadle.errors import UserError

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def is_shard_dir(entry: str) -> bool:
    return (Path(entry).expanduser() / "meta.json").is_file()


def data_files(entry: str, key: str) -> list[Path]:
    """The data files one path entry names (a file, a directory: its data files recursively, or a glob), else one
    line naming ``key`` and the entry."""
    path = Path(entry).expanduser()
    if any(c in entry for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_FORMATS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    elif path.is_file():
        found = [path]
    else:
        raise UserError(f"{key} = {entry!r}: no such file or directory; accepted: 'builtin', a shard directory, "
                        f"or {'/'.join(FILE_FORMATS)} files (a file, a directory or a glob)")
    bad = [p for p in found if p.suffix not in FILE_FORMATS]
    if bad or not found:
        what = f"{bad[0]} is not one of {', '.join(FILE_FORMATS)}" if bad else "matches no data file"
        raise UserError(f"{key} = {entry!r}: {what}; accepted: 'builtin', a shard directory, or data files"
                        f"{_prepare_hint(entry, path, bad)}")
    return found


def _prepare_hint(entry: str, path: Path, bad: list[Path]) -> str:
    """Plain text files (.txt, .md, .py) are what `treadle prepare` turns into shards: say so."""
    from treadle.data.prepare import DIRECTORY_SUFFIXES  # numpy: only once a path is refused

    text = [p for p in (bad or (path.rglob("*") if path.is_dir() else [])) if p.suffix in DIRECTORY_SUFFIXES]
    if not text:
        return ""
    named = path.stem if path.is_file() else path.name if path.is_dir() else text[0].parent.name  # a glob: its folder
    out = f"shards/{named or 'train'}"
    return f"; plain text is tokenized into shards first: treadle prepare {entry} --out {out}, then use {out} here"


def check_tokenizer_dir(setting: str) -> Path:
    """``data.tokenizer`` set to a directory: it holds a tokenizer.json, else one line."""
    path = Path(setting).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"data.tokenizer = {setting!r} is not a tokenizer directory (no tokenizer.json); "
                        "accepted: 'auto' or a save_pretrained tokenizer directory")
    return path


def check_data_paths(cfg) -> None:
    """Every data path ``cfg`` names exists and holds data (``data.train`` or each ``data.sources`` entry,
    ``data.val`` unless ``data.val_fraction`` replaces it, ``data.tokenizer``), in the words the run would use."""
    d = cfg.data
    if cfg.draft.features and not (Path(cfg.draft.features) / "manifest.json").is_file():
        return  # speculators' offline data (or no store at all, refused by its own check): it replaces the data
    named = ([(f"data.sources[{i}] ({s.name})", s.path) for i, s in enumerate(d.sources)] if d.sources
             else [("data.train", d.train)])
    if not d.val_fraction:
        named.append(("data.val", d.val))
    for key, entries in named:
        for entry in [entries] if isinstance(entries, str) else entries:
            if entry != "builtin" and not is_shard_dir(entry):
                data_files(entry, key)
    if d.tokenizer != "auto":
        check_tokenizer_dir(d.tokenizer)
