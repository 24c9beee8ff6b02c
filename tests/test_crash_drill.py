"""Crash drill: SIGKILL a training process at random moments, resume, finish; the result must be
the uninterrupted run's, bit for bit, and no kill may leave a corrupt checkpoint.

    TREADLE_DRILL_KILLS=100 pytest tests/test_crash_drill.py   # hundreds: raise the count
    TREADLE_DRILL_SEED=7 ...                                     # other kill moments
"""

import json
import os
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers import args
from tests.preloaded import start_treadle
from treadle.cli import main

DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss", "eval_tokens", "event")


def metric_rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in rows]


def assert_checkpoints_sound(run):
    """Every checkpoint under a final name is complete, and latest points at one."""
    ckpts = run / "checkpoints"
    if not ckpts.is_dir():
        return
    for d in ckpts.iterdir():
        if d.name.startswith("step_"):
            json.loads((d / "train_state.json").read_text())
            assert (d / "state" / ".metadata").is_file(), d
            assert (d / "rng").is_dir() and (d / "config.toml").is_file(), d
    latest = ckpts / "latest"
    if latest.is_symlink():
        assert latest.resolve().is_dir(), "latest is dangling"


def new_lines(path, seen):
    return path.is_file() and len(path.read_text().splitlines()) > seen


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(shards, tmp_path):
    kills = int(os.environ.get("TREADLE_DRILL_KILLS", "3"))
    rng = random.Random(int(os.environ.get("TREADLE_DRILL_SEED", "0")))
    common = ("--train.max_steps=30", "--checkpoint.every=2", "--checkpoint.keep_last=2", "--train.eval_every=5")
    ref = tmp_path / "ref"
    assert main(args(shards, ref, *common)) == 0

    # Each attempt a process of its own (forked from one that has imported treadle: tests/preloaded.py), which
    # SIGKILL ends with no chance to clean up, as it ends `python -m treadle`.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed, rounds = 0, 0
    while killed < kills:  # a round is one run driven to completion through kills; then it is compared
        rounds += 1
        run = tmp_path / f"drill{rounds}"
        metrics = run / "metrics.jsonl"
        while True:
            seen = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            err = tmp_path / f"attempt{rounds}.err"
            proc = start_treadle(args(shards, run, *common), Path.cwd(), env, Path(os.devnull), err)
            if killed < kills:
                # Once this attempt is training (a new metrics line), kill it at a random moment:
                # mid-step, mid-eval, mid-checkpoint or mid-export.
                while proc.exitcode is None and not new_lines(metrics, seen):
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 1.0))
                if proc.exitcode is None:
                    proc.kill()
                    proc.join()
                    killed += 1
                    assert_checkpoints_sound(run)
                    continue
            proc.join(600)
            assert proc.exitcode == 0, err.read_text()
            break
        assert metric_rows(run) == metric_rows(ref), f"round {rounds} diverged"
        # A kill mid-export left its temporary directory (or the old export set aside): the run finishing removed it.
        assert not [p.name for p in run.iterdir() if p.name.startswith((".tmp-hf-", ".old-hf-"))], f"round {rounds}"
        wa, wb = load_file(ref / "hf" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"round {rounds} weights differ"
    print(f"crash drill: {killed} kills over {rounds} rounds, all equal to the uninterrupted run")
