"""Durable, atomic file-system steps shared by everything that publishes a directory
(checkpoints, prepared shards, HF exports), and the one rule for paths a user names:
treadle replaces only what treadle wrote (``claim_output``)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from treadle.errors import UserError

MARKER = ".treadle.json"  # in every directory treadle exports or prepares: who wrote it, and which files


def fsync(path: Path) -> None:
    """Flush one file or directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``: do it before the rename that publishes it,
    or a crash can leave a complete-looking directory with truncated files."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync(Path(dirpath) / f)
        fsync(Path(dirpath))


def replace_dir(tmp: Path, final: Path) -> None:
    """Give the finished directory ``tmp`` the name ``final``, replacing what is there.

    Call it only after ``claim_output`` allowed replacing ``final``. The old directory is renamed aside
    before the new one arrives, so ``final`` always names one whole version (rename(2) cannot replace a
    non-empty directory itself), then deleted.
    """
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) durably: readers see the old content or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


# --------------------------------------------------------------------------- file modes


def umask() -> int:
    """This process's umask, read without changing it (os.umask can only be read by setting it, which races
    with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open`` would (0666 less the umask).

    safetensors writes through a private temporary file (mode 0600) that it renames into place: others on
    a shared file system could read an export's config but not its weights.
    """
    mode = 0o666 & ~umask()
    for dirpath, _, files in os.walk(root):
        for f in files:
            os.chmod(Path(dirpath) / f, mode)


# --------------------------------------------------------------------------- what treadle wrote


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("treadle")
    except PackageNotFoundError:
        return "unknown"


def _files(directory: Path) -> dict[str, int]:
    """Every file (or link) under ``directory`` but the marker: relative path -> size."""
    out = {}
    for dirpath, _, files in os.walk(directory):
        for f in files:
            p = Path(dirpath) / f
            rel = p.relative_to(directory).as_posix()
            if rel != MARKER:
                out[rel] = p.lstat().st_size
    return out


def write_marker(directory: Path, kind: str, command: str, files: list[str] | None = None,
                 step: int | None = None) -> None:
    """Record in ``directory`` that treadle ``command`` wrote its ``kind`` output there, naming each file
    with its size (``files``: these; default every file in it), and the training step it holds (``step``: a run's
    export). Write it last: it vouches for the rest."""
    directory = Path(directory)
    listed = _files(directory) if files is None else {f: (directory / f).lstat().st_size for f in files}
    record = {"written_by": f"treadle {command}", "version": _version(), "kind": kind, "files": listed}
    if step is not None:
        record["step"] = step
    write_atomic(directory / MARKER, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_marker(directory: Path) -> dict | None:
    """The marker of a directory treadle wrote, or None (absent, unreadable or not ours)."""
    try:
        record = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(record, dict) and str(record.get("written_by", "")).startswith("treadle ")
          and isinstance(record.get("kind"), str) and isinstance(record.get("files"), dict))
    return record if ok else None


def marked_whole(directory: Path, kind: str) -> dict | None:
    """The marker of ``directory`` when it holds treadle's ``kind`` output whole: every file the marker lists, at
    its size, and no other (None otherwise: absent, another kind, a file missing, truncated or added)."""
    marker = read_marker(directory)
    if marker is None or marker["kind"] != kind or _files(Path(directory)) != marker["files"]:
        return None
    return marker


def _foreign(path: Path, kind: str, ours: Callable[[Path], bool] | None, file: bool) -> str | None:
    """Why ``path`` is not treadle's own ``kind`` output (None: it is, or there is nothing to lose)."""
    if path.is_symlink():
        return "is a symbolic link (name the directory or file itself)"
    if not path.exists() or (ours is not None and ours(path)):
        return None
    if file:
        return _foreign_file(path, kind)
    return _foreign_dir(path, kind) if path.is_dir() else "is a file, not a directory"


def _foreign_file(path: Path, kind: str) -> str | None:
    if path.is_dir():
        return "is a directory, not a file"
    if not path.is_file():
        return "is not a regular file"
    size = path.stat().st_size
    marker = read_marker(path.parent)
    if size == 0 or (marker is not None and marker["kind"] == kind and marker["files"].get(path.name) == size):
        return None
    return f"is a file that is not treadle's own {kind} output"


def _foreign_dir(path: Path, kind: str) -> str | None:
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    marker = read_marker(path)
    if marker is None:
        return f"holds {entries[0]} and is not treadle's own {kind} output (it has no {MARKER})"
    if marker["kind"] != kind:
        return f"holds treadle's {marker['kind']} output (written by {marker['written_by']}), not a {kind} output"
    for rel, size in _files(path).items():
        if marker["files"].get(rel) != size:
            return f"holds {rel}, which treadle did not write (or which changed since)"
    return None


def claim_output(path: Path, flag: str, kind: str, ours: Callable[[Path], bool] | None = None,
                 file: bool = False) -> None:
    """Refuse (``UserError``) unless treadle may replace ``path`` with its ``kind`` output.

    The one rule for every path a user names: nothing there, an empty file or directory, or treadle's own
    earlier output of the same kind may be replaced; anything else is refused, whatever the flags (a file
    where a directory goes too, and the reverse). Treadle's own output is a directory whose marker lists
    every file in it with the size it was written with, a file listed so in its directory's marker, or what
    ``ours`` recognizes by its content (outputs written before markers, files with no directory of their
    own). ``file``: the output is a file (default: a directory).
    """
    why = _foreign(Path(path), kind, ours, file)
    if why is not None:
        raise UserError(f"{flag} {path}: {why}; treadle replaces only its own earlier output: "
                        "move it away or choose another path")
