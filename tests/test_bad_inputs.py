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


def _user_export(world: World) -> Path:
    """A copy of treadle's own export into which the user has put a file of theirs."""
    mixed = world.root / "mixed"
    shutil.copytree(world.run / "hf", mixed)
    (mixed / "README.md").write_text("my notes on this model\n")
    return mixed


@pytest.mark.parametrize("case", ["into_user_dir", "draft_into_user_dir", "onto_user_file", "into_mixed_export",
                                  "through_symlink"])
def test_export_never_replaces_what_treadle_did_not_write(world, refused, case):
    """Hole 1: `treadle export RUN OUT` replaced a user's directory wholesale, or renamed a user's file aside."""
    out, also, expect = {
        "into_user_dir": (world.user, (), "holds notes.jsonl and is not treadle's own export"),
        "draft_into_user_dir": (world.user, (), "is not treadle's own export output"),
        "onto_user_file": (world.thesis, (), "is a file, not a directory"),
        "into_mixed_export": (None, (world.root / "mixed",), "holds README.md, which treadle did not write"),
        "through_symlink": (world.root / "link", (world.root / "link",), "is a symbolic link"),
    }[case]
    if case == "into_mixed_export":
        out = _user_export(world)
    if case == "through_symlink":
        out.symlink_to(world.user)
    to = "draft" if case.startswith("draft") else "hf"
    refused(["export", world.run, "--to", to, out], expect, *also)
    assert not [p for p in world.root.iterdir() if p.name.startswith((".old-", ".tmp-"))]


def test_a_run_refuses_to_export_over_a_user_file_in_its_hf_dir(world, refused):
    """Hole 1: the run's own end-of-run export replaced <output_dir>/hf whatever it held; refused before any step."""
    (world.run / "hf" / "thesis.txt").write_text("mine\n")
    refused(world.args(world.run, "--checkpoint.every=1", "--checkpoint.keep_last=2"), "the run's export")


def _writer(world: World, case: str) -> tuple[list, str]:
    """(argv, expected words) of a command told to write onto a user's path."""
    text = world.root / "doc.txt"
    text.write_text("x = 1\n")
    prepare = ["prepare", text, "--tokenizer", world.shards / "tok", "--workers", "1", "--out"]
    spec_eval = ["spec-eval", "--target", world.run, "--draft", "prompt-lookup", "--json"]
    if case == "samples_over_user_file":
        (world.user / "chat.jsonl").write_text('{"messages": []}\n')  # the user's own, named like a samples file
    return {
        "prepare_into_user_dir": ([*prepare, world.user], "holds notes.jsonl and is not treadle's own shards"),
        "prepare_overwrite_user_dir": ([*prepare, world.user, "--overwrite"], "holds notes.jsonl"),
        "prepare_onto_user_file": ([*prepare, world.thesis, "--overwrite"], "is a file, not a directory"),
        "prepare_own_shards_without_overwrite": ([*prepare, world.shards / "train"], "pass --overwrite"),
        "samples_over_user_file": (["samples", "--out", world.user, "--n", "2"],
                                   "chat.jsonl: is a file that is not treadle"),
        "samples_onto_user_file": (["samples", "--out", world.thesis, "--n", "2"], "not a directory"),
        "spec_eval_json_onto_user_file": ([*spec_eval, world.thesis], "is a file that is not treadle"),
        "spec_eval_json_onto_user_jsonl": ([*spec_eval, world.user / "notes.jsonl"], "is a file that is not treadle"),
        "spec_eval_json_onto_user_dir": ([*spec_eval, world.user], "is a directory, not a file"),
    }[case]


@pytest.mark.parametrize("case", ["prepare_into_user_dir", "prepare_overwrite_user_dir", "prepare_onto_user_file",
                                  "prepare_own_shards_without_overwrite", "samples_over_user_file",
                                  "samples_onto_user_file", "spec_eval_json_onto_user_file",
                                  "spec_eval_json_onto_user_jsonl", "spec_eval_json_onto_user_dir"])
def test_commands_refuse_to_write_onto_user_paths(world, refused, case):
    """Hole 1: prepare, samples and spec-eval --json, with and without --overwrite."""
    argv, expect = _writer(world, case)
    refused(argv, expect)


def _generate(world: World, out: Path, *extra: str) -> list[str]:
    prompts = world.root / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(f'{{"prompt": "def f{i}(x):"}}\n' for i in range(3)))
    return ["generate", "--model", str(world.run), "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "3", *extra]


def test_generate_refuses_user_files_and_other_flags(world, refused, capsys):
    """Hole 1: a user's one-line file at --out was cut as a 'torn last line'; hole 10c: a rerun with other flags
    over an earlier output skipped every row, mixing two settings in one file."""
    refused(_generate(world, world.thesis), "is a file that is not treadle")
    refused(_generate(world, world.user / "notes.jsonl"), "is a file that is not treadle")
    fresh = world.root / "fresh.jsonl"
    Path(f"{fresh}.failed.jsonl").write_text("my list of failures\n")
    refused(_generate(world, fresh), "fresh.jsonl.failed.jsonl: is a file that is not treadle",
            Path(f"{fresh}.failed.jsonl"))

    out = world.root / "gen.jsonl"
    assert main(_generate(world, out)) == 0
    capsys.readouterr()
    beside = (out, Path(f"{out}.settings.json"))
    line = refused(_generate(world, out, "--seed", "1", "--temperature", "0.5"), "--temperature 0.0 -> 0.5", *beside)
    assert "--seed 0 -> 1" in line and "choose a new --out" in line and "--max-new-tokens" not in line
    refused(_generate(world, out, "--max-new-tokens", "4"), "--max-new-tokens 3 -> 4", *beside)
    refused(_generate(world, out, "--chat-template", "builtin"), '--chat-template "auto" -> "builtin"', *beside)
    refused(_generate(world, out, "--max-prompt-tokens", "64"), "--max-prompt-tokens null -> 64", *beside)
    other = world.root / "other-model"
    shutil.copytree(world.run / "hf", other)
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    refused(_generate(world, out, "--model", other), "--model", *beside)
    # --batch-size only changes rounding: the same output continues (everything is already there).
    assert main(_generate(world, out, "--batch-size", "1")) == 0


# ---------------------------------------------------------------------------- checkpoints and pickles (hole 2)


# ---------------------------------------------------------------------------- data (holes 3, 4, 5, 10a, 10b)


# ---------------------------------------------------------------------------- resume (holes 6, 7, 8)
