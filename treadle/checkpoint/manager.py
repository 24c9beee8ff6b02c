"""Checkpoints that are either complete or invisible.

Layout of ``<output_dir>/checkpoints``::

    step_<N>/state/      model + optimizer, torch.distributed.checkpoint (DCP) format
    step_<N>/train_state.json   step, counters, data position, schedule, callbacks
    step_<N>/rng/rank_<r>.json  Python / NumPy / torch RNG states of rank r
    step_<N>/config.toml        the resolved config of the run that wrote it
    latest -> step_<N>          symlink, swapped atomically

Invariants:
- A directory named ``step_<N>`` is complete: it is written as ``.tmp-step_<N>-*``,
  fsynced, and only then renamed (an atomic operation on POSIX file systems).
- ``latest`` only ever points at a complete checkpoint: it is replaced, by
  rename, after the checkpoint's own rename is durable.
- Retention never deletes the checkpoint ``latest`` points to.
- Nothing is pickled: train state is JSON, tensors go through DCP, so loading
  a checkpoint cannot execute code.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from treadle.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj))


def step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int = 0):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank

    # ------------------------------------------------------------------ writing

    def save(self, step: int, engine, train_state: dict, config_toml: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp-step_{step}-{uuid.uuid4().hex[:8]}"
        try:
            dcp.save(engine.state_dict(), checkpoint_id=tmp / "state")
            (tmp / "rng").mkdir()
            _write_json(tmp / "rng" / f"rank_{self.rank}.json", capture_rng())
            _write_json(tmp / "train_state.json", train_state)
            (tmp / "config.toml").write_text(config_toml)
            _fsync_tree(tmp)
            if final.exists():  # the same step saved again (e.g. a resumed run's last step): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._point_latest(final)
        self._retain()
        return final

    def _point_latest(self, target: Path) -> None:
        link = self.root / "latest"
        tmp_link = self.root / f".latest-{uuid.uuid4().hex[:8]}"
        os.symlink(target.name, tmp_link)  # relative: the run directory can be moved
        os.replace(tmp_link, link)
        _fsync(self.root)

    def _retain(self) -> None:
        keep = {p.name for p in self.complete()[-self.keep_last :]}
        latest = self.latest()
        if latest is not None:
            keep.add(latest.name)
        for p in self.complete():
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ reading

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of)

    def latest(self) -> Path | None:
        link = self.root / "latest"
        if link.is_symlink() and link.resolve().is_dir():
            return self.root / os.readlink(link)
        return None

    def find_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from: ``auto`` -> latest (else newest complete), ``none``, or a path."""
        if resume == "none":
            return None
        if resume == "auto":
            latest = self.latest()
            if latest is not None:
                return latest
            done = self.complete()
            return done[-1] if done else None
        path = Path(resume)
        if (path / "train_state.json").is_file():
            return path
        for root in (path / "checkpoints", path):  # a run directory, or its checkpoints directory
            found = CheckpointManager(root, self.keep_last).find_resume("auto") if root.is_dir() else None
            if found is not None:
                return found
        raise UserError(
            f"checkpoint.resume = {resume!r} holds no checkpoint; accepted: auto, none, "
            "a step_<N> checkpoint directory, or a run directory that has checkpoints"
        )

    def load(self, path: Path, engine) -> dict:
        """Restore model, optimizer and this rank's RNG; return the JSON train state."""
        try:
            train_state = json.loads((path / "train_state.json").read_text())
            state = engine.state_dict()
            dcp.load(state, checkpoint_id=path / "state")
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"checkpoint {path} cannot be loaded: {str(exc).splitlines()[0]}") from None
        engine.load_state_dict(state)
        rng_file = path / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            restore_rng(json.loads(rng_file.read_text()))
        return train_state
