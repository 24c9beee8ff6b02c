"""Bad input through the real CLI: one ``treadle:`` line, exit code 2, no traceback, nothing on disk changed.

Every case runs ``treadle.cli.main`` in-process (the same function the console script calls) with stderr
captured, next to a good run directory and a user's own files, and checks that both are byte-identical
afterwards (``Watched``). A few cases run as real subprocesses, where only a fresh interpreter tells the truth
(a crafted pickle that would run code, the console script itself).

Sections follow the holes of issue 12 they pin; a case that names a hole failed before its fix.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import args
from treadle.cli import main


# ---------------------------------------------------------------------------- the harness


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry under ``roots``: files by content hash and mode, symlinks by target, directories by mode."""
    out: dict[str, tuple] = {}
    for root in roots:
        if not root.exists() and not root.is_symlink():
            out[str(root)] = ("absent",)
            continue
        entries = [root] + (sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])
        for p in entries:
            st = p.lstat()
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = ("dir", st.st_mode)
            else:
                out[str(p)] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


class Watched:
    """Paths that a refused command must leave exactly as they were."""

    def __init__(self, *roots: Path):
        self.roots = roots
        self.before = snapshot(*roots)

    def assert_unchanged(self) -> None:
        after = snapshot(*self.roots)
        changed = sorted(k for k in self.before.keys() | after.keys() if self.before.get(k) != after.get(k))
        assert not changed, f"changed on disk: {changed[:5]}"


def _check_one_line(rc: int, stderr: str, expect: str | None, code: int = 2) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("treadle:")]
    assert len(lines) == 1, f"expected exactly one treadle: line, got {stderr!r}"
    assert rc == code, f"exit code {rc} ({lines[0]})"
    if expect is not None:
        assert expect in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def refused(capsys, world):
    """``refused(argv, expect, *also_watch)``: run the CLI in-process; assert one line, exit 2, nothing changed."""

    def run(argv: list[str], expect: str | None = None, *also_watch: Path, code: int = 2) -> str:
        watched = Watched(*world.watched, *also_watch)
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        line = _check_one_line(rc, capsys.readouterr().err, expect, code)
        watched.assert_unchanged()
        return line

    return run


def refused_subprocess(argv: list[str], expect: str | None, *watch: Path, env: dict | None = None) -> str:
    """The same checks on a real ``python -m treadle`` process."""
    watched = Watched(*watch)
    proc = subprocess.run([sys.executable, "-m", "treadle", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    line = _check_one_line(proc.returncode, proc.stderr, expect)
    watched.assert_unchanged()
    return line


class World:
    """A good, finished run (two checkpoints, an export) and a user's own files beside it."""

    def __init__(self, root: Path, shards: Path):
        self.root, self.shards = root, shards
        self.run = root / "runs" / "good"
        self.user = root / "mine"  # a user's directory: nothing treadle does may touch it
        self.thesis = self.user / "thesis.txt"

    @property
    def watched(self) -> tuple[Path, ...]:
        return (self.run, self.user, self.shards)

    def args(self, out: Path, *extra: str) -> list[str]:
        return args(self.shards, out, "--train.max_steps=2", "--train.eval_batches=1", *extra)


@pytest.fixture(scope="module")
def world_template(shards, tmp_path_factory) -> World:
    w = World(tmp_path_factory.mktemp("world"), shards)
    assert main(w.args(w.run, "--checkpoint.every=1", "--checkpoint.keep_last=2")) == 0
    w.user.mkdir()
    w.thesis.write_text("four years of work\n")
    (w.user / "notes.jsonl").write_text('{"text": "mine"}\n')
    return w


@pytest.fixture
def world(world_template, tmp_path) -> World:
    """A private copy of the good world, so a case that fails its checks cannot spoil the next one."""
    w = World(tmp_path / "w", world_template.shards)
    shutil.copytree(world_template.root, w.root, symlinks=True)
    return w


def ckpt(w: World, step: int = 2) -> Path:
    return w.run / "checkpoints" / f"step_{step}"


def test_harness_sees_a_change_and_a_second_line(world, capsys):
    """The checks can fail: a changed byte, a second treadle line and exit 0 are all caught."""
    watched = Watched(world.run, world.user)
    world.thesis.write_text("four years of work!\n")
    with pytest.raises(AssertionError, match="changed on disk"):
        watched.assert_unchanged()
    with pytest.raises(AssertionError, match="exactly one"):
        _check_one_line(2, "treadle: error: a\ntreadle: error: b\n", None)
    with pytest.raises(AssertionError, match="exit code 0"):
        _check_one_line(0, "treadle: error: a\n", None)


# ---------------------------------------------------------------------------- config and flags


# ---------------------------------------------------------------------------- output paths (holes 1, 9, 10c)


# ---------------------------------------------------------------------------- checkpoints and pickles (hole 2)


# ---------------------------------------------------------------------------- data (holes 3, 4, 5, 10a, 10b)


# ---------------------------------------------------------------------------- resume (holes 6, 7, 8)


class RunsCode:
    """Unpickling this runs a shell command, what an attacker puts in a checkpoint: it leaves ``marker`` behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _craft_pickle(file: Path, marker: Path, **save_kwargs) -> None:
    import torch

    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(RunsCode(marker), file, **save_kwargs)


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _craft_bytes_entry(ckpt_dir: Path, marker: Path) -> None:
    """A non-tensor DCP entry (the optimizer's lr) whose bytes run code (plain DCP reads them with weights_only=False)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    state = ckpt_dir / "state"
    with open(state / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own good checkpoint
    _craft_pickle(state / "evil.distcp", marker)
    md.storage_data[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("evil.distcp", 0, (state / "evil.distcp").stat().st_size)
    with open(state / ".metadata", "wb") as f:
        pickle.dump(md, f)


# name: (how the checkpoint is spoiled, given (checkpoint dir, marker), what the one line must say)
DCP_DAMAGE = {
    "metadata_pickle": (lambda c, m: (c / "state" / ".metadata").write_bytes(__import__("pickle").dumps(RunsCode(m))),
                        "state/.metadata contains a pickled object of type posix.system, refused"),
    "metadata_truncated": (lambda c, m: _truncate(c / "state" / ".metadata"), "state/.metadata is unreadable"),
    "metadata_garbage": (lambda c, m: (c / "state" / ".metadata").write_bytes(b"\x80\x04garbage"), "state/.metadata is unreadable"),
    "distcp_truncated": (lambda c, m: _truncate(next((c / "state").glob("*.distcp"))), "is truncated"),
    "train_state_truncated": (lambda c, m: _truncate(c / "train_state.json"), "train_state.json is not valid JSON"),
    "train_state_not_utf8": (lambda c, m: (c / "train_state.json").write_bytes(b"\xff\xfe{"), "train_state.json is not valid JSON"),
    "rng_garbled": (lambda c, m: (c / "rng" / "rank_0.json").write_text('{"python": [3, '), "rng/rank_0.json is not valid JSON"),
    "rng_not_an_object": (lambda c, m: (c / "rng" / "rank_0.json").write_text("[1, 2]"), "rng/rank_0.json is not a JSON object"),
    "config_garbled": (lambda c, m: (c / "config.toml").write_text("[model\n"), "config.toml"),
}


@pytest.mark.parametrize("via", ["export", "resume"])
@pytest.mark.parametrize("case", DCP_DAMAGE)
def test_crafted_or_damaged_dcp_checkpoint_is_refused(world, refused, tmp_path, case, via):
    """Every spoiled DCP checkpoint: one line naming the checkpoint and the file, nothing ran, nothing changed."""
    spoil, expect = DCP_DAMAGE[case]
    marker = tmp_path / "pwned"
    spoil(ckpt(world), marker)
    argv = (["export", ckpt(world), tmp_path / "out"] if via == "export"
            else world.args(tmp_path / "new", f"--checkpoint.resume={ckpt(world)}"))
    line = refused(argv, expect)
    assert str(ckpt(world)) in line and not marker.exists()


def test_crafted_dcp_bytes_entry_is_refused_on_resume(world, refused, tmp_path):
    marker = tmp_path / "pwned"
    _craft_bytes_entry(ckpt(world), marker)
    refused(world.args(tmp_path / "new", f"--checkpoint.resume={ckpt(world)}"),
            "optim.param_groups.0.lr contains a pickled object of type posix.system, refused")
    assert not marker.exists()


@pytest.fixture(scope="module")
def ds_template(shards, tmp_path_factory) -> Path:
    """A finished 2-step DeepSpeed ZeRO-1 run at world size 1 (its own process: DeepSpeed needs a process group)."""
    from tests.distributed import free_port

    run = tmp_path_factory.mktemp("ds") / "run"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "treadle", *map(str, args(
        shards, run, "--train.max_steps=2", "--train.eval_batches=1", "--distributed.engine=deepspeed",
        "--distributed.zero_stage=1"))], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def ds_run(ds_template, tmp_path) -> Path:
    run = tmp_path / "ds"
    shutil.copytree(ds_template, run, symlinks=True)
    return run


def _ds_files(c: Path) -> Path:
    return c / "deepspeed" / "state"


DS_DAMAGE = {
    "model_states_pickle": (lambda c, m: _craft_pickle(_ds_files(c) / "mp_rank_00_model_states.pt", m),
                            "deepspeed/state/mp_rank_00_model_states.pt contains a pickled object of type posix.system, refused"),
    # Protocol 4 names globals with STACK_GLOBAL, which torch's own static scan does not see.
    "optim_states_pickle_protocol4": (
        lambda c, m: _craft_pickle(_ds_files(c) / "zero_pp_rank_0_mp_rank_00_optim_states.pt", m, pickle_protocol=4),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt contains a pickled object of type posix.system, refused"),
    "legacy_format_pickle": (
        lambda c, m: _craft_pickle(_ds_files(c) / "mp_rank_00_model_states.pt", m, _use_new_zipfile_serialization=False),
        "mp_rank_00_model_states.pt is not a torch.save zip archive"),
    # Any *.pt DeepSpeed may open, e.g. a universal checkpoint's (load_universal reads zero/<param>/fp32.pt).
    "universal_pt_pickle": (lambda c, m: _craft_pickle(c / "deepspeed" / "state_universal" / "zero" / "x" / "fp32.pt", m),
                            "state_universal/zero/x/fp32.pt contains a pickled object of type posix.system, refused"),
    "model_states_truncated": (lambda c, m: _truncate(_ds_files(c) / "mp_rank_00_model_states.pt"),
                               "mp_rank_00_model_states.pt is unreadable"),
    "meta_garbled": (lambda c, m: (c / "deepspeed" / "treadle_deepspeed.json").write_text("{"),
                     "deepspeed/treadle_deepspeed.json is not valid JSON"),
}


@pytest.mark.parametrize("via", ["export", "resume"])
@pytest.mark.parametrize("case", DS_DAMAGE)
def test_crafted_or_damaged_deepspeed_checkpoint_is_refused(world, refused, ds_run, tmp_path, monkeypatch, case, via):
    """A DeepSpeed checkpoint is vetted before DeepSpeed (which unpickles with weights_only=False) sees it."""
    from tests.distributed import free_port

    spoil, expect = DS_DAMAGE[case]
    marker, step = tmp_path / "pwned", ds_run / "checkpoints" / "step_2"
    spoil(step, marker)
    if via == "export":
        argv = ["export", step, tmp_path / "out"]
    else:  # a DeepSpeed resume at world size 1, in a process group of one
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port())}.items():
            monkeypatch.setenv(k, v)
        argv = world.args(tmp_path / "new", "--distributed.engine=deepspeed", "--distributed.zero_stage=1",
                          f"--checkpoint.resume={step}")
    line = refused(argv, expect, ds_run)
    assert str(step) in line and not marker.exists()


def test_crafted_deepspeed_checkpoint_runs_nothing_in_a_real_process(ds_run, tmp_path, world):
    """``python -m treadle export`` of a run whose model_states.pt would run ``touch``: one line, exit 2, no file."""
    marker = tmp_path / "pwned"
    _craft_pickle(_ds_files(ds_run / "checkpoints" / "step_2") / "mp_rank_00_model_states.pt", marker)
    import torch

    # The payload is real: an unrestricted load (DeepSpeed's) runs it.
    torch.load(_ds_files(ds_run / "checkpoints" / "step_2") / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    refused_subprocess(["export", ds_run / "checkpoints" / "step_2", tmp_path / "out"],
                       "contains a pickled object of type posix.system, refused", ds_run, *world.watched)
    assert not marker.exists() and not (tmp_path / "out").exists()
