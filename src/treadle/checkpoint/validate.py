"""Whether a checkpoint directory can be resumed from, checked without loading (or unpickling) its tensors."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from treadle.checkpoint.remote import COMMITTED, RemotePath, as_path
from treadle.checkpoint.safety import CheckpointDamaged, read_metadata, vet_deepspeed
from treadle.engine.deepspeed import TAG, meta_problem


# Where a DeepSpeed checkpoint keeps its companions' state (CheckpointManager.companions), in DCP's format: DeepSpeed's
# own files hold only its engine's module and optimizer.
COMPANIONS = "companions"


def checkpoint_format(path: Path) -> str:
    """``dcp`` (``state/``) or ``deepspeed`` (``deepspeed/``, written by the DeepSpeed engine)."""
    return "deepspeed" if (path / "deepspeed").is_dir() and not (path / "state").is_dir() else "dcp"


def read_json_object(file: Path, ckpt: Path) -> dict:
    """A checkpoint's JSON file as a dict; CheckpointDamaged naming it if it is missing, unreadable or not an object."""
    rel = file.relative_to(ckpt)
    if not file.is_file():
        raise CheckpointDamaged(ckpt, f"{rel} is missing")
    try:
        obj = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointDamaged(ckpt, f"{rel} is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise CheckpointDamaged(ckpt, f"{rel} is not a JSON object")
    return obj


# What a run's train state holds (Trainer.state_dict); the manager itself stores any JSON object.
_RUN_STATE = {"train": dict, "meta": dict, "loader": dict, "schedule": dict, "callbacks": dict}


def run_state(ckpt: Path) -> dict:
    """A run checkpoint's train_state.json, checked to hold what a trainer wrote (a step, meta, loader and schedule
    state); CheckpointDamaged naming what is missing, so a hand-edited or foreign file is one line, not a KeyError."""
    state = read_json_object(ckpt / "train_state.json", ckpt)
    for key, kind in _RUN_STATE.items():
        if not isinstance(state.get(key), kind):
            raise CheckpointDamaged(ckpt, f"train_state.json has no {key} object; accepted: a checkpoint treadle wrote")
    step = state["train"].get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointDamaged(ckpt, f"train_state.json has no train.step (found {step!r}); accepted: a checkpoint "
                                "treadle wrote")
    return state


def inspect(path: Path) -> Metadata | None:
    """The checkpoint's vetted DCP metadata (None for DeepSpeed's format, whose pickles are vetted here too);
    CheckpointDamaged saying what is wrong."""
    if not path.is_dir():
        raise CheckpointDamaged(path, "no such directory")
    if isinstance(path, RemotePath) and not (path / COMMITTED).is_file():
        raise CheckpointDamaged(path, f"it was never committed (no {COMMITTED} object: a save that did not finish)")
    read_json_object(path / "train_state.json", path)
    if not (path / "config.toml").is_file():
        raise CheckpointDamaged(path, "config.toml is missing")
    rng = path / "rng"
    if not rng.is_dir() or not any(rng.glob("rank_*.json")):
        raise CheckpointDamaged(path, "rng/ (the RNG states) is missing")
    for f in sorted(rng.glob("rank_*.json")):
        read_json_object(f, path)
    if checkpoint_format(path) == "deepspeed":
        _inspect_deepspeed(path)
        return None
    return vetted_dcp(path, "state")


def vetted_dcp(path: Path, sub: str) -> Metadata:
    """The DCP metadata of ``path / sub``, every byte range it names present (catches truncated or missing .distcp
    files)."""
    md = read_metadata(path / sub, path)
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointDamaged(path, f"{sub}/.metadata names an invalid data file {rel!r}")
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in ends.items():
        f = path / sub / rel
        if not f.is_file():
            raise CheckpointDamaged(path, f"{sub}/{rel} is missing")
        if f.stat().st_size < end:
            raise CheckpointDamaged(path, f"{sub}/{rel} is truncated ({f.stat().st_size} bytes, {end} expected)")
    return md


def _inspect_deepspeed(path: Path) -> None:
    """DeepSpeed's own format: treadle's record is sound, and every file DeepSpeed will unpickle passed the allow-list."""
    ds = path / "deepspeed"
    problem = meta_problem(ds)
    if problem is not None:
        raise CheckpointDamaged(path, f"deepspeed/{problem}")
    if not any((ds / TAG).glob("*model_states.pt")):
        raise CheckpointDamaged(path, f"deepspeed/{TAG}/ holds no model_states.pt")
    vet_deepspeed(ds, path)
    if (path / COMPANIONS).is_dir():  # a draft beside its target: its weights and optimizer, DCP beside DeepSpeed's
        vetted_dcp(path, COMPANIONS)


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None if it is complete and sound."""
    try:
        inspect(as_path(path))
    except CheckpointDamaged as exc:
        return exc.reason
    return None
