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


def test_a_finished_run_run_again_says_nothing_to_do_in_one_line_and_writes_nothing(world, capsys):
    """docs/checkpoints.md: `treadle train runs/x/config.toml` on a finished run has nothing to do, and says so in
    one line (not "resumed from ..." and the whole summary again), with no eval, export or record written."""
    watched = Watched(*world.watched)
    capsys.readouterr()
    assert main(["train", str(world.run / "config.toml"), f"--train.output_dir={world.run}"]) == 0  # the copy
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0] == f"treadle: {world.run} finished at step 2 (train.max_steps = 2): nothing "\
                                          "to do", out + err
    watched.assert_unchanged()


def test_model_overrides_a_model_with_weights_would_ignore_are_refused(world, refused):
    """model.overrides beside a model.path with weights was silently ignored (the weights keep their config.json):
    an override that disagrees with it is refused in one line; one that agrees stands (tests/test_own_data.py runs
    the recipe's shape keys against the run's own export)."""
    hf = world.run / "hf"
    line = refused(world.args(world.root / "new", f"--model.path={hf}", "--model.overrides={hidden_size=64}"),
                   f"model.overrides.hidden_size = 64 with model.path {hf}, whose weights' config.json has "
                   "hidden_size = 32")
    assert "accepted: model.overrides unset" in line
    refused(world.args(world.root / "new", f"--model.path={hf}", "--model.overrides={rope_theta=1e6}"),
            "model.overrides.rope_theta = 1000000.0 with model.path")


# ---------------------------------------------------------------------------- config and flags


# (flags after the run's own argv, expected words in the one line)
_BAD_FLAGS = [
    (["--train.max_stps=5"], "did you mean train.max_steps"),
    (["--trian.max_steps=5"], "trian"),
    (["--train.max_steps=abc"], "train.max_steps"),
    (["--train.max_steps=-5"], "train.max_steps"),
    (["--schedule.decay=cosin"], "schedule.decay"),
    (["--model.dtype=fp16"], "model.dtype"),
    (["--train.time_limit=3hours"], "3hours"),
    (["--schedule.warmup_steps=5"], "warmup_steps"),
    (["--model.path=gpt2"], "model.path"),
    (["--data.train=/no/such/shards"], "/no/such/shards"),
    (["--data.val=/no/such/val"], "/no/such/val"),
    (["--checkpoint.resume=/no/such/checkpoint"], "/no/such/checkpoint"),
    (["--distributed.engine=ddp"], "torchrun"),
    (["--distributed.zero_stage=4"], "distributed.zero_stage"),
    (["--train.max_steps", "5"], "--train.max_steps=VALUE"),
    (["--data.phases=[{start_step=1,weights={nosuch=1}}]"], "nosuch"),
    (["--model.activation_checkpointing=partial"], "model.activation_checkpointing"),
    (["--model.activation_checkpointing=full", "--model.activation_checkpointing_every=0"],
     "model.activation_checkpointing_every"),
    (["--model.activation_checkpointing_save_ops=['mm']"], "activation_checkpointing = 'selective'"),
    (["--model.activation_checkpointing=selective", "--model.activation_checkpointing_save_ops=['matmull']"],
     "'matmull' is not an aten op"),
    (["--distributed.pipeline_parallel=0"], "distributed.pipeline_parallel"),
    (["--distributed.pipeline_parallel=2", "--distributed.engine=deepspeed"], "PipelineModule refuses ZeRO-2/3"),
    (["--distributed.pipeline_parallel=2", "--draft.kind=glide", "--draft.target=/no/such/target"],
     "not supported for draft runs"),
    (["--distributed.pipeline_parallel=4", "--train.grad_accum_steps=2"], "grad_accum_steps = 2 < pipeline_parallel = 4"),
    (["--distributed.pipeline_parallel=2", "--distributed.pipeline_schedule=interleaved_1f1b",
      "--train.grad_accum_steps=5"], "not a multiple of 2 rounds"),
    (["--distributed.pipeline_parallel=2", "--distributed.pipeline_schedule=gpipe"], "does not divide this launch's 1 processes"),
    (["--distributed.pipeline_parallel=2", "--distributed.pipeline_schedule=gpipe", "--distributed.engine=ddp"],
     "accepted: distributed.engine = auto (each stage whole"),
]


@pytest.mark.parametrize("flags,expect", _BAD_FLAGS, ids=[f[0][0].split("=")[0] + f"-{i}" for i, f in enumerate(_BAD_FLAGS)])
def test_bad_flags_are_one_line(world, refused, flags, expect):
    new = world.root / "runs" / "new"
    argv = [a for a in world.args(new) if not a.startswith("--data.phases")] + flags
    refused(argv, expect, new)


def test_bad_config_files_are_one_line(world, refused):
    new = world.root / "runs" / "new"
    cases = {
        "missing.toml": (None, "missing.toml"),
        "syntax.toml": ("[train\nmax_steps = 3\n", "syntax.toml"),
        "typo.toml": ("[train]\nmax_stepz = 3\n", "did you mean train.max_steps"),
        "latin1.toml": (b"[train]\n# caf\xe9\n", "latin1.toml"),
        "list.toml": ("train = [1, 2]\n", "train"),
    }
    for name, (content, expect) in cases.items():
        path = world.root / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        refused(["train", path, f"--train.output_dir={new}"], expect, new, *([path] if content is not None else []))
    refused(["train", world.user, f"--train.output_dir={new}"], str(world.user), new)  # a directory, not a file


def test_bad_tool_flags_are_one_line(world, refused):
    nowhere = world.root / "nowhere"
    refused(["export", nowhere, world.root / "out"], "nowhere", world.root / "out")
    refused(["export", world.run, world.root / "out", "--extra"], "--extra", world.root / "out")
    refused(["prepare", world.root / "no-such-input.txt", "--out", world.root / "shards-new"], "no-such-input.txt",
            world.root / "shards-new")
    refused(["generate", "--model", nowhere, "--prompts", world.user / "notes.jsonl", "--out", world.root / "g.jsonl"],
            "nowhere", world.root / "g.jsonl")
    refused(["spec-eval", "--target", nowhere, "--draft", "prompt-lookup"], "nowhere")


def test_console_script_refuses_a_bad_toml_in_one_line(world):
    """A real process: what a user's shell sees (exit code, stderr), not only what main() returns."""
    bad = world.root / "bad.toml"
    bad.write_text("[optim]\nlr = 'fast'\n")
    refused_subprocess(["train", bad, f"--train.output_dir={world.root / 'new'}"], "optim.lr", *world.watched,
                       world.root / "new")


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



# ---------------------------------------------------------------------------- data (holes 3, 4, 5, 10a, 10b)


def crafted_shards(world: World, name: str, meta_edit=None, ids: dict[int, int] | None = None) -> Path:
    """A copy of the good train shards beside the user's files: meta.json edited by ``meta_edit(meta)`` (which may
    return the new file's text, or bytes), and token ``i`` set to ``ids[i]`` (uint16)."""
    import json

    import numpy as np

    d = world.root / name
    shutil.copytree(world.shards / "train", d)
    if ids:
        tokens = np.fromfile(d / "tokens.bin", dtype=np.uint16)
        for i, value in ids.items():
            tokens[i] = value
        tokens.tofile(d / "tokens.bin")
    if meta_edit is not None:
        meta = json.loads((d / "meta.json").read_text())
        new = meta_edit(meta)
        new = json.dumps(meta) if new is None else new
        (d / "meta.json").write_bytes(new if isinstance(new, bytes) else new.encode())
    return d


def _without(key):
    return lambda meta: json_text({k: v for k, v in meta.items() if k != key})


def json_text(obj) -> str:
    import json

    return json.dumps(obj)


BROKEN_META = {  # hole 3: each was a JSONDecodeError / TypeError / ValueError traceback, or passed unnoticed
    "not JSON": (lambda m: "{this is not json", "meta.json: not valid JSON"),
    "empty": (lambda m: "", "meta.json: empty; expected the JSON object"),
    "binary garbage": (lambda m: bytes(range(256)) * 4, "meta.json: not UTF-8 text"),
    "a list": (lambda m: json_text([m]), "meta.json: a JSON list, not an object"),
    "num_tokens a string": (lambda m: json_text(dict(m, num_tokens=str(m["num_tokens"]))), "num_tokens = \""),
    "num_documents a string": (lambda m: json_text(dict(m, num_documents="2")), 'num_documents = "2" is not'),
    "missing vocab_size": (_without("vocab_size"), "missing key 'vocab_size'"),
    "unknown format_version": (lambda m: json_text(dict(m, format_version=7)), "format_version 7 is not one"),
    "tokenizer_dir a number": (lambda m: json_text(dict(m, tokenizer_dir=5)), "tokenizer_dir = 5 is not a path"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_META))
def test_broken_shard_meta_is_one_line(world, refused, case):
    edit, expect = BROKEN_META[case]
    d = crafted_shards(world, "crafted", edit)
    out = world.root / "runs" / "new"
    line = refused(world.args(out, f"--data.train={d}"), expect, d, out)
    assert str(d / "meta.json") in line


def test_damaged_shard_files_are_one_line(world, refused):
    import numpy as np

    out = world.root / "runs" / "new"
    d = crafted_shards(world, "short_tokens")
    (d / "tokens.bin").write_bytes((d / "tokens.bin").read_bytes()[:-3])
    refused(world.args(out, f"--data.train={d}"), f"{d / 'tokens.bin'}: ", d, out)
    d = crafted_shards(world, "short_offsets")
    np.save(d / "offsets.npy", np.load(d / "offsets.npy")[:-1])
    refused(world.args(out, f"--data.train={d}"), f"{d / 'offsets.npy'}: expected non-decreasing", d, out)
    d = crafted_shards(world, "garbage_offsets")
    (d / "offsets.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    refused(world.args(out, f"--data.train={d}"), f"{d / 'offsets.npy'}: not a readable .npy array", d, out)


def test_token_ids_beyond_the_vocab_are_refused_before_the_run_starts(world, refused, target_dir):
    """Hole 4: a recorded max_token_id at or past the model's vocab_size is refused before anything is written."""
    from tests.helpers import draft_args

    out = world.root / "runs" / "new"
    # A shard that says its vocabulary is 512 but holds id 600 (written by another tool, or edited).
    d = crafted_shards(world, "big_ids", lambda m: json_text(dict(m, max_token_id=600)), ids={5: 600})
    line = refused(world.args(out, f"--data.train={d}"), "largest token id is 600", d, out)
    assert str(d) in line and "vocab_size is 512" in line
    # A draft run: its target's vocabulary (512) is the one that counts.
    line = refused(draft_args(world.shards, target_dir, out, f"--data.train={d}"), "largest token id is 600", d, out)
    assert str(d) in line and "vocab_size is 512" in line
    # The data fits its tokenizer, but model.overrides shrinks the model's vocabulary below the tokenizer's.
    small = "{hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=300}"
    line = refused(world.args(out, f"--model.overrides={small}"), "has vocab_size 300, smaller than tokenizer", out)
    assert "(512 tokens)" in line and "model.overrides without vocab_size (the tokenizer's), or vocab_size = 512" in line


def test_a_frozen_kv_run_refuses_a_target_that_is_not_gemma_4(world, refused, target_dir):
    """Gemma 4's assistant reads a Gemma 4 target's stored K/V: another family is refused from its config.json, before
    a weight is read."""
    from tests.helpers import draft_args

    from treadle import compat

    out = world.root / "runs" / "new"
    if not compat.gemma4_kv_sharing():  # transformers < 5.23: the kind itself is refused first
        refused(draft_args(world.shards, target_dir, out, "--draft.kind=frozen_kv"), "needs transformers >= 5.23", out)
        return
    line = refused(draft_args(world.shards, target_dir, out, "--draft.kind=frozen_kv"), "trains Gemma 4's assistant",
                   out)
    assert str(target_dir) in line and "'llama'" in line and "accepted: a text-only Gemma 4" in line


def test_a_misspelt_model_override_is_refused_not_kept(world, refused):
    """A Hugging Face config keeps an unknown keyword as an attribute no model reads: ``hiden_size=64`` built the
    preset's 256-wide model and said nothing. A key close to a field of the config class is refused, naming it."""
    out = world.root / "runs" / "new"
    line = refused(world.args(out, "--model.overrides={hiden_size=64}"), "model.overrides.hiden_size", out)
    assert "did you mean hidden_size?" in line and "LlamaConfig" in line


def test_weights_with_nan_are_refused_at_load_not_read_as_a_diverging_run(world, refused, target_dir):
    """Issue 39: a model.path whose weights hold NaN ran to eval_loss=nan and a NaN guard blaming optim.lr."""
    from tests.test_finite_weights import poison

    bad = world.root / "bad-model"
    shutil.copytree(target_dir, bad)
    name = poison(bad / "model.safetensors", "model.embed_tokens.weight")
    out = world.root / "runs" / "new"
    line = refused(world.args(out, f"--model.path={bad}"), f"model.path {bad / 'model.safetensors'}: tensor {name} "
                   "holds 1 NaN and 1 inf of", bad, out)
    assert "accepted: weights that are all finite" in line


def test_token_ids_beyond_the_vocab_in_foreign_shards_stop_at_the_first_batch(world, refused):
    """Hole 4: shards without max_token_id (another tool's) are checked per micro-batch by the loader.
    Before: depending on the draw the run trained to the end with exit 0 or died inside the embedding."""
    import numpy as np

    def foreign(meta):
        return json_text({k: v for k, v in meta.items() if k != "max_token_id"})

    n = int(np.fromfile(world.shards / "train" / "tokens.bin", dtype=np.uint16).size)
    d = crafted_shards(world, "foreign", foreign, ids={i: 4000 for i in range(0, n, 16)})  # in every window
    out = world.root / "runs" / "new"
    line = refused(world.args(out, f"--data.train={d}"), "holds token id 4000, beyond the model's vocabulary", d)
    assert "source 'train'" in line and str(d) in line and "vocab_size 512" in line


def test_non_utf8_jsonl_row_names_file_and_line(world, refused, monkeypatch):
    """Hole 5: a row with bytes that are not UTF-8 was read with replacement characters, silently."""
    monkeypatch.setenv("TREADLE_CACHE", str(world.root / "cache"))
    data = world.root / "rows.jsonl"
    data.write_bytes(b"".join(b'{"text": "def f%d(x):\\n    return x + %d\\n"}\n' % (i, i) for i in range(40))
                     + b'{"text": "caf\xe9"}\n' + b'{"text": "x = 1"}\n')
    out = world.root / "runs" / "new"
    refused(world.args(out, f"--data.train={data}", f"--data.tokenizer={world.shards / 'tok'}"),
            f"{data}:41: not UTF-8 (byte 0xe9", data, out)


def test_bad_prepare_and_prompt_inputs_name_the_line(world, refused):
    """Hole 5: treadle prepare, spec-eval --prompts and generate --prompts name the line that is not UTF-8."""
    bad = world.root / "in.jsonl"
    bad.write_bytes('{"prompt": "a\u2028b"}\n{"prompt": "ok"}\n'.encode() + b'{"prompt": "\xff"}\n')
    out = world.root / "prepared"
    refused(["prepare", bad, "--out", out, "--tokenizer", world.shards / "tok", "--workers", "1", "--text-field", "prompt"],
            f"{bad}:3: not UTF-8 (byte 0xff at byte 13 of the line)", bad, out)
    refused(["spec-eval", "--target", world.run, "--draft", "prompt-lookup", "--prompts", bad],
            f"{bad}:3: not UTF-8", bad)
    gen = world.root / "gen.jsonl"
    refused(["generate", "--model", world.run, "--prompts", bad, "--out", gen], f"{bad}:3: not UTF-8", bad, gen)


# ---------------------------------------------------------------------------- resume (holes 6, 7, 8)


@pytest.mark.parametrize("state", ["{}", '{"train": {"step": 2}}', '{"train": {"step": "two"}, "meta": {}, "loader": {}, '
                                   '"schedule": {}, "callbacks": {}}'], ids=["empty", "step-only", "step-not-int"])
def test_train_state_without_a_runs_keys_is_one_line(world, refused, tmp_path, state):
    """Valid JSON that is not a run's train state: a KeyError traceback in export and resume before."""
    bad = tmp_path / "step_2"
    shutil.copytree(ckpt(world), bad)
    (bad / "train_state.json").write_text(state)
    refused(["export", bad, tmp_path / "out"], "train_state.json has no", tmp_path / "out", bad)
    refused(world.args(tmp_path / "new", f"--checkpoint.resume={bad}"), "train_state.json has no", tmp_path / "new", bad)


def _other_run(w: World) -> Path:
    """A second finished run beside the good one (a copy: a treadle run with its own checkpoints and metrics)."""
    other = w.root / "runs" / "other"
    shutil.copytree(w.run, other, symlinks=True)
    return other


def test_output_dir_that_is_not_a_treadle_run_is_refused(world, refused):
    """Hole 1 (train.output_dir): a user's directory, a file, a hand-written recipe or an export is never a run dir."""
    recipe = world.root / "recipe"
    recipe.mkdir()
    (recipe / "config.toml").write_text("# my recipe\n[train]\nmax_steps = 2\n")
    refused(world.args(world.user), "holds files that are not a treadle run (notes.jsonl, thesis.txt)")
    refused(world.args(world.thesis), "is a file, not a directory")
    refused(world.args(recipe), "holds files that are not a treadle run (config.toml)", recipe)
    refused(world.args(world.run / "hf"), "holds files that are not a treadle run", world.run / "hf")


def test_output_dir_of_a_user_is_refused_by_the_console_script(world):
    refused_subprocess(world.args(world.user), "not a treadle run", *world.watched)


def test_resume_that_would_overwrite_a_run_is_refused(world, refused):
    """Hole 7: another run's checkpoint into an existing run; this run's older checkpoint while newer ones exist."""
    other = _other_run(world)
    line = refused(world.args(other, f"--checkpoint.resume={ckpt(world, 1)}"), "is another run's checkpoint", other)
    assert str(ckpt(world, 1)) in line and str(other) in line and "a new train.output_dir" in line
    line = refused(world.args(world.run, f"--checkpoint.resume={ckpt(world, 1)}"), "older checkpoint of this run")
    assert "(step_2)" in line and "checkpoint.allow_rollback = true" in line


@pytest.mark.parametrize("flags, expect", [
    (["--optim.lr=1e-2"], "optim.lr 0.005 -> 0.01 changes the learning rate there from"),
    (["--train.max_steps=4"], "train.max_steps 2 -> 4 changes the learning rate there from"),
    (["--schedule.min_lr_ratio=0.5"], "schedule.min_lr_ratio 0.1 -> 0.5"),
    (["--data.phases=[{start_step=1,lr_scale=0.5}]", "--train.max_steps=2"], "data.phases"),
])
def test_resume_that_breaks_the_schedule_is_refused(world, refused, flags, expect):
    """Hole 8: a finished cosine run resumed with another lr or length would jump its lr; the flag is named."""
    line = refused(world.args(world.run, *flags), expect)
    assert "checkpoint.allow_schedule_change = true" in line


def test_resume_messages_name_the_key_and_the_remedy(world, refused):
    """Hole 6b/6c: the override's leaf key and both values; another seq_len or seed names what to do instead."""
    refused(world.args(world.run, "--model.overrides={}"), "model.overrides.hidden_size = 32, this run has unset")
    line = refused(world.args(world.run, "--data.seq_len=16"), "data.seq_len = 32, this run has 16")
    assert "data.seq_len = 32 to continue it" in line and f"--model.path={world.run}" in line
    refused(world.args(world.run, "--train.seed=1"), "train.seed = 0 to continue it")
    refused(world.args(world.run, "--data.val=[]", "--data.val_fraction=0.1"), "data.val_fraction = 0.0 to continue it")


def test_export_messages_name_what_the_user_typed(world, refused):
    """Hole 6a: `treadle export` is not `checkpoint.resume`, and auto/none are not its keywords."""
    out = world.root / "exported"
    for source, expect in [(world.root / "missing", "does not exist"), (world.user, "holds no checkpoint"),
                           (Path("auto"), "does not exist")]:
        line = refused(["export", source, out], f"treadle export SOURCE {str(source)!r} {expect}", out)
        assert "checkpoint.resume" not in line and "auto, none" not in line


# ---------------------------------------------------------------------------- errors that say what to do (issue 13.8)


def test_a_hub_id_or_plain_text_gets_the_command_that_fixes_it(world, refused, monkeypatch):
    """A Hub id: treadle never downloads, fetch it first; .txt in a source: treadle prepare it first."""
    monkeypatch.chdir(world.root)  # where no directory is named gpt2 or Qwen
    new = world.root / "runs" / "new"
    line = refused(world.args(new, "--model.path=gpt2"), "hf download gpt2 --local-dir models/gpt2", new)
    assert 'model.path = "models/gpt2"' in line and "never downloads" in line
    refused(["generate", "--model", "Qwen/Qwen3-0.6B", "--prompts", world.user / "notes.jsonl", "--out",
             world.root / "g.jsonl"], "hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B) and set --model "
            "models/Qwen3-0.6B", world.root / "g.jsonl")
    refused(["spec-eval", "--target", world.run, "--draft", "gpt2"], "--draft models/gpt2")
    refused(world.args(new, "--draft.kind=glide", "--draft.target=org/tiny"), 'draft.target = "models/tiny"', new)
    # A mistyped local path (its folder is here) is not sent to the Hub.
    line = refused(["spec-eval", "--target", "runs/goood", "--draft", "prompt-lookup"], "runs/goood")
    assert "hf download" not in line
    texts = world.root / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("plain text\n")
    for entry, out in ((world.thesis, "shards/thesis"), (texts, "shards/texts"), (world.user / "*.txt", "shards/mine")):
        refused(world.args(new, f"--data.train={entry}"), f"treadle prepare {entry} --out {out}, then use {out}", new, texts)


def test_a_wrong_draft_path_names_what_a_draft_may_be(world, refused, monkeypatch):
    """Issue 26 (2.6): --draft at a path holding nothing was refused with the target's hint (runs/demo/hf)."""
    monkeypatch.chdir(world.root)
    for draft in (world.root / "runs" / "no-such-draft", world.user):
        line = refused(["spec-eval", "--target", world.run, "--draft", draft, "--num-prompts", "1"], f"--draft {draft}")
        for kind in ("prompt-lookup", "a draft run directory", "its draft/", "treadle export",
                     "Hugging Face causal LM"):
            assert kind in line, line
        assert "runs/demo" not in line and "--target" not in line


def test_every_export_flag_has_help(capsys):
    """Issue 26 (2.6): `treadle export --help` showed --dtype with no text."""
    import argparse

    from treadle.cli import build_parser

    commands = next(a for a in build_parser([])._actions if isinstance(a, argparse._SubParsersAction))
    assert all(action.help for action in commands.choices["export"]._actions), "an export flag without help"
    with pytest.raises(SystemExit) as exit:
        main(["export", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {fp32,bf16,fp16} dtype of the floating-point weights written" in text, text


def test_export_to_the_other_kind_is_one_line(world, refused):
    """Issue 13.10: --to defaults to auto; naming the wrong kind says what the checkpoint is."""
    out = world.root / "exported"
    refused(["export", world.run, "--to", "draft", out], "is a model run; accepted: --to hf or --to auto (the default)", out)
