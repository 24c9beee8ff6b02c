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
share, or ``checkpoint.dir`` an object store (``remote_manager``: the same steps, committed by objects). Async save with several ranks: every collective of a save (the temporary's name,
DCP's own planning, the agreement on the outcome) runs on a gloo group of its own, made
once by every rank when the manager is built, so the background writer never shares a
group with the training thread's collectives; ranks stay in step because each runs the
same saves in the same order, one at a time. DeepSpeed saves synchronously: its
``save_checkpoint`` runs DeepSpeed's own collectives on the training group.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from treadle import distributed
from treadle.checkpoint.compat import check_compatible, check_fit
from treadle.checkpoint.discovery import find_checkpoint
from treadle.checkpoint.layout import (
    STEP_DIR,
    TMP_NAME,
    abandoned,
    complete_steps,
    exchange,
    link_target,
    remove,
    tmp_name,
    write_text,
)
from treadle.checkpoint.remote import as_path
from treadle.checkpoint.rng import capture_rng, restore_rng
from treadle.checkpoint.safety import CheckpointDamaged, causes, loading, safe_dcp_load
from treadle.checkpoint.staging import StagingBuffers
from treadle.checkpoint.validate import COMPANIONS, checkpoint_format, damage, inspect, read_json_object, vetted_dcp
from treadle.errors import CheckpointWriteError, UserError, first_line
from treadle.fsutil import fsync as _fsync
from treadle.fsutil import fsync_tree as _fsync_tree

log = logging.getLogger("treadle")

_FORMATS = {"dcp": "DCP state (state/)", "deepspeed": "a DeepSpeed checkpoint (deepspeed/)"}


def _dcp_save(state: dict, where: Path, group) -> None:
    with distributed.quiet_single_process_dcp():
        dcp.save(state, checkpoint_id=where, process_group=group)  # collective with several ranks


@dataclass
class _Job:
    """Everything one save writes, fixed at the moment ``save`` was called."""

    step: int
    final: Path
    state: dict | None  # DCP state; None when the engine writes its own format (DeepSpeed)
    companions: dict | None  # with DeepSpeed's format: the companions' DCP state (None: none)
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
        self.root = as_path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.best_metric = best_metric
        self.best_mode = best_mode
        self._thread: threading.Thread | None = None
        self._pending: Path | None = None
        self._error: BaseException | None = None
        self._staging = StagingBuffers()
        # name -> an object with state_dict / load_state_dict (DCP-able tensors) saved and restored beside the
        # engine's model and optimizer, in the same state/ (a draft trained beside the target: its own weights and
        # optimizer), so it lands, resumes and rolls back with the run.
        self.companions: dict[str, object] = {}
        # The background writer's own group (new_group is collective: every rank builds its manager at the same point).
        self._group = torch.distributed.new_group(backend="gloo") if async_save and world_size > 1 else None
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
            if not abandoned(p.name):
                continue
            m = TMP_NAME.match(p.name)
            if m and m["what"].startswith("old-") and STEP_DIR.match(m["what"][4:]):
                final = self.root / m["what"][4:]
                if not final.exists() and not final.is_symlink():
                    os.rename(p, final)  # the replacement never arrived: the old checkpoint is the one
                    _fsync(self.root)
                    log.warning(f"checkpoint: restored {final} that an interrupted save had moved aside")
                    continue
            remove(p)
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
        companions = None if dcp_state or not self.companions else self._companion_state()
        job = _Job(step=step, final=self.root / f"step_{step}", state=self._state(engine) if dcp_state else None,
                   companions=companions,
                   train_state=json.dumps(train_state), rng=capture_rng(), config_toml=config_toml,
                   metrics=dict(metrics) if metrics else None)
        if not (self.async_save and dcp_state):
            self._write(job, engine)
            return job.final
        job.state = self._staging.stage(job.state)
        self._pending = job.final
        # Not a daemon: an interpreter that is exiting waits for the checkpoint to land.
        self._thread = threading.Thread(target=self._background, args=(job,), name=f"treadle-save-step_{step}")
        self._thread.start()
        return job.final

    def _state(self, engine) -> dict:
        """The DCP state of a checkpoint: the engine's, and each companion's under its name."""
        return {**engine.state_dict(), **self._companion_state()}

    def _companion_state(self) -> dict:
        return {name: c.state_dict() for name, c in self.companions.items()}

    def wait(self) -> None:
        """Block until no save is in flight; raise the background save's error, if it failed."""
        self.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def join(self) -> None:
        """Block until no save is in flight; its error, if any, is kept for the next ``save`` or ``wait``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def pending(self) -> Path | None:
        """The ``step_<N>`` an async save is writing, None when idle."""
        return self._pending

    def _background(self, job: _Job) -> None:
        try:
            self._write(job, group=self._group)
        except BaseException as exc:  # kept for the next save()/wait(); logged now in case there is none
            self._error = exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.error(f"checkpoint step_{job.step}: background save failed: {first}")
        finally:
            self._pending = None

    def _write(self, job: _Job, engine=None, group=None) -> None:
        """Every rank: its shards and RNG into rank 0's temporary directory; rank 0: the rest.

        ``group``: the process group of every collective here (None: the default one, or none at all).
        """
        tmp = self._temporary(job, group)
        error = self._agreed(self._attempt(self._write_shards, job, tmp, engine, group), job, tmp, group)
        if error is None and self.rank == 0:
            error = self._attempt(self._install_files, job, tmp)
        error = self._agreed(error, job, tmp, group)
        if error is not None:
            if self.rank == 0:
                remove(tmp)
            self._raise_write_error(job, error, tmp)
        error = self._agreed(self._attempt(self._point_links, job) if self.rank == 0 else None, job, self.root, group)
        if error is not None:
            self._raise_write_error(job, error, self.root, written=True)
        if self.rank == 0:
            self._retain()

    def _temporary(self, job: _Job, group) -> Path:
        """Where every rank writes this save until it is installed: a ``.tmp-*`` directory rank 0 names."""
        return self.root / distributed.broadcast_object(tmp_name(job.final.name), group=group)

    def _write_shards(self, job: _Job, tmp: Path, engine, group) -> None:
        (tmp / "rng").mkdir(parents=True, exist_ok=True)  # every rank: whichever comes first creates it
        if job.state is not None:
            _dcp_save(job.state, tmp / "state", group)
        else:
            engine.save_checkpoint(tmp / "deepspeed")
            if job.companions is not None:  # DeepSpeed's files hold its engine's state only
                _dcp_save(job.companions, tmp / COMPANIONS, group)
        write_text(tmp / "rng" / f"rank_{self.rank}.json", json.dumps(job.rng))

    def _install_files(self, job: _Job, tmp: Path) -> None:
        write_text(tmp / "train_state.json", job.train_state)
        write_text(tmp / "config.toml", job.config_toml)
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

    def _agreed(self, error: BaseException | None, job: _Job, where: Path, group=None) -> BaseException | None:
        """This rank's error, else the first other rank's (one collective): all ranks fail a save together."""
        if self.world_size == 1:
            return error
        reports = [None] * self.world_size
        torch.distributed.all_gather_object(reports, None if error is None else first_line(error), group=group)
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
        latest = link_target(self.root / "latest")
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
        elif exchange(tmp, final):
            _fsync(self.root)  # the exchange is durable before the old checkpoint (now under tmp) goes
            remove(tmp)
        else:
            aside = self.root / tmp_name(f"old-{final.name}")  # recover() renames it back if we die here
            os.rename(final, aside)
            os.rename(tmp, final)
            _fsync(self.root)
            remove(aside)

    def _point(self, link: Path, target: Path) -> None:
        tmp_link = self.root / tmp_name(link.name)
        try:
            os.symlink(target.name, tmp_link)  # relative: the run directory can be moved
            os.replace(tmp_link, link)
        finally:
            remove(tmp_link)
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
        self._replace_text(self.root / "best.json", json.dumps(rec))
        self._point(self.root / "best", job.final)

    def _replace_text(self, path: Path, text: str) -> None:
        """Readers of ``path`` see the old text or the new one."""
        tmp = self.root / tmp_name(path.name.replace(".", ""))
        try:
            write_text(tmp, text)
            os.replace(tmp, path)
        finally:
            remove(tmp)

    def _retain(self) -> None:
        done = self.complete()
        keep = {p.name for p in done[-self.keep_last :]}
        for link in (self.root / "latest", self.root / "best"):
            target = link_target(link)
            if target is not None:
                keep.add(target.name)
        for p in done:
            if p.name not in keep:
                self._discard(p)

    def _discard(self, p: Path) -> None:
        trash = self.root / tmp_name(f"del-{p.name}")
        try:
            os.rename(p, trash)  # invisible first: a kill mid-delete leaves .tmp-*, not a partial step_<N>
        except OSError as exc:
            log.warning(f"checkpoint: could not remove {p} ({exc.strerror}); it is kept")
            return
        remove(trash)

    def roll_back_to(self, path: Path, newer: list[Path]) -> None:
        """An explicit rollback: ``latest`` (and ``best``, if it was among them) leave ``newer``, which are removed.

        ``latest`` moves first, so a kill in between leaves a run that resumes from ``path``, never a dangling link.
        """
        self._point(self.root / "latest", path)
        best = link_target(self.root / "best")
        if best is not None and best.name in {p.name for p in newer}:
            remove(self.root / "best")
            remove(self.root / "best.json")
        for p in newer:
            self._discard(p)

    # ------------------------------------------------------------------ reading

    def complete(self) -> list[Path]:
        """``step_<N>`` directories, oldest first (complete by construction; ``damage`` checks contents)."""
        return complete_steps(self.root)

    def latest(self) -> Path | None:
        target = link_target(self.root / "latest")
        return target if target is not None and target.is_dir() else None

    def best(self) -> Path | None:
        target = link_target(self.root / "best")
        return target if target is not None and target.is_dir() else None

    damage = staticmethod(damage)
    check_compatible = staticmethod(check_compatible)

    def find_resume(self, resume: str) -> Path | None:
        return find_checkpoint(self.root, resume)

    def _load_companions(self, path: Path) -> None:
        """The companions' state from a DeepSpeed checkpoint's ``companions/`` (one line where it has none)."""
        if not (path / COMPANIONS).is_dir():
            raise UserError(f"checkpoint {path} holds no {COMPANIONS}/ for this run's {', '.join(self.companions)} "
                            "(a run without it wrote the checkpoint); accepted: a checkpoint of a run like this one")
        state = self._companion_state()
        md = vetted_dcp(path, COMPANIONS)
        check_fit(path, md, state)
        safe_dcp_load(state, path / COMPANIONS, path, md)
        for name, companion in self.companions.items():
            companion.load_state_dict(state[name])

    def load(self, path: Path, engine, *, config_toml: str | None = None, meta: dict | None = None) -> dict:
        """Restore model, optimizer and this rank's RNG; return the JSON train state.

        Waits for an in-flight save first. With ``config_toml`` / ``meta`` (this run's), refuses
        an incompatible checkpoint first (``check_compatible``). Every problem is a one-line UserError.
        """
        self.wait()
        path = as_path(path)
        md = inspect(path)
        check_compatible(path, config_toml, meta)
        train_state = json.loads((path / "train_state.json").read_text())
        found = checkpoint_format(path)
        if found != engine.checkpoint_format:
            raise UserError(
                f"checkpoint {path} holds {_FORMATS[found]}, which this run's engine cannot read; accepted: "
                + ("distributed.engine = deepspeed, or DeepSpeed's zero_to_fp32.py to turn it into weights for a new run"
                   if found == "deepspeed" else "a ddp, fsdp2 or local engine (distributed.engine)"))
        if md is None:  # inspect vetted every pickle DeepSpeed will open; other damage surfaces while it loads
            with loading(path):
                engine.load_checkpoint(path / "deepspeed")
            if self.companions:
                self._load_companions(path)
        else:
            state = self._state(engine)
            check_fit(path, md, state, partial=engine.state_is_partial)
            safe_dcp_load(state, path / "state", path, md)
            engine.load_state_dict(state)
            for name, companion in self.companions.items():
                companion.load_state_dict(state[name])
        rng_file = path / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            rng = read_json_object(rng_file, path)
            try:
                restore_rng(rng)
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # valid JSON, not an RNG state
                raise CheckpointDamaged(path, f"{rng_file.relative_to(path)} is not an RNG state "
                                              f"({type(exc).__name__}: {first_line(exc)})") from None
        return train_state
