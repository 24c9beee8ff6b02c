"""Whether a checkpoint directory can be resumed from, checked without loading (or unpickling) its tensors."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from treadle.checkpoint.safety import CheckpointDamaged, read_metadata


def checkpoint_format(path: Path) -> str:
    """``dcp`` (``state/``) or ``deepspeed`` (``deepspeed/``, written by the DeepSpeed engine)."""
    return "deepspeed" if (path / "deepspeed").is_dir() and not (path / "state").is_dir() else "dcp"


def inspect(path: Path) -> Metadata | None:
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
        inspect(Path(path))
    except CheckpointDamaged as exc:
        return exc.reason
    return None
