"""Which checkpoint a run resumes from: ``latest``, else the newest sound one, or the one the user named.

Reading only: nothing here changes a checkpoints directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from treadle.checkpoint.layout import STEP_DIR, complete_steps, link_target, link_text
from treadle.checkpoint.remote import RemotePath, as_path
from treadle.checkpoint.validate import damage
from treadle.errors import UserError

log = logging.getLogger("treadle")

_PATH_ACCEPTED = "accepted: a step_<N> checkpoint directory, or a run directory that has checkpoints"
_RESUME_ACCEPTED = "accepted: auto, none, a step_<N> checkpoint directory, or a run directory that has checkpoints"


def newest_valid(root: Path | RemotePath) -> Path | RemotePath | None:
    """``latest`` if sound, else the newest sound ``step_<N>``, saying in one line what was skipped.

    None if ``root`` holds no checkpoint at all; UserError if it holds only damaged ones,
    because starting afresh over them would throw the run away.
    """
    skipped = []
    link = root / "latest"
    target = link_target(link)
    if target is not None:
        reason = damage(target) if target.is_dir() else "it points to a missing directory"
        if reason is None:
            return target
        skipped.append(f"latest -> {link_text(link)} ({reason})")
    done = [p for p in reversed(complete_steps(root)) if target is None or p.name != target.name]
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


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from (``checkpoint.resume``).

    ``none`` -> None. ``auto`` -> ``latest`` if sound, else the newest sound checkpoint
    (one warning line names what was skipped and why), None if there is none; UserError
    if every one is damaged. A path: see ``checkpoint_at``.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return newest_valid(as_path(root))
    return checkpoint_at(as_path(resume), f"checkpoint.resume = {resume!r}", _RESUME_ACCEPTED)


def checkpoint_at(path: Path, named: str, accepted: str = _PATH_ACCEPTED) -> Path:
    """The checkpoint a path the user gave stands for: a checkpoint directory, which must be sound, or a run /
    checkpoints directory searched like ``auto``; UserError otherwise.

    ``named`` is how the user gave the path (``checkpoint.resume = '...'``, ``treadle export SOURCE '...'``):
    messages name what the user typed, not a key of another command.
    """
    if not path.exists():
        raise UserError(f"{named} does not exist; {accepted}")
    if STEP_DIR.match(path.name) or (path / "train_state.json").exists() or (path / "state").is_dir():
        reason = damage(path)
        if reason is not None:
            raise UserError(f"{named} is not a usable checkpoint: {reason}; {accepted}")
        return path
    for candidate in (path / "checkpoints", path):  # a run directory, or its checkpoints directory
        found = newest_valid(candidate) if candidate.is_dir() else None
        if found is not None:
            return found
    raise UserError(f"{named} holds no checkpoint; {accepted}")
