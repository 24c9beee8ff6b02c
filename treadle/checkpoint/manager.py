"""Checkpoints that are either complete or invisible, written without stalling training.

Layout of ``<output_dir>/checkpoints``::

    step_<N>/state/             model + optimizer, torch.distributed.checkpoint (DCP) format
    step_<N>/train_state.json   step, counters, data position, schedule, callbacks, meta
    step_<N>/rng/rank_<r>.json  Python / NumPy / torch RNG states of rank r
    step_<N>/config.toml        the resolved config of the run that wrote it
    latest -> step_<N>          symlink, swapped atomically
    best -> step_<N>            symlink to the best checkpoint by ``best_metric`` (when set)
    best.json                   {"metric", "mode", "value", "step", "checkpoint"}: survives restarts
    .tmp-<what>.<pid>@<host>.<token>   a writer's work in progress (never a checkpoint)

Invariants:
- A directory named ``step_<N>`` is complete: it is written as ``.tmp-step_<N>...``,
  fsynced (files and directories), and only then renamed (atomic on POSIX file systems).
- Saving a step that already exists never deletes the old ``step_<N>`` before the
  new one is in place: the two directories are exchanged atomically
  (``renameat2(RENAME_EXCHANGE)``); where the file system lacks that, the old one is
  renamed aside first, and a writer killed between the two renames gets it renamed
  back at the next start-up.
- ``latest`` and ``best`` only ever point at complete checkpoints: each is replaced,
  by rename of a fresh symlink, after the checkpoint's own rename is durable.
- Retention deletes only complete checkpoints that are neither among the newest
  ``keep_last``, nor ``latest``'s or ``best``'s target, nor being written (those are
  ``.tmp-*``). A deletion first renames the directory to ``.tmp-*``, so a kill in
  the middle of ``rmtree`` never leaves a partial ``step_<N>``.
- Start-up (rank 0) removes the temporary entries of writers that are dead (a pid on
  this host that no longer runs); a live writer's work, other programs' ``.tmp-*``
  and every ``step_<N>`` are left alone. Reading (``find_checkpoint``) changes nothing.
- A failed write (disk full, file too large, read-only, no permission) removes its
  temporary directory, leaves every earlier checkpoint and ``latest`` as they were,
  and raises ``CheckpointWriteError``.
- ``async_save``: at most one save is in flight. ``save`` returns once its snapshot
  is taken (tensors copied into CPU staging buffers, train state serialized, RNG
  captured), so training may mutate the model at once; the rename, ``latest``,
  ``best`` and retention happen in the background only after the write is durable;
  a failure there is raised by the next ``save`` or ``wait``.
- Nothing executes on load: train state is JSON and tensors go through DCP with
  every unpickling restricted (``safety.py``; plain DCP unpickles ``.metadata`` and
  non-tensor entries with the full pickle machinery).

Async save is our own thread, not ``dcp.async_save``. Both work without a process
group in torch 2.13, but ``dcp.async_save`` allocates a fresh staging copy on each
call, while our staging buffers are reused from one save to the next, which stalls
training less (bench/checkpoint.py, docs/benchmarks.md). Process-mode
``dcp.async_save`` is avoided on purpose: it re-runs a script that lacks an
``if __name__ == "__main__":`` guard, which then hangs (PLATFORM.md).
Several ranks: every rank writes its shards (DCP, or DeepSpeed's own files under
``step_<N>/deepspeed/``) and its RNG into one temporary directory whose name rank 0
chose; rank 0 alone writes the train state, renames, moves the links and retires old
checkpoints; every rank learns the outcome (one collective), so a failed write on any
rank fails the save everywhere. The run directory must be on a file system all ranks
share. Async save is single-process only for now (with several ranks DCP's collectives
would need a process group of their own in the background thread): with several ranks,
or with DeepSpeed, ``save`` writes synchronously.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import sys
import threading
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from treadle import distributed
from treadle.checkpoint.safety import CheckpointDamaged, causes, read_metadata, safe_dcp_load
from treadle.errors import UserError, first_line
from treadle.fsutil import fsync as _fsync
from treadle.fsutil import fsync_tree as _fsync_tree

log = logging.getLogger("treadle")

STEP_DIR = re.compile(r"^step_(\d+)$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
_TMP = re.compile(r"^\.tmp-(?P<what>[^.]+)\.(?P<pid>\d+)@(?P<host>[^.]+)\.(?P<token>[0-9a-f]{8})$")
# [model] keys a resumed run may change: weights are fp32 either way, and in-place compile keeps names.
_HARMLESS_MODEL_KEYS = {"model.dtype", "model.compile"}
# [draft] keys that shape the trained module; the rest (objective, lag, offsets, eval) are training choices.
_DRAFT_ARCH_KEYS = {"draft.kind", "draft.window"}
_META_KEYS = ("vocab_size", "tokenizer_fingerprint", "target_fingerprint")
_FORMATS = {"dcp": "DCP state (state/)", "deepspeed": "a DeepSpeed checkpoint (deepspeed/)"}
_RESUME_ACCEPTED = "accepted: auto, none, a step_<N> checkpoint directory, or a run directory that has checkpoints"


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, file too large, read-only, no permission).

    Earlier checkpoints and ``latest`` are untouched, so the run can be resumed from
    them. ``path`` is where the write failed, ``os_error`` the error the OS gave.
    A ``UserError``, so the CLI reports it as one line.
    """

    def __init__(self, message: str, path: Path, os_error: OSError):
        super().__init__(message)
        self.path = path
        self.os_error = os_error


# ---------------------------------------------------------------------------- RNG


def capture_rng() -> dict:
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    rng = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])


# ---------------------------------------------------------------------------- file system


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _tmp_name(what: str) -> str:
    """A temporary name that says which process owns it, so start-up can tell abandoned from live."""
    return f".tmp-{what}.{os.getpid()}@{_HOST}.{uuid.uuid4().hex[:8]}"


def _abandoned(name: str) -> bool:
    """A temporary entry of ours whose writer is gone. Other ``.tmp-*`` names (an HF export's) are not ours."""
    m = _TMP.match(name)
    if m is None:
        return False
    if m["host"] != _HOST:
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


def _exchange(a: Path, b: Path) -> bool:
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


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of)


def _link_target(link: Path) -> Path | None:
    """Where a ``latest``/``best`` symlink points (existing or not); None if there is no symlink."""
    return link.parent / os.readlink(link) if link.is_symlink() else None


# ---------------------------------------------------------------------------- validation


def checkpoint_format(path: Path) -> str:
    """``dcp`` (``state/``) or ``deepspeed`` (``deepspeed/``, written by the DeepSpeed engine)."""
    return "deepspeed" if (path / "deepspeed").is_dir() and not (path / "state").is_dir() else "dcp"


def _inspect(path: Path) -> Metadata | None:
    """The checkpoint's vetted DCP metadata (None for DeepSpeed's format); CheckpointDamaged saying what is wrong."""
    if not path.is_dir():
        raise CheckpointDamaged(path, "no such directory")
    ts = path / "train_state.json"
    if not ts.is_file():
        raise CheckpointDamaged(path, "train_state.json is missing")
    try:
        state = json.loads(ts.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointDamaged(path, f"train_state.json is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise CheckpointDamaged(path, "train_state.json is not a JSON object")
    if not (path / "config.toml").is_file():
        raise CheckpointDamaged(path, "config.toml is missing")
    rng = path / "rng"
    if not rng.is_dir() or not any(rng.glob("rank_*.json")):
        raise CheckpointDamaged(path, "rng/ (the RNG states) is missing")
    if checkpoint_format(path) == "deepspeed":
        if not any((path / "deepspeed").iterdir()):
            raise CheckpointDamaged(path, "deepspeed/ is empty")
        return None  # DeepSpeed's own format: its load_checkpoint checks its files
    md = read_metadata(path / "state", path)
    # Every byte range the metadata names must exist: catches truncated or missing .distcp files.
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointDamaged(path, f"state/.metadata names an invalid data file {rel!r}")
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in ends.items():
        f = path / "state" / rel
        if not f.is_file():
            raise CheckpointDamaged(path, f"state/{rel} is missing")
        if f.stat().st_size < end:
            raise CheckpointDamaged(path, f"state/{rel} is truncated ({f.stat().st_size} bytes, {end} expected)")
    return md


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None if it is complete and sound."""
    try:
        _inspect(Path(path))
    except CheckpointDamaged as exc:
        return exc.reason
    return None


def _newest_valid(root: Path) -> Path | None:
    """``latest`` if sound, else the newest sound ``step_<N>``, saying in one line what was skipped.

    None if ``root`` holds no checkpoint at all; UserError if it holds only damaged ones,
    because starting afresh over them would throw the run away.
    """
    skipped = []
    link = root / "latest"
    target = _link_target(link)
    if target is not None:
        reason = damage(target) if target.is_dir() else "it points to a missing directory"
        if reason is None:
            return target
        skipped.append(f"latest -> {os.readlink(link)} ({reason})")
    done = [p for p in reversed(_complete(root)) if target is None or p.name != target.name]
    for p in done:
        reason = damage(p)
        if reason is None:
            what = "skipped " + "; ".join(skipped) if skipped else "latest is missing"
            log.warning(f"checkpoint: {what}; resuming from {p}")
            return p
        skipped.append(f"{p.name} ({reason})")
    if skipped:
        raise UserError(
            f"no usable checkpoint in {root}: {'; '.join(skipped)}; accepted: remove or repair the damaged "
            "checkpoints, or start a new train.output_dir"
        )
    return None


# ---------------------------------------------------------------------------- compatibility


def _flat(tree: dict, prefix: str) -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(v: Any) -> str:
    return "unset" if v is None else repr(v) if isinstance(v, str) else str(v)


def _architecture(config: dict) -> dict[str, Any]:
    """The config keys that decide which tensors a checkpoint holds."""
    model = {k: v for k, v in _flat(config.get("model", {}), "model.").items() if k not in _HARMLESS_MODEL_KEYS}
    draft = {k: v for k, v in _flat(config.get("draft", {}), "draft.").items() if k in _DRAFT_ARCH_KEYS}
    return model | draft


def check_compatible(path: Path, config_toml_now: str | None, meta_now: dict | None) -> None:
    """UserError if the checkpoint at ``path`` was trained as another model or on other data.

    Compares the checkpoint's ``config.toml`` ``[model]`` section (except
    ``model.dtype`` and ``model.compile``, harmless to change) and the draft's kind and
    window with ``config_toml_now``, and ``vocab_size`` / ``tokenizer_fingerprint`` /
    ``target_fingerprint`` of its train_state.json ``meta`` with ``meta_now``. Everything else (steps, lr, logging, eval, data paths) may change.
    Either argument may be None to skip that half.
    """
    path = Path(path)
    if config_toml_now is not None:
        try:
            then = _architecture(tomllib.loads((path / "config.toml").read_text()))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UserError(f"checkpoint {path}: config.toml is unreadable ({str(exc).splitlines()[0]})") from None
        now = _architecture(tomllib.loads(config_toml_now))
        for key in sorted(then.keys() | now.keys()):
            if then.get(key) != now.get(key):
                raise UserError(
                    f"checkpoint {path} was trained with {key} = {_show(then.get(key))}, this run has "
                    f"{_show(now.get(key))}; resume with the same model or start a new output_dir"
                )
    if meta_now is not None:
        try:
            meta_then = json.loads((path / "train_state.json").read_text()).get("meta") or {}
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise UserError(f"checkpoint {path}: train_state.json is unreadable ({str(exc).splitlines()[0]})") from None
        for key in _META_KEYS:
            if key in meta_then and key in meta_now and meta_then[key] != meta_now[key]:
                raise UserError(
                    f"checkpoint {path} was trained with {key} = {_show(meta_then[key])}, this run has "
                    f"{_show(meta_now[key])}; resume with the same data and tokenizer or start a new output_dir"
                )


def _tensor_shapes(obj: Any, key: tuple = ()) -> dict[tuple, tuple]:
    if isinstance(obj, torch.Tensor):
        return {key: tuple(obj.shape)}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[tuple, tuple] = {}
    for k, v in items:
        out |= _tensor_shapes(v, key + (k,))
    return out


def _check_fit(path: Path, md: Metadata, state: dict) -> None:
    """One-line UserError for a tensor this model has and the checkpoint lacks (or the reverse) or a shape change.

    DCP would report these as a multi-line CheckpointException (or, for a checkpoint
    holding more layers, not at all); the check uses the vetted metadata only.
    """
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    saved = {tuple(paths[fqn]): tuple(entry.size) for fqn, entry in md.state_dict_metadata.items()
             if isinstance(entry, TensorStorageMetadata) and fqn in paths}
    if not saved:
        return  # written by a planner that records no paths: leave it to DCP's own checks
    ours = _tensor_shapes(state)
    name = lambda k: ".".join(map(str, k))  # noqa: E731
    hint = "resume with the same model or start a new output_dir"
    for k, shape in ours.items():
        if k not in saved:
            raise UserError(f"checkpoint {path} does not fit this model: it has no {name(k)} {list(shape)}; {hint}")
        if saved[k] != shape:
            raise UserError(f"checkpoint {path} does not fit this model: {name(k)} is {list(saved[k])} there, "
                            f"{list(shape)} here; {hint}")
    for k, shape in saved.items():
        if k not in ours:
            raise UserError(f"checkpoint {path} does not fit this model: it holds {name(k)} {list(shape)}, "
                            f"which this model lacks; {hint}")


# ---------------------------------------------------------------------------- finding


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from.

    ``none`` -> None. ``auto`` -> ``latest`` if sound, else the newest sound checkpoint
    (one warning line names what was skipped and why), None if there is none; UserError
    if every one is damaged. A path: a checkpoint directory, which must be sound, or a
    run / checkpoints directory searched like ``auto``; UserError otherwise.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return _newest_valid(Path(root))
    path = Path(resume)
    if not path.exists():
        raise UserError(f"checkpoint.resume = {resume!r} does not exist; {_RESUME_ACCEPTED}")
    if STEP_DIR.match(path.name) or (path / "train_state.json").exists() or (path / "state").is_dir():
        reason = damage(path)
        if reason is not None:
            raise UserError(f"checkpoint.resume = {resume!r} is not a usable checkpoint: {reason}; {_RESUME_ACCEPTED}")
        return path
    for candidate in (path / "checkpoints", path):  # a run directory, or its checkpoints directory
        found = _newest_valid(candidate) if candidate.is_dir() else None
        if found is not None:
            return found
    raise UserError(f"checkpoint.resume = {resume!r} holds no checkpoint; {_RESUME_ACCEPTED}")


# ---------------------------------------------------------------------------- the manager


@dataclass
class _Job:
    """Everything one save writes, fixed at the moment ``save`` was called."""

    step: int
    final: Path
    state: dict | None  # DCP state; None when the engine writes its own format (DeepSpeed)
    train_state: str  # already JSON: later changes to the caller's dict cannot leak in
    rng: dict
    config_toml: str
    metrics: dict | None


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int = 0, *, world_size: int = 1, async_save: bool = False,
                 best_metric: str | None = None, best_mode: str = "min"):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise UserError(f"checkpoint.keep_last = {keep_last!r} is invalid; accepted: an integer >= 1")
        if best_mode not in ("min", "max"):
            raise UserError(f"checkpoint.best_mode = {best_mode!r} is invalid; accepted: min, max")
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.best_metric = best_metric
        self.best_mode = best_mode
        self._thread: threading.Thread | None = None
        self._pending: Path | None = None
        self._error: BaseException | None = None
        # Async staging buffers, reused by every save: one extra CPU copy of the state for
        # the run's lifetime, but no fresh allocation (page faults) on the training thread.
        self._buffers: dict[tuple, torch.Tensor] = {}
        if rank == 0:
            self.recover()

    # ------------------------------------------------------------------ start-up

    def recover(self) -> list[str]:
        """Remove what killed writers left (``.tmp-*``); put back a step a killed replace moved aside.

        Returns the names removed. Entries of live writers and complete checkpoints are never touched.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for p in sorted(self.root.iterdir()):
            if not _abandoned(p.name):
                continue
            m = _TMP.match(p.name)
            if m and m["what"].startswith("old-") and STEP_DIR.match(m["what"][4:]):
                final = self.root / m["what"][4:]
                if not final.exists() and not final.is_symlink():
                    os.rename(p, final)  # the replacement never arrived: the old checkpoint is the one
                    _fsync(self.root)
                    log.warning(f"checkpoint: restored {final} that an interrupted save had moved aside")
                    continue
            _remove(p)
            removed.append(p.name)
        return removed

    # ------------------------------------------------------------------ writing

    def save(self, step: int, engine, train_state: dict, config_toml: str, *, metrics: dict | None = None) -> Path:
        """Checkpoint ``step``; returns the ``step_<N>`` path (complete once ``wait`` returns, if async).

        ``metrics`` (e.g. ``{"eval_loss": 2.1}``) decides ``best`` when it holds ``best_metric``.
        Raises CheckpointWriteError on a failed write (sync), or the previous background
        save's error (async).
        """
        self.wait()  # at most one in flight; surfaces the previous one's failure
        dcp_state = engine.checkpoint_format == "dcp"
        job = _Job(step=step, final=self.root / f"step_{step}", state=engine.state_dict() if dcp_state else None,
                   train_state=json.dumps(train_state), rng=capture_rng(), config_toml=config_toml,
                   metrics=dict(metrics) if metrics else None)
        if not (self.async_save and dcp_state and self.world_size == 1):
            self._write(job, engine)
            return job.final
        job.state = self._stage(job.state)
        self._pending = job.final
        # Not a daemon: an interpreter that is exiting waits for the checkpoint to land.
        self._thread = threading.Thread(target=self._background, args=(job,), name=f"treadle-save-step_{step}")
        self._thread.start()
        return job.final

    def wait(self) -> None:
        """Block until no save is in flight; raise the background save's error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    @property
    def pending(self) -> Path | None:
        """The ``step_<N>`` an async save is writing, None when idle."""
        return self._pending

    def _background(self, job: _Job) -> None:
        try:
            self._write(job)
        except BaseException as exc:  # kept for the next save()/wait(); logged now in case there is none
            self._error = exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.error(f"checkpoint step_{job.step}: background save failed: {first}")
        finally:
            self._pending = None

    def _stage(self, obj: Any, key: tuple = ()) -> Any:
        """A snapshot of ``obj`` that training can no longer change: tensors copied into CPU buffers."""
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor:  # DTensor and other subclasses keep their own layout
                return obj.detach().clone()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self._buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
            buf.copy_(obj.detach())
            return buf
        if isinstance(obj, dict):
            return {k: self._stage(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._stage(v, key + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._stage(v, key + (i,)) for i, v in enumerate(obj))
        return obj  # int, float, str, bool, None: immutable

    def _write(self, job: _Job, engine=None) -> None:
        """Every rank: its shards and RNG into rank 0's temporary directory; rank 0: the rest."""
        tmp = self.root / distributed.broadcast_object(_tmp_name(job.final.name))
        error = self._agreed(self._attempt(self._write_shards, job, tmp, engine), job, tmp)
        if error is None and self.rank == 0:
            error = self._attempt(self._install_files, job, tmp)
        error = self._agreed(error, job, tmp)
        if error is not None:
            if self.rank == 0:
                _remove(tmp)
            self._raise_write_error(job, error, tmp)
        error = self._agreed(self._attempt(self._point_links, job) if self.rank == 0 else None, job, self.root)
        if error is not None:
            self._raise_write_error(job, error, self.root, written=True)
        if self.rank == 0:
            self._retain()

    def _write_shards(self, job: _Job, tmp: Path, engine) -> None:
        (tmp / "rng").mkdir(parents=True, exist_ok=True)  # every rank: whichever comes first creates it
        if job.state is not None:
            dcp.save(job.state, checkpoint_id=tmp / "state")  # collective with several ranks
        else:
            engine.save_checkpoint(tmp / "deepspeed")
        _write_text(tmp / "rng" / f"rank_{self.rank}.json", json.dumps(job.rng))

    def _install_files(self, job: _Job, tmp: Path) -> None:
        _write_text(tmp / "train_state.json", job.train_state)
        _write_text(tmp / "config.toml", job.config_toml)
        _fsync_tree(tmp)
        self._install(tmp, job.final)

    def _point_links(self, job: _Job) -> None:
        self._point(self.root / "latest", job.final)
        self._update_best(job)

    @staticmethod
    def _attempt(fn, *args) -> BaseException | None:
        try:
            fn(*args)
        except BaseException as exc:
            return exc
        return None

    def _agreed(self, error: BaseException | None, job: _Job, where: Path) -> BaseException | None:
        """This rank's error, else the first other rank's (one collective): all ranks fail a save together."""
        if self.world_size == 1:
            return error
        reports = [None] * self.world_size
        torch.distributed.all_gather_object(reports, None if error is None else first_line(error))
        if error is not None:
            return error
        rank, message = next(((r, m) for r, m in enumerate(reports) if m is not None), (None, None))
        if rank is None:
            return None
        return CheckpointWriteError(f"checkpoint step_{job.step}: rank {rank} failed: {message}", where,
                                    OSError(errno.EIO, message))

    def _raise_write_error(self, job: _Job, exc: BaseException, where: Path, written: bool = False):
        """CheckpointWriteError if the OS refused a write (DCP hides it in its exception chain); else exc as is."""
        if isinstance(exc, CheckpointWriteError):  # already phrased (another rank's failure)
            raise exc
        os_error = next((c for c in causes(exc) if isinstance(c, OSError)), None)
        if os_error is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        code = errno.errorcode.get(os_error.errno, "")
        where = Path(os_error.filename) if os_error.filename else where
        latest = _link_target(self.root / "latest")
        previous = f"the previous checkpoint {latest} is intact and resumable" if latest else "no earlier checkpoint exists"
        what = f"was written but latest/best could not be updated in {where}" if written else f"could not be written to {where}"
        raise CheckpointWriteError(
            f"checkpoint step_{job.step} {what}: {os_error.strerror or os_error} ({code}); {previous}", where, os_error
        ) from exc

    def _install(self, tmp: Path, final: Path) -> None:
        """Give ``tmp`` the name ``final``, never leaving a moment where a crash loses an existing ``final``."""
        if not (final.exists() or final.is_symlink()):
            os.rename(tmp, final)
            _fsync(self.root)
        elif _exchange(tmp, final):
            _fsync(self.root)  # the exchange is durable before the old checkpoint (now under tmp) goes
            _remove(tmp)
        else:
            aside = self.root / _tmp_name(f"old-{final.name}")  # recover() renames it back if we die here
            os.rename(final, aside)
            os.rename(tmp, final)
            _fsync(self.root)
            _remove(aside)

    def _point(self, link: Path, target: Path) -> None:
        tmp_link = self.root / _tmp_name(link.name)
        try:
            os.symlink(target.name, tmp_link)  # relative: the run directory can be moved
            os.replace(tmp_link, link)
        finally:
            _remove(tmp_link)
        _fsync(self.root)

    def _best_value(self) -> float | None:
        """The best value so far from best.json, if it is for this metric and mode and its checkpoint exists."""
        try:
            rec = json.loads((self.root / "best.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("metric") != self.best_metric or rec.get("mode") != self.best_mode:
            return None
        if not (self.root / str(rec.get("checkpoint"))).is_dir() or not isinstance(rec.get("value"), (int, float)):
            return None
        return float(rec["value"])

    def _update_best(self, job: _Job) -> None:
        if self.best_metric is None or not job.metrics or self.best_metric not in job.metrics:
            return
        try:
            value = float(job.metrics[self.best_metric])
        except (TypeError, ValueError):
            return
        if not math.isfinite(value):
            return  # a NaN eval is never the best
        old = self._best_value()
        if old is not None and not (value < old if self.best_mode == "min" else value > old):
            return
        rec = {"metric": self.best_metric, "mode": self.best_mode, "value": value, "step": job.step,
               "checkpoint": job.final.name}
        tmp = self.root / _tmp_name("bestjson")
        try:
            _write_text(tmp, json.dumps(rec))
            os.replace(tmp, self.root / "best.json")
        finally:
            _remove(tmp)
        self._point(self.root / "best", job.final)

    def _retain(self) -> None:
        done = self.complete()
        keep = {p.name for p in done[-self.keep_last :]}
        for link in (self.root / "latest", self.root / "best"):
            target = _link_target(link)
            if target is not None:
                keep.add(target.name)
        for p in done:
            if p.name not in keep:
                trash = self.root / _tmp_name(f"del-{p.name}")
                try:
                    os.rename(p, trash)  # invisible first: a kill mid-delete leaves .tmp-*, not a partial step_<N>
                except OSError as exc:
                    log.warning(f"checkpoint: could not remove {p} ({exc.strerror}); it is kept")
                    continue
                _remove(trash)

    # ------------------------------------------------------------------ reading

    def complete(self) -> list[Path]:
        """``step_<N>`` directories, oldest first (complete by construction; ``damage`` checks contents)."""
        return _complete(self.root)

    def latest(self) -> Path | None:
        target = _link_target(self.root / "latest")
        return target if target is not None and target.is_dir() else None

    def best(self) -> Path | None:
        target = _link_target(self.root / "best")
        return target if target is not None and target.is_dir() else None

    damage = staticmethod(damage)
    check_compatible = staticmethod(check_compatible)

    def find_resume(self, resume: str) -> Path | None:
        return find_checkpoint(self.root, resume)

    def load(self, path: Path, engine, *, config_toml: str | None = None, meta: dict | None = None) -> dict:
        """Restore model, optimizer and this rank's RNG; return the JSON train state.

        Waits for an in-flight save first. With ``config_toml`` / ``meta`` (this run's), refuses
        an incompatible checkpoint first (``check_compatible``). Every problem is a one-line UserError.
        """
        self.wait()
        path = Path(path)
        md = _inspect(path)
        check_compatible(path, config_toml, meta)
        train_state = json.loads((path / "train_state.json").read_text())
        found = checkpoint_format(path)
        if found != engine.checkpoint_format:
            raise UserError(
                f"checkpoint {path} holds {_FORMATS[found]}, which this run's engine cannot read; accepted: "
                + ("distributed.engine = deepspeed, or DeepSpeed's zero_to_fp32.py to turn it into weights for a new run"
                   if found == "deepspeed" else "a ddp, fsdp2 or local engine (distributed.engine)"))
        if md is None:
            engine.load_checkpoint(path / "deepspeed")
        else:
            state = engine.state_dict()
            _check_fit(path, md, state)
            safe_dcp_load(state, path / "state", path, md)
            engine.load_state_dict(state)
        rng_file = path / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            restore_rng(json.loads(rng_file.read_text()))
        return train_state
