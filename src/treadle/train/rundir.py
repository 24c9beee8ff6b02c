"""The run directory (``train.output_dir``): what counts as a treadle run, and what a resume may change there.

A run directory is treadle's when it carries the marker ``.treadle-run`` (written when a run first claims the
directory) or, for runs from before the marker, looks like one (``is_treadle_run``). Anything else that is not
empty is a user's and is refused before a byte is written.

A resume is checked before anything is written (``check_resume``):
- a checkpoint from outside the run directory may start a new or empty directory, never one that holds a run
  (it would replace that run's checkpoints and splice another run into its metrics);
- an older checkpoint of this run, while newer sound ones exist, needs ``checkpoint.allow_rollback`` (the newer
  ones are then removed: a crash later must not resume the abandoned branch);
- another ``data.seq_len`` or ``train.seed`` cannot continue the data order: refused, naming the remedy;
- a config that gives another learning rate at the resumed step (another peak lr, max_steps re-stretching a
  decaying schedule, schedule.*, data.phases) needs ``checkpoint.allow_schedule_change``.
Every changed key is printed in one block, and the checkpoint's config is kept beside the new ``config.toml`` as
``config.step_<N>.toml`` (the config that trained the steps up to N).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from treadle.checkpoint.compat import check_compatible
from treadle.checkpoint.layout import step_of
from treadle.checkpoint.manager import CheckpointManager
from treadle.checkpoint.remote import RemotePath, as_path, check_store
from treadle.checkpoint.remote_manager import refuse_engine
from treadle.checkpoint.validate import run_state
from treadle.config import (
    Config,
    OptimConfig,
    PhaseConfig,
    ScheduleConfig,
    TrainConfig,
    changed_keys,
    save_config,
    show_value,
    to_toml,
)
from treadle.engine.optim import lr_function
from treadle.errors import UserError, first_line

MARKER = ".treadle-run"
OWNER = ".treadle-run.json"  # in an explicit checkpoint.dir: the train.output_dir of the run that owns it
_ACCEPTED_DIR = "accepted: a new or empty directory, or a treadle run directory"
# How this invocation starts, not how the run trains: never reported as a change, and saved with these values so
# that running the run directory's config.toml again continues this run (and grants no permission again).
_INVOCATION = {"checkpoint.resume": "auto", "checkpoint.allow_schedule_change": False, "checkpoint.allow_rollback": False}
_SCHEDULE_KEYS = ("optim.lr", "train.max_steps", "schedule.", "data.phases")
_DATA_ORDER_KEYS = ("data.seq_len", "data.val_fraction", "train.seed")  # the saved data position means nothing under others


def is_treadle_run(path: Path) -> bool:
    """Whether ``path`` is a run directory treadle made.

    It is when it carries the marker written at the run's creation, or (a run from before the marker) holds a
    resolved treadle config.toml (every table one of Config's sections, train/model/data among them) beside
    metrics.jsonl or checkpoints/.
    """
    if (path / MARKER).is_file():
        return True
    try:
        tables = tomllib.loads((path / "config.toml").read_text()).keys()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    resolved = {"train", "model", "data"} <= tables <= Config.model_fields.keys()
    return resolved and ((path / "metrics.jsonl").is_file() or (path / "checkpoints").is_dir())


def check_output_dir(out: Path) -> None:
    """UserError unless ``out`` is missing, an empty directory or a treadle run. Reads only."""
    if out.exists() and not out.is_dir():
        raise UserError(f"train.output_dir = {str(out)!r} is a file, not a directory; {_ACCEPTED_DIR}")
    try:
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    except OSError as exc:
        raise UserError(f"train.output_dir = {str(out)!r} cannot be read ({exc.strerror}); {_ACCEPTED_DIR}") from None
    if entries and not is_treadle_run(out):
        raise UserError(f"train.output_dir = {str(out)!r} holds files that are not a treadle run ({', '.join(entries[:3])}"
                        f"{', ...' if len(entries) > 3 else ''}); {_ACCEPTED_DIR} (one holding {MARKER})")


def checkpoint_dir(cfg: Config, engine: str) -> Path | RemotePath:
    """Where the run's checkpoints go: ``checkpoint.dir``, else ``<output_dir>/checkpoints``. An object store is
    checked from every rank (each writes its own shards): a backend for its scheme, reachable, the bucket there,
    writable; and an engine that cannot write there refused. One line each, before anything is written."""
    if cfg.checkpoint.dir is None:
        return Path(cfg.train.output_dir) / "checkpoints"
    root = as_path(cfg.checkpoint.dir)
    if isinstance(root, RemotePath):
        refuse_engine(cfg.checkpoint.dir, engine)
        check_store(root)
    return root


def check_checkpoint_owner(cfg: Config, root: Path | RemotePath) -> None:
    """UserError if an explicit ``checkpoint.dir`` holds another run's checkpoints; reads only (rank 0).

    Its owner is the run's ``train.output_dir`` as configured, recorded in ``OWNER`` there: a job restarted on
    another node, whose local disk is empty, is the same run and resumes from the store.
    """
    if cfg.checkpoint.dir is None or root == Path(cfg.train.output_dir) / "checkpoints":
        return  # <output_dir>/checkpoints: the run directory's own marker says whose it is
    try:
        owner = json.loads((root / OWNER).read_text()).get("output_dir")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, AttributeError):
        owner = "(unreadable)"
    key = f"checkpoint.dir = {cfg.checkpoint.dir!r}"
    if owner is not None and os.path.normpath(owner) != os.path.normpath(cfg.train.output_dir):
        raise UserError(f"{key} holds another run's checkpoints (the run with train.output_dir = {owner!r}): "
                        "resuming would splice that run into this one; accepted: an empty location, or that run's "
                        "train.output_dir")
    entries = [p.name for p in root.iterdir()] if root.is_dir() else []
    if owner is None and entries:
        raise UserError(f"{key} holds {sorted(entries)[0]} and is no treadle run's checkpoint location (it has no "
                        f"{OWNER}); accepted: an empty location")


def claim_checkpoint_dir(root: Path | RemotePath, output_dir: str) -> None:
    """Record the run as the owner of its explicit ``checkpoint.dir`` (rank 0, with the run's first write)."""
    if not (root / OWNER).is_file():
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
        (root / OWNER).write_text(json.dumps({"output_dir": output_dir}) + "\n")


def prepare_output_dir(out: Path, cfg: Config, checkpoints: CheckpointManager) -> None:
    """The run's first write: the directory and the marker that makes it a treadle run, then a write probe."""
    if cfg.checkpoint.resume == "none" and checkpoints.complete():
        raise UserError(
            f"train.output_dir {out} already holds checkpoints and checkpoint.resume = 'none'; "
            "accepted: checkpoint.resume = 'auto' to continue it, or another train.output_dir"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / MARKER).is_file():  # before any other write: a kill after it leaves a directory known as a run
            created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            (out / MARKER).write_text(json.dumps({"treadle_run": 1, "created": created}) + "\n")
        probe = out / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"train.output_dir = {str(out)!r} is not writable ({exc.strerror}); accepted: a directory you can write") from None


@dataclass
class Resume:
    """A checked resume: the checkpoint, its step, and what this run's config changes (key, old, new)."""

    checkpoint: Path
    step: int
    changes: list[tuple[str, Any, Any]]
    rollback: list[Path]  # newer checkpoints of this run to retire (checkpoint.allow_rollback)

    def describe(self, kept: Path | None) -> str | None:
        if not self.changes:
            return None
        where = f" (the previous config is kept as {kept})" if kept else ""
        lines = [f"  {k}: {show_value(old)} -> {show_value(new)}" for k, old, new in self.changes]
        return f"changed since {self.checkpoint.name}{where}:\n" + "\n".join(lines)


def _holds_run(out: Path, checkpoints: CheckpointManager) -> bool:
    metrics = out / "metrics.jsonl"
    return bool(checkpoints.complete()) or (metrics.is_file() and metrics.stat().st_size > 0)


def _check_source(cfg: Config, out: Path, ckpt: Path, checkpoints: CheckpointManager) -> list[Path]:
    """Refuse a resume that would overwrite a run; return the newer checkpoints an allowed rollback retires."""
    root = checkpoints.root
    if not (isinstance(ckpt, type(root)) and ckpt.resolve().is_relative_to(root.resolve())):
        if _holds_run(out, checkpoints):
            raise UserError(
                f"checkpoint.resume = {str(ckpt)!r} is another run's checkpoint, and train.output_dir {out} already "
                f"holds a run: resuming would replace its checkpoints and metrics; accepted: a new train.output_dir "
                f"to continue {ckpt} there")
        return []
    if cfg.checkpoint.resume == "auto":
        return []  # latest, or the newest sound one: anything newer is damaged
    newer = [p for p in checkpoints.complete() if step_of(p) > step_of(ckpt) and checkpoints.damage(p) is None]
    if newer and not cfg.checkpoint.allow_rollback:
        raise UserError(
            f"checkpoint.resume = {str(ckpt)!r} is an older checkpoint of this run, which has newer ones "
            f"({', '.join(p.name for p in newer)}): resuming would roll the run back and replace them; accepted: "
            f"checkpoint.resume = 'auto' to continue it, a new train.output_dir to branch from {ckpt.name}, or "
            "checkpoint.allow_rollback = true to roll this run back (the newer checkpoints are removed)")
    return newer


def _read(ckpt: Path) -> tuple[dict, dict]:
    """The checkpoint's config tree and train state (both checked readable by ``check_compatible`` / ``damage``)."""
    try:
        then = tomllib.loads((ckpt / "config.toml").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"checkpoint {ckpt}: config.toml is unreadable ({first_line(exc)})") from None
    return then, run_state(ckpt)


def _lr_at(tree: dict, position: int, step: int) -> float:
    """The lr a config tree gives the update after ``position`` applied updates, at step ``step`` (its data phase's
    lr_scale included). Only what the schedule reads is validated: a checkpoint's whole config need not load."""
    cfg = Config(**{name: model.model_validate(tree.get(name, {}))
                    for name, model in (("train", TrainConfig), ("optim", OptimConfig), ("schedule", ScheduleConfig))})
    phases = [PhaseConfig.model_validate(p) for p in tree.get("data", {}).get("phases", [])]
    scale = [p.lr_scale for p in phases if p.start_step <= step]
    return cfg.optim.lr * lr_function(cfg)(position) * (scale[-1] if scale else 1.0)


def _check_continuity(cfg: Config, ckpt: Path, then: dict, state: dict, changes: list) -> None:
    step, run = state["train"]["step"], ckpt.parent.parent
    for key, old, new in changes:
        if key in _DATA_ORDER_KEYS:
            weights = "" if cfg.draft.frozen_target else f" started from its weights (--model.path={run})"
            raise UserError(
                f"checkpoint {ckpt} was trained with {key} = {show_value(old)}, this run has {show_value(new)}: its data "
                f"position does not carry over; accepted: {key} = {show_value(old)} to continue it, or a new "
                f"train.output_dir{weights}")
    if cfg.checkpoint.allow_schedule_change:
        return
    position = state.get("schedule", {}).get("last_epoch", step)  # applied updates: skipped steps do not count
    try:
        old = _lr_at(then, position, step)
    except (ValidationError, TypeError, AttributeError) as exc:
        raise UserError(f"checkpoint {ckpt}: the schedule in its config.toml does not validate ({first_line(exc)}), so "
                        "it cannot be compared; accepted: checkpoint.allow_schedule_change = true") from None
    new = _lr_at(tomllib.loads(to_toml(cfg)), position, step)
    if not math.isclose(old, new, rel_tol=1e-9):
        keys = [f"{k} {show_value(a)} -> {show_value(b)}" for k, a, b in changes if k.startswith(_SCHEDULE_KEYS)]
        raise UserError(
            f"resuming {ckpt} at step {step} with {', '.join(keys) or 'another schedule'} changes the learning rate "
            f"there from {old:.4g} to {new:.4g}: the schedule would not continue; accepted: the checkpoint's values, "
            "or checkpoint.allow_schedule_change = true to change the schedule knowingly")


def check_resume(cfg: Config, out: Path, ckpt: Path | None, checkpoints: CheckpointManager, meta: dict) -> Resume | None:
    """Every refusal a resume can meet, before anything is written (rank 0). Reads only."""
    if ckpt is None:
        return None
    rollback = _check_source(cfg, out, ckpt, checkpoints)
    check_compatible(ckpt, to_toml(cfg), meta)  # another model or tokenizer: refused before the first write
    then, state = _read(ckpt)
    changes = [c for c in changed_keys(then, tomllib.loads(to_toml(cfg))) if c[0] not in _INVOCATION]
    _check_continuity(cfg, ckpt, then, state, changes)
    return Resume(ckpt, state["train"]["step"], changes, rollback)


def save_run_config(cfg: Config, out: Path, resume: Resume | None) -> Path | None:
    """config.toml = this run's config (re-runnable as is); a resume with changes keeps the checkpoint's config
    beside it as ``config.step_<N>.toml``, whose path is returned."""
    kept = None
    if resume is not None and resume.changes:
        kept = out / f"config.step_{resume.step}.toml"
        if not kept.exists():  # an earlier attempt at the same resume already kept the original
            tmp = kept.with_name(f".{kept.name}.tmp")
            tmp.write_bytes((resume.checkpoint / "config.toml").read_bytes())
            tmp.replace(kept)
    saved = cfg.model_copy(deep=True)
    for key, value in _INVOCATION.items():
        section, name = key.split(".")
        setattr(getattr(saved, section), name, value)
    save_config(saved, out / "config.toml")
    return kept
