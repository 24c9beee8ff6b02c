"""Guards: NaN skip / rollback / abort, SIGTERM and time limit stop resumably."""

import json
import os
import signal
import threading

import torch
from safetensors.torch import load_file

from tests.helpers import args, records
from treadle.cli import main


def train_state(run, step):
    return json.loads((run / "checkpoints" / f"step_{step}" / "train_state.json").read_text())


def events(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" in r]


def test_nan_skip_counts_and_logs_and_the_run_completes(shards, tmp_path):
    run = tmp_path / "run"
    assert main(args(shards, run, "--train.max_steps=6", "--resilience.inject_nan_steps=[3]")) == 0
    ev = events(run)
    assert [(e["step"], e["event"]) for e in ev] == [(3, "nonfinite_step_skipped")]
    assert ev[0]["loss"] is None  # NaN is written as null: metrics.jsonl stays strict JSON
    st = train_state(run, 6)
    assert st["train"]["skipped_steps"] == 1 and st["train"]["step"] == 6
    assert st["schedule"]["last_epoch"] == 5  # the skipped step did not advance the schedule
    assert all(v == v for s, v in records(run).items() if s != 3)  # every other step finite


def test_nan_rollback_restores_the_checkpoint_lowers_lr_and_skips_the_bad_data(shards, tmp_path):
    run = tmp_path / "run"
    argv = args(shards, run, "--train.max_steps=8", "--checkpoint.every=2", "--checkpoint.keep_last=10",
                "--resilience.nan_policy=rollback", "--resilience.max_consecutive_bad=2",
                "--resilience.inject_nan_steps=[5,6]", "--schedule.decay=constant", "--train.eval_every=0")
    assert main(argv) == 0
    ev = events(run)
    assert [(e["step"], e["event"]) for e in ev] == [(5, "nonfinite_step_skipped"), (6, "nonfinite_step_skipped"), (4, "rollback")]
    assert ev[-1]["checkpoint"].endswith("step_4") and ev[-1]["lr_scale"] == 0.5
    global_batch = 8
    assert ev[-1]["data_position"] == 6 * global_batch  # resumes after the bad stretch, not at step 4's data
    st = train_state(run, 8)
    # 4 steps before the bad stretch, 2 bad ones skipped over, 4 more after the rollback.
    assert st["loader"]["position"] == (4 + 2 + 4) * global_batch
    assert st["train"]["lr_scale"] == 0.5
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert lrs[4] == 5e-3 and lrs[8] == 2.5e-3  # constant schedule, halved after the rollback


def test_nan_abort_and_exhausted_rollbacks_exit_3(shards, tmp_path, capsys):
    assert main(args(shards, tmp_path / "a", "--train.max_steps=4", "--resilience.nan_policy=abort",
                     "--resilience.inject_nan_steps=[2]")) == 3
    assert "step 2: non-finite loss or gradient norm and resilience.nan_policy = 'abort'" in capsys.readouterr().err
    assert main(args(shards, tmp_path / "b", "--train.max_steps=6", "--checkpoint.every=1", "--resilience.nan_policy=rollback",
                     "--resilience.max_consecutive_bad=1", "--resilience.max_rollbacks=0",
                     "--resilience.inject_nan_steps=[3]")) == 3
    assert "after 0 rollbacks (resilience.max_rollbacks)" in capsys.readouterr().err


def _kill_self_after_step(run, step, sig):
    """Deliver ``sig`` to this process once metrics.jsonl shows ``step`` (the loop is then mid-run)."""
    def watch():
        path = run / "metrics.jsonl"
        while True:
            if path.is_file() and any(json.loads(l).get("step", 0) >= step for l in path.read_text().splitlines() if l):
                os.kill(os.getpid(), sig)
                return
            threading.Event().wait(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_sigterm_and_time_limit_stop_with_checkpoint_and_resume_exactly(shards, tmp_path, capsys):
    ref = tmp_path / "ref"
    common = ("--train.max_steps=10", "--train.eval_every=0")
    assert main(args(shards, ref, *common)) == 0

    run = tmp_path / "sig"
    _kill_self_after_step(run, 3, signal.SIGTERM)
    assert main(args(shards, run, *common)) == 75
    assert "SIGTERM" in capsys.readouterr().err
    stopped = (run / "checkpoints" / "latest").resolve().name
    assert stopped != "step_10" and not (run / "hf").exists()  # stopped early, no final export
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert main(args(shards, run, *common)) == 0  # the same command resumes
    assert records(run) == records(ref)  # every step's loss, bit for bit, one record per step
    wa, wb = load_file(ref / "hf" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    limited = tmp_path / "limit"
    assert main(args(shards, limited, *common, "--train.time_limit=0s")) == 75
    assert "time_limit" in capsys.readouterr().err
    assert (limited / "checkpoints" / "latest").resolve().name == "step_1"
