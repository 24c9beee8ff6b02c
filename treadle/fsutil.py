"""Durable, atomic file-system steps shared by everything that publishes a directory
(checkpoints, prepared shards, HF exports)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


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

    The old directory is renamed aside before the new one arrives, so ``final`` always
    names one whole version (rename(2) cannot replace a non-empty directory itself).
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
