"""Checkpoints on real files with real models: atomic layout, retention, fallback, async, safety, errors.

Every model here is a 2-layer Llama of hidden size 32 (vocab 97) unless a test needs
a write that takes long enough to observe.
"""

import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from tests.distributed import run_distributed

from treadle.checkpoint.compat import check_compatible
from treadle.checkpoint.layout import HOST
from treadle.checkpoint.manager import CheckpointManager
from treadle.checkpoint.safety import read_metadata
from treadle.checkpoint.validate import damage
from treadle.config import Config, ModelConfig, to_toml
from treadle.engine import LocalEngine
from treadle.errors import UserError
from treadle.models.hf import build_model

# torch's DCP warns on every save/load without a process group that it assumes one process. treadle silences it
# around its own calls on the main thread only (distributed.quiet_single_process_dcp: a warnings filter is
# process-wide, so a background writer must not swap it): a single-process async save shows it, as do this
# module's own direct dcp.load calls. It is true and expected here.
SINGLE_PROCESS_DCP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
META = {"vocab_size": 97, "tokenizer_fingerprint": "f00d"}


def engine(seed=0, vocab=97, **overrides):
    """A tiny model and AdamW after one real step, so the optimizer state is not empty."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(overrides=TINY | overrides), vocab_size=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, vocab, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return LocalEngine(model, opt, torch.device("cpu"))


def config_toml(**overrides):
    return to_toml(Config(model=ModelConfig(overrides=TINY | overrides)))


def train_state(step):
    return {"train": {"step": step}, "meta": META, "loader": {"position": step * 8}}


def snapshot(eng):
    """Deep copy of every tensor of model + optimizer, keyed like DCP keys them."""
    out = {}
    for part, sd in (("model", eng.model.state_dict()), ("optim", eng.optimizer.state_dict()["state"])):
        for k, v in sd.items():
            if isinstance(v, dict):
                out |= {f"{part}.{k}.{kk}": vv.clone() for kk, vv in v.items()}
            else:
                out[f"{part}.{k}"] = v.clone()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad[:3]}"


def tmp_entries(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # reaped: no process has this id (until the kernel reuses it, long after this test)


# ---------------------------------------------------------------------------- layout


def test_atomic_layout_latest_resave_and_startup_cleanup(tmp_path):
    root = tmp_path / "checkpoints"
    cm = CheckpointManager(root, keep_last=5)
    eng = engine()
    cm.save(1, eng, train_state(1), config_toml())
    saved = snapshot(eng)
    path = cm.save(2, eng, train_state(2), config_toml())
    assert path == root / "step_2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]
    assert os.readlink(root / "latest") == "step_2"  # relative: the run directory can move
    assert sorted(p.name for p in path.iterdir()) == ["config.toml", "rng", "state", "train_state.json"]
    assert (path / "state" / ".metadata").is_file() and (path / "rng" / "rank_0.json").is_file()
    assert damage(path) is None and cm.find_resume("auto") == path

    fresh = engine(seed=1)
    assert cm.load(path, fresh) == train_state(2)
    assert_same(snapshot(fresh), saved)

    # Saving step 2 again replaces it (the old one is never deleted before the new one is in place).
    with torch.no_grad():
        for p in eng.model.parameters():
            p.mul_(-1)
    cm.save(2, eng, train_state(2) | {"again": True}, config_toml())
    assert tmp_entries(root) == [] and sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]
    fresh = engine(seed=1)
    assert cm.load(path, fresh)["again"] is True
    assert_same(snapshot(fresh), snapshot(eng))

    # Start-up: abandoned work of dead writers goes, a live writer's and the checkpoints stay;
    # a step that a killed replace had moved aside comes back.
    pid, host = dead_pid(), HOST
    (root / f".tmp-step_3.{pid}@{host}.0badc0de" / "state").mkdir(parents=True)
    (root / f".tmp-step_5.{os.getpid()}@{host}.12345678").mkdir()  # ours, live
    (root / ".tmp-hf-0123abcd").mkdir()  # an HF export's, not ours to judge
    os.rename(root / "step_1", root / f".tmp-old-step_1.{pid}@{host}.abcdef01")
    CheckpointManager(root, keep_last=5)
    assert tmp_entries(root) == [".tmp-hf-0123abcd", f".tmp-step_5.{os.getpid()}@{host}.12345678"]
    assert damage(root / "step_1") is None and damage(root / "step_2") is None


# ---------------------------------------------------------------------------- retention and best


def test_retention_keeps_newest_latest_and_best(tmp_path):
    root = tmp_path / "ck"
    eng = engine()
    cm = CheckpointManager(root, keep_last=2, best_metric="eval_loss", best_mode="min")
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5)]:
        cm.save(step, eng, train_state(step), config_toml(), metrics={"eval_loss": loss, "loss": 9.0})
    names = lambda: [p.name for p in cm.complete()]  # noqa: E731
    assert names() == ["step_2", "step_3", "step_4"]  # 2 newest + the best
    assert cm.best().name == "step_2" and cm.latest().name == "step_4"
    assert os.readlink(root / "best") == "step_2"

    # keep_last=1, a restarted manager: best.json survives; a worse metric does not move best,
    # and a re-saved older step is latest, so it is kept although step_4 is newer.
    cm = CheckpointManager(root, keep_last=1, best_metric="eval_loss", best_mode="min")
    cm.save(3, eng, train_state(3), config_toml(), metrics={"eval_loss": 1.5})
    assert names() == ["step_2", "step_3", "step_4"]  # best, latest, newest
    cm.save(5, eng, train_state(5), config_toml(), metrics={"eval_loss": float("nan")})
    assert names() == ["step_2", "step_5"] and cm.best().name == "step_2"
    cm.save(6, eng, train_state(6), config_toml(), metrics={"eval_loss": 0.5})
    assert names() == ["step_6"] and cm.best() == cm.latest() == root / "step_6"
    assert '"value": 0.5' in (root / "best.json").read_text()
    cm.save(7, eng, train_state(7), config_toml())  # no metrics: best unchanged and protected
    assert names() == ["step_6", "step_7"] and tmp_entries(root) == []

    # max mode, on another directory: the highest value is best and is kept beside the newest.
    cm = CheckpointManager(tmp_path / "mx", keep_last=1, best_metric="acc", best_mode="max")
    for step, acc in [(1, 0.2), (2, 0.7), (3, 0.5)]:
        cm.save(step, eng, train_state(step), config_toml(), metrics={"acc": acc})
    assert [p.name for p in cm.complete()] == ["step_2", "step_3"] and cm.best().name == "step_2"
    with pytest.raises(UserError, match="best_mode = 'median' is invalid; accepted: min, max"):
        CheckpointManager(tmp_path / "x", keep_last=1, best_mode="median")


# ---------------------------------------------------------------------------- resume with fallback


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "checkpoints"
    cm = CheckpointManager(root, keep_last=5)
    eng = engine()
    cm.save(1, eng, train_state(1), config_toml())
    cm.save(2, eng, train_state(2), config_toml())
    return root


def _truncate(p):
    f = next((p / "state").glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:1000])


DAMAGE = {
    "no train_state": (lambda p: (p / "train_state.json").unlink(), "train_state.json is missing"),
    "bad json": (lambda p: (p / "train_state.json").write_text('{"train": '), "train_state.json is not valid JSON"),
    "no metadata": (lambda p: (p / "state" / ".metadata").unlink(), "state/.metadata is missing"),
    "garbage metadata": (lambda p: (p / "state" / ".metadata").write_bytes(b"\x80\x04junk"), "state/.metadata is unreadable"),
    "no rng": (lambda p: shutil.rmtree(p / "rng"), "rng/ (the RNG states) is missing"),
    "truncated data": (_truncate, "is truncated"),
    "dangling latest": (lambda p: shutil.rmtree(p), "it points to a missing directory"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_falls_back_from_damaged_latest(two_checkpoints, tmp_path, caplog, kind):
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root, symlinks=True)
    harm, reason = DAMAGE[kind]
    harm(root / "step_2")
    cm = CheckpointManager(root, keep_last=5)
    with caplog.at_level(logging.WARNING, logger="treadle"):
        assert cm.find_resume("auto") == root / "step_1"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "latest -> step_2" in lines[0] and reason in lines[0] and f"resuming from {root / 'step_1'}" in lines[0]
    if kind != "dangling latest":  # an explicit path must be sound
        with pytest.raises(UserError, match=f"is not a usable checkpoint: .*{re.escape(reason)}"):
            cm.find_resume(str(root / "step_2"))


def test_explicit_bad_paths_and_all_damaged(two_checkpoints, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(two_checkpoints, root, symlinks=True)
    cm = CheckpointManager(root, keep_last=5)
    assert cm.find_resume(str(tmp_path / "run")) == root / "step_2"  # a run directory
    assert cm.find_resume("none") is None
    with pytest.raises(UserError, match="does not exist; accepted: auto, none"):
        cm.find_resume(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="holds no checkpoint"):
        cm.find_resume(str(tmp_path / "run" / "checkpoints" / "step_1" / "rng"))
    for step in (1, 2):
        (root / f"step_{step}" / "train_state.json").unlink()
    with pytest.raises(UserError, match=r"no usable checkpoint in .*step_1 \(train_state.json is missing\)"):
        cm.find_resume("auto")  # never silently start afresh over damaged checkpoints
    assert CheckpointManager(tmp_path / "empty", keep_last=1).find_resume("auto") is None


# ---------------------------------------------------------------------------- async


@SINGLE_PROCESS_DCP
def test_async_save_snapshots_the_moment_of_save(tmp_path):
    root = tmp_path / "ck"
    cm = CheckpointManager(root, keep_last=5, async_save=True)
    eng = engine()
    state = train_state(1)
    before = snapshot(eng)
    cm.save(1, eng, state, config_toml())
    expected_rand = torch.rand(4)  # what the RNG gives right after the save: a restored RNG must give it again
    # Training goes on at once: parameters, optimizer moments and the caller's dict all change.
    with torch.no_grad():
        for p in eng.model.parameters():
            p.add_(1.0)
    ids = torch.randint(0, 97, (2, 8))
    eng.model(input_ids=ids, labels=ids).loss.backward()
    eng.optimizer.step()
    state["train"]["step"] = 999
    cm.wait()
    assert cm.pending is None and cm.latest() == root / "step_1"
    fresh = engine(seed=1)
    assert cm.load(root / "step_1", fresh) == train_state(1)
    assert_same(snapshot(fresh), before)
    assert torch.equal(torch.rand(4), expected_rand)

    # Back-to-back saves: the second waits for the first; both land, newest is latest.
    cm.save(2, eng, train_state(2), config_toml())
    cm.save(3, eng, train_state(3), config_toml())
    cm.wait()
    assert [p.name for p in cm.complete()] == ["step_1", "step_2", "step_3"] and cm.latest().name == "step_3"
    fresh = engine(seed=1)
    cm.load(root / "step_3", fresh)
    assert_same(snapshot(fresh), snapshot(eng))


@SINGLE_PROCESS_DCP
def test_async_latest_moves_only_when_durable(tmp_path):
    root = tmp_path / "ck"
    # Big enough (2.4M parameters, ~30 MB with AdamW) that the write is in flight for a while.
    eng = engine(vocab=8192, hidden_size=128, intermediate_size=256)
    cm = CheckpointManager(root, keep_last=5, async_save=True)
    cm.save(1, eng, train_state(1), config_toml(hidden_size=128, intermediate_size=256))
    cm.wait()
    t0 = time.perf_counter()
    cm.save(2, eng, train_state(2), config_toml(hidden_size=128, intermediate_size=256))
    returned = time.perf_counter() - t0
    in_flight, deadline = [], time.monotonic() + 60
    while cm.pending is not None:
        assert time.monotonic() < deadline, "async save never finished"
        latest = os.readlink(root / "latest")
        exists = (root / "step_2").exists()
        in_flight.append((latest, exists))
        assert damage(root / latest) is None  # latest never points at anything incomplete
        if exists:  # visible under its final name only once complete
            assert damage(root / "step_2") is None
        time.sleep(0.01)  # poll gently: a tight loop holding the GIL starves the writer thread
    cm.wait()
    assert in_flight and in_flight[0] == ("step_1", False), in_flight[:3]
    assert cm.latest().name == "step_2" and tmp_entries(root) == []
    assert returned < 1.0


# ---------------------------------------------------------------------------- no code execution on load


class RunsCode:
    """Unpickling this runs a shell command (what an attacker would put in a checkpoint)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@SINGLE_PROCESS_DCP
def test_malicious_pickles_are_refused(tmp_path):
    root = tmp_path / "ck"
    cm = CheckpointManager(root, keep_last=5)
    eng = engine()
    good = cm.save(1, eng, train_state(1), config_toml())
    cm.load(good, engine(seed=1))  # our own checkpoints load (their param_groups are pickled "bytes" entries)

    # 1. A .metadata whose unpickling runs code.
    evil_md = root / "evil_md"
    shutil.copytree(good, evil_md)
    marker = tmp_path / "pwned_md"
    (evil_md / "state" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UserError, match=r"state/\.metadata contains a pickled object of type posix\.system, refused"):
        cm.load(evil_md, engine(seed=1))
    with pytest.raises(UserError, match="posix.system, refused"):
        cm.find_resume(str(evil_md))
    assert not marker.exists()

    # 2. A non-tensor entry of the .distcp data whose unpickling runs code (plain DCP uses weights_only=False).
    evil_bytes = root / "evil_bytes"
    shutil.copytree(good, evil_bytes)
    marker = tmp_path / "pwned_bytes"
    with open(evil_bytes / "state" / ".metadata", "rb") as f:
        md = pickle.load(f)
    payload = tmp_path / "payload.pt"
    torch.save(RunsCode(marker), payload)
    (evil_bytes / "state" / "evil.distcp").write_bytes(payload.read_bytes())
    md.storage_data[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("evil.distcp", 0, payload.stat().st_size)
    with open(evil_bytes / "state" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert damage(evil_bytes) is None  # structurally fine: only loading it would run the payload
    with pytest.raises(UserError, match=r"optim\.param_groups\.0\.lr contains a pickled object of type posix\.system, refused"):
        cm.load(evil_bytes, engine(seed=1))
    assert not marker.exists()

    # The payloads are real: plain DCP runs both of them.
    dcp.load(engine(seed=1).state_dict(), checkpoint_id=evil_bytes / "state")
    assert marker.exists()
    with pytest.raises(BaseException):
        dcp.load(engine(seed=1).state_dict(), checkpoint_id=evil_md / "state")
    assert (tmp_path / "pwned_md").exists()


# ---------------------------------------------------------------------------- incompatible resume


def test_incompatible_resume_is_one_line_user_error(tmp_path):
    cm = CheckpointManager(tmp_path / "ck", keep_last=5)
    path = cm.save(6, engine(), train_state(6), config_toml())
    # Harmless changes pass: steps, lr, eval, logging, autocast dtype, compile, activation checkpointing, loss chunks, router coefficients.
    cfg = Config(model=ModelConfig(overrides=TINY, dtype="bf16", compile=True, activation_checkpointing="selective",
                                   activation_checkpointing_every=2, activation_checkpointing_save_ops=["mm"],
                                   loss_chunk_tokens=64, router_z_loss_coef=0.001))
    cfg.train.max_steps, cfg.optim.lr, cfg.train.eval_every, cfg.train.log_every = 999, 0.1, 7, 3
    check_compatible(path, to_toml(cfg), dict(META, eos_id=5))

    def fails(match, toml=None, meta=None):
        with pytest.raises(UserError, match=match) as err:
            check_compatible(path, toml, meta)
        assert "\n" not in str(err.value)

    fails(rf"checkpoint {path} was trained with model.overrides.hidden_size = 32, this run has 64; "
          "resume with the same model or start a new output_dir", config_toml(hidden_size=64))
    fails("model.overrides.rope_theta = unset, this run has 500.0", config_toml(rope_theta=500.0))
    fails("model.preset = 'tiny', this run has 'small'", to_toml(Config(model=ModelConfig(preset="small", overrides=TINY))))
    # An override added to a run trained without any names its leaf key and both values (not "overrides = {}").
    bare = cm.save(7, engine(), train_state(7), to_toml(Config()))
    with pytest.raises(UserError, match=r"model\.overrides\.num_hidden_layers = unset, this run has 2;"):
        check_compatible(bare, to_toml(Config(model=ModelConfig(overrides={"num_hidden_layers": 2}))), None)
    fails("vocab_size = 97, this run has 8192", meta=dict(META, vocab_size=8192))
    fails("tokenizer_fingerprint = 'f00d', this run has 'beef'", meta=dict(META, tokenizer_fingerprint="beef"))
    with pytest.raises(UserError, match="hidden_size = 32, this run has 64"):  # load checks when told the run
        cm.load(path, engine(), config_toml=config_toml(hidden_size=64), meta=META)

    # Without the config, a different shape or depth is still one line, not DCP's traceback.
    shape_change = r"does not fit this model: model\.model\.embed_tokens\.weight is \[97, 32\] there, \[97, 64\] here"
    with pytest.raises(UserError, match=shape_change) as err:
        cm.load(path, engine(hidden_size=64, intermediate_size=128))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"does not fit this model: it has no model\.model\.layers\.2\."):
        cm.load(path, engine(num_hidden_layers=3))
    with pytest.raises(UserError, match=r"holds model\.model\.layers\.1\..*which this model lacks"):
        cm.load(path, engine(num_hidden_layers=1))


def test_roll_back_to_moves_latest_and_best_then_retires_newer(tmp_path):
    cm = CheckpointManager(tmp_path / "ck", keep_last=5, best_metric="eval_loss")
    eng = engine()
    first = cm.save(1, eng, train_state(1), config_toml(), metrics={"eval_loss": 3.0})
    newer = [cm.save(s, eng, train_state(s), config_toml(), metrics={"eval_loss": 3.0 - s}) for s in (2, 3)]
    assert cm.best().name == "step_3"
    cm.roll_back_to(first, newer)
    assert [p.name for p in cm.complete()] == ["step_1"] and cm.latest() == first
    assert not (cm.root / "best").is_symlink() and not (cm.root / "best.json").exists()
    assert tmp_entries(cm.root) == [] and cm.find_resume("auto") == first


# ---------------------------------------------------------------------------- disk full


DISK_FULL = """
import os, resource, signal, sys
from pathlib import Path
import torch
from treadle.checkpoint.manager import CheckpointManager, CheckpointWriteError
from treadle.config import ModelConfig
from treadle.engine import LocalEngine
from treadle.models.hf import build_model

root = Path(sys.argv[1])
torch.manual_seed(0)
model = build_model(ModelConfig(overrides={tiny!r}), vocab_size=97)
eng = LocalEngine(model, torch.optim.AdamW(model.parameters()), torch.device("cpu"))
first = {{k: v.clone() for k, v in model.state_dict().items()}}
cm = CheckpointManager(root, keep_last=1)
cm.save(1, eng, {{"step": 1}}, "[model]\\n")
size = sum(f.stat().st_size for f in (root / "step_1").rglob("*") if f.is_file())

# From here on no file may grow past 64 KiB: the DCP data file (~{{size}} bytes) fails with EFBIG.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)

def check(err):
    msg = str(err)
    assert "\\n" not in msg and "checkpoint step_" in msg and "File too large (EFBIG)" in msg, msg
    assert f"the previous checkpoint {{root / 'step_1'}} is intact and resumable" in msg, msg
    assert err.os_error.errno == 27 and err.path.is_relative_to(root), (err.path, err.os_error)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")], list(root.iterdir())
    assert os.readlink(root / "latest") == "step_1" and [p.name for p in cm.complete()] == ["step_1"]
    return msg

try:
    cm.save(2, eng, {{"step": 2}}, "[model]\\n")
    raise SystemExit("sync save did not fail")
except CheckpointWriteError as err:
    print(check(err))

cm = CheckpointManager(root, keep_last=1, async_save=True)
cm.save(3, eng, {{"step": 3}}, "[model]\\n")  # returns; the write fails in the background
try:
    cm.save(4, eng, {{"step": 4}}, "[model]\\n")  # ... and the failure surfaces here
    raise SystemExit("async failure was swallowed")
except CheckpointWriteError as err:
    assert "step_3" in str(err)
    check(err)
cm.wait()  # raised once, not again
assert not (root / "step_4").exists()

fresh = build_model(ModelConfig(overrides={tiny!r}), vocab_size=97)
eng2 = LocalEngine(fresh, torch.optim.AdamW(fresh.parameters()), torch.device("cpu"))
assert cm.find_resume("auto") == root / "step_1"
assert cm.load(root / "step_1", eng2) == {{"step": 1}}
assert all(torch.equal(first[k], v) for k, v in fresh.state_dict().items())
print("OK")
"""


def test_disk_full_keeps_previous_checkpoint_resumable(tmp_path):
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL.format(tiny=TINY))
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
    first_line = run.stdout.splitlines()[0]
    assert first_line.startswith("checkpoint step_2 could not be written to "), first_line


def test_a_deepspeed_checkpoint_is_refused_by_a_dcp_engine_in_one_line(tmp_path):
    root = tmp_path / "checkpoints"
    cm = CheckpointManager(root, keep_last=5)
    path = cm.save(1, engine(), train_state(1), config_toml())
    # What the DeepSpeed engine writes instead of state/ (its own files under deepspeed/).
    shutil.rmtree(path / "state")
    (path / "deepspeed" / "state").mkdir(parents=True)
    (path / "deepspeed" / "latest").write_text("state")
    (path / "deepspeed" / "treadle_deepspeed.json").write_text(
        '{"world_size": 1, "zero_stage": 0, "bf16": false, "partitioned": false}')
    torch.save({"module": engine().model.state_dict()}, path / "deepspeed" / "state" / "mp_rank_00_model_states.pt")
    assert damage(path) is None
    with pytest.raises(UserError) as err:
        cm.load(path, engine())
    assert "DeepSpeed checkpoint" in str(err.value) and "distributed.engine = deepspeed" in str(err.value)
    (path / "deepspeed" / "state" / "mp_rank_00_model_states.pt").unlink()
    assert damage(path) == "deepspeed/state/ holds no model_states.pt"
    (path / "deepspeed" / "treadle_deepspeed.json").write_text("[]")
    assert damage(path).startswith("deepspeed/treadle_deepspeed.json is not what treadle writes")


# ---------------------------------------------------------------------------- async at several ranks


def _gathered(obj):
    """A deep copy of a state dict with every DTensor gathered whole (a collective: every rank calls it)."""
    if isinstance(obj, torch.distributed.tensor.DTensor):
        return obj.full_tensor().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _gathered(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_gathered(v) for v in obj]
    return obj


def _async_and_sync_saves_at_two_ranks(rank, world_size, tmp):
    from pathlib import Path

    from tests.test_engines_dist import CPU, GRAD_CLIP, make_optimizer, rank_micro_batches, tiny_llama
    from treadle.engine.fsdp2 import FSDP2Engine
    from treadle.train.step import optimizer_step

    root = Path(tmp)
    eng = FSDP2Engine(tiny_llama(0), make_optimizer, CPU)  # sharded: each rank holds and writes half
    optimizer_step(eng, rank_micro_batches(0, rank, world_size), grad_clip=GRAD_CLIP)
    saved = _gathered(eng.state_dict())
    CheckpointManager(root / "sync", keep_last=5, rank=rank, world_size=world_size).save(
        1, eng, train_state(1), config_toml())
    cm = CheckpointManager(root / "async", keep_last=5, rank=rank, world_size=world_size, async_save=True)
    cm.save(1, eng, train_state(1), config_toml())
    in_flight = cm.pending is not None
    # Training goes on at once: a step (collectives on the training group while the writer runs on its own)
    # and a change of every weight must not reach the checkpoint.
    optimizer_step(eng, rank_micro_batches(1, rank, world_size), grad_clip=GRAD_CLIP)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.add_(1.0)
    cm.wait()
    trained = _gathered(eng.state_dict())
    fresh = FSDP2Engine(tiny_llama(7), make_optimizer, CPU)
    state = cm.load(root / "async" / "step_1", fresh)
    return {"in_flight": in_flight, "saved": saved, "trained": trained, "resumed": _gathered(fresh.state_dict()),
            "train_state": state, "latest": cm.latest().name}


def _flat_tensors(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= _flat_tensors(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def test_async_save_at_two_ranks_equals_a_sync_save_and_resumes(tmp_path):
    """Two ranks (FSDP2, gloo): the async save is in flight when save() returns, writes the same files as a sync save
    of the same moment, training on at once leaks nothing into it, and a fresh engine resumes from it exactly."""
    results = run_distributed(_async_and_sync_saves_at_two_ranks, world_size=2, timeout=180, tmp=str(tmp_path))
    for r in results:
        assert r["in_flight"] and r["latest"] == "step_1" and r["train_state"] == train_state(1)
        saved, trained, resumed = (_flat_tensors(r[k]) for k in ("saved", "trained", "resumed"))
        assert_same(resumed, saved)
        assert any(not torch.equal(trained[k], saved[k]) for k in saved)  # the mutation happened, after the snapshot
    sync, async_ = tmp_path / "sync" / "step_1", tmp_path / "async" / "step_1"
    files = sorted(str(p.relative_to(sync)) for p in sync.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(async_)) for p in async_.rglob("*") if p.is_file())
    assert {"rng/rank_0.json", "rng/rank_1.json", "state/__0_0.distcp", "state/__1_0.distcp"} <= set(files)
    differ = [f for f in files if (sync / f).read_bytes() != (async_ / f).read_bytes()]
    assert differ == ["state/.metadata"], differ  # it records where and when it was written; the rest is equal:
    a, b = read_metadata(sync / "state"), read_metadata(async_ / "state")
    assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data
