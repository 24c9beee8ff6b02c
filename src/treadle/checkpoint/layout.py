"""The file-system steps of a checkpoints directory: names (``step_<N>``, writers' ``.tmp-*``), durable
writes, atomic exchange, listing and links. Invariants are stated in ``treadle.checkpoint.manager``."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path

from treadle.checkpoint.remote import COMMITTED, RemotePath

STEP_DIR = re.compile(r"^step_(\d+)$")
HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
TMP_NAME = re.compile(r"^\.tmp-(?P<what>[^.]+)\.(?P<pid>\d+)@(?P<host>[^.]+)\.(?P<token>[0-9a-f]{8})$")


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path | RemotePath) -> None:
    if isinstance(path, RemotePath):
        path.remove()
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def tmp_name(what: str) -> str:
    """A temporary name that says which process owns it, so start-up can tell abandoned from live."""
    return f".tmp-{what}.{os.getpid()}@{HOST}.{uuid.uuid4().hex[:8]}"


def abandoned(name: str) -> bool:
    """A temporary entry of ours whose writer is gone. Other ``.tmp-*`` names (an HF export's) are not ours."""
    m = TMP_NAME.match(name)
    if m is None:
        return False
    if m["host"] != HOST:
        return False  # another machine's writer on a shared file system: we cannot tell, so leave it
    pid = int(m["pid"])
    if pid == os.getpid():
        return False  # this process (another manager, or a save in flight)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, owned by someone else
    return False


_libc = None


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2). False where unsupported."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # file system (e.g. NFS) or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def complete_steps(root: Path | RemotePath) -> list[Path]:
    """``step_<N>`` checkpoints, oldest first: directories on disk, committed prefixes in an object store."""
    if isinstance(root, RemotePath):
        return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / COMMITTED).is_file()),
                      key=step_of)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of)


def link_target(link: Path | RemotePath) -> Path | RemotePath | None:
    """Where a ``latest``/``best`` symlink (an object store: the object naming the step) points, existing or not;
    None if there is none."""
    if isinstance(link, RemotePath):
        try:
            name = link.read_text().strip()
        except FileNotFoundError:
            return None
        return link.parent / name if STEP_DIR.match(name) else None
    return link.parent / os.readlink(link) if link.is_symlink() else None


def link_text(link: Path | RemotePath) -> str:
    """What a link says, for a message (``latest -> step_4``)."""
    target = link_target(link)
    return target.name if isinstance(link, RemotePath) and target is not None else os.readlink(link)
