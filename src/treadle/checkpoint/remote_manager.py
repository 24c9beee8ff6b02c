"""``CheckpointManager`` over an object store (``checkpoint.dir`` = ``s3://bucket/prefix``, ``gs://...``).

Layout under the URL::

    step_<N>/state/             DCP, written by every rank through DCP's fsspec writer (no shared disk needed)
    step_<N>/train_state.json   as on disk; so are config.toml and rng/rank_<r>.json
    step_<N>/COMMITTED          written last, by rank 0, once every rank's objects are in: the checkpoint exists
    latest, best                small objects holding a step's name ("step_<N>"), written after its COMMITTED
    best.json                   as on disk
    .treadle-run.json           which run owns this location (train/rundir.py): another run is refused

Invariants (the disk's rename and symlink, restated for a store with neither; one PUT is atomic there):
- A ``step_<N>/`` without ``COMMITTED`` is no checkpoint: listing, ``latest``, resume and retention ignore it,
  and ``validate.inspect`` refuses it (a reader never sees a half-written checkpoint).
- ``latest`` / ``best`` are written only after their step's ``COMMITTED``: they never name a partial step.
- Removing a step deletes its ``COMMITTED`` first: a kill in the middle leaves an uncommitted prefix.
- Saving step N again (a repeated save) first removes the old ``step_<N>/``, marker first: a kill then loses
  that one checkpoint, and resume takes the newest older one. On disk the exchange keeps the old; an object
  store cannot swap prefixes.
- Start-up (rank 0) deletes uncommitted ``step_<N>/`` prefixes: one run owns the location
  (``.treadle-run.json``), and torchrun restarts all of a run's ranks, so no writer of it is alive then.
- Retention, rollback and async save are the disk's (the same code in ``manager``), on these objects.

DeepSpeed is refused before anything is written (``refuse_engine``): its ``save_checkpoint`` writes each rank's
files to a local directory through torch.save, and uploading them would need a staging directory every node
shares, which is what a cluster with an object store lacks (a node cannot tell which of its files to upload).
"""

from __future__ import annotations

import errno
import json
import logging

import torch.distributed.checkpoint as dcp

from treadle import distributed
from treadle.checkpoint.layout import STEP_DIR, link_target
from treadle.checkpoint.manager import CheckpointManager, _Job
from treadle.checkpoint.remote import COMMITTED, RemotePath, dcp_fsspec
from treadle.errors import CheckpointWriteError, UserError, first_line

log = logging.getLogger("treadle")

class RemoteCheckpointManager(CheckpointManager):
    root: RemotePath

    def recover(self) -> list[str]:
        """Delete what killed saves left: ``step_<N>/`` prefixes never committed."""
        removed = []
        for p in self.root.iterdir():
            if STEP_DIR.match(p.name) and not (p / COMMITTED).is_file():
                p.remove()
                removed.append(p.name)
        if removed:
            log.warning(f"checkpoint: removed uncommitted {', '.join(removed)} from {self.root} (saves that did "
                        "not finish)")
        return removed

    def _temporary(self, job: _Job, group) -> RemotePath:
        """The step's own prefix, uncommitted until ``COMMITTED`` lands; rank 0 clears it first (the broadcast
        after it keeps every rank from writing before that)."""
        problem = None
        if self.rank == 0:
            try:
                job.final.remove()
            except Exception as exc:  # told to every rank, which would otherwise wait in the broadcast
                problem = f"{type(exc).__name__}: {first_line(exc)}"
        problem = distributed.broadcast_object(problem, group=group)
        if problem is not None:
            self._raise_write_error(job, RuntimeError(f"clearing {job.final.name}/ failed: {problem}"), job.final)
        return job.final

    def _write_shards(self, job: _Job, tmp: RemotePath, engine, group) -> None:
        # No fsync: an object is durable once its upload completes, when DCP closes the stream (an fsync there
        # only warns that the stream has no file descriptor).
        writer = dcp_fsspec().FsspecWriter((tmp / "state").url, sync_files=False, use_listings_cache=False)
        with distributed.quiet_single_process_dcp():
            dcp.save(job.state, storage_writer=writer, process_group=group)  # every rank its shards, rank 0 .metadata
        (tmp / "rng" / f"rank_{self.rank}.json").write_text(json.dumps(job.rng))

    def _install_files(self, job: _Job, tmp: RemotePath) -> None:
        (tmp / "train_state.json").write_text(job.train_state)
        (tmp / "config.toml").write_text(job.config_toml)
        (tmp / COMMITTED).write_text(json.dumps({"step": job.step}))  # the commit: last of the step's objects

    def _point(self, link: RemotePath, target: RemotePath) -> None:
        link.write_text(target.name)

    def _replace_text(self, path: RemotePath, text: str) -> None:
        path.write_text(text)

    def _discard(self, p: RemotePath) -> None:
        try:
            p.remove()
        except Exception as exc:  # a store that refuses a delete: the checkpoint stays, as on disk
            log.warning(f"checkpoint: could not remove {p} ({first_line(exc)}); it is kept")

    def _raise_write_error(self, job: _Job, exc: BaseException, where, written: bool = False):
        """Any failure of the store (its client's errors are rarely OSErrors) is one CheckpointWriteError line."""
        if isinstance(exc, (CheckpointWriteError, UserError, KeyboardInterrupt, SystemExit)):
            raise exc
        latest = link_target(self.root / "latest")
        previous = (f"the previous checkpoint {latest} is intact and resumable" if latest
                    else "no earlier checkpoint exists")
        what = "was written but latest/best could not be updated" if written else "could not be written"
        message = f"checkpoint step_{job.step} {what} to {where}: {type(exc).__name__}: {first_line(exc)}; {previous}"
        raise CheckpointWriteError(message, where, OSError(errno.EIO, first_line(exc))) from exc


def refuse_engine(url: str, engine: str) -> None:
    """DeepSpeed cannot write to an object store (see the module docstring): one line, before the first write."""
    if engine == "deepspeed":
        raise UserError(f"checkpoint.dir = {url!r} is an object store, and distributed.engine = deepspeed writes "
                        "its checkpoints as files on each node's disk (its own save_checkpoint); accepted: a local "
                        "or shared-file-system checkpoint.dir with deepspeed, or distributed.engine = fsdp2 (DCP "
                        "writes to the store)")
