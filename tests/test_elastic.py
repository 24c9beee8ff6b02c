"""A job that loses a rank under ``torchrun --max-restarts`` restarts, resumes and ends where an uninterrupted job
ends; two torchrun launchers on this machine train as two nodes (c10d rendezvous on 127.0.0.1), as under SLURM.

Three real torchrun jobs of 2 gloo ranks on FSDP2, the same tiny run each (8 steps, a checkpoint every 3):

- ``standalone``: ``--standalone --nproc_per_node=2 --max-restarts=1``; rank 1 is SIGKILLed after step 6's
  checkpoint (``resilience.inject_kill_step``). The second attempt must start and auto-resume from step_6 (before
  the fix in ``distributed._attempt_store`` it read the first attempt's stale store entries: gloo's connectFullMesh
  was refused or the attempt hung, and the job timed out here).
- ``two_nodes``: two launchers ``--nnodes=2 --nproc_per_node=1``, uninterrupted: the reference.
- ``two_nodes_killed``: the same with ``--max-restarts=1`` and rank 0 (the metrics writer) killed after step 3,
  with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as docs/multinode.md says (each node counts its restarts: with the
  agent's shared store the nodes' attempts can disagree and the restart hangs).

All three run the same computation on the same machine, so their losses, grad norms, eval losses and final weights
must be equal; the comparison allows the fp32 rounding of 1e-6 relative.
"""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import free_port
from tests.helpers import args, records
from treadle.cli import main

RUN = ("--distributed.engine=fsdp2", "--train.max_steps=8", "--checkpoint.every=3", "--checkpoint.keep_last=5",
       "--model.compile=false", "--train.threads=1", "--distributed.timeout_s=60")
TIMEOUT_S = 150  # per job (each takes ~20 s); a hang (the bug this guards against) fails the test, not the suite
RTOL = 1e-6


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return {**env, **extra}


def _processes_with(token: str) -> list[int]:
    """The pids whose environment holds ``TREADLE_TEST_JOB=token``: a launcher's ranks (torchrun starts each in a
    session of its own, so ending the launcher's process group misses them)."""
    found, needle = [], f"TREADLE_TEST_JOB={token}".encode()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):
                found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _launch(launchers: list[list[str]], env: dict, log) -> list[int]:
    """Start every launcher at once (two nodes must meet at the rendezvous) and wait for all. On a timeout every
    process of the job is SIGKILLed, launchers and ranks: a hang fails the test and leaves nothing running."""
    token = uuid.uuid4().hex
    env = {**env, "TREADLE_TEST_JOB": token}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], env=env, stdout=log,
                              stderr=subprocess.STDOUT) for argv in launchers]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for pid in _processes_with(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    return [p.returncode for p in procs]


def _torchrun(shards, out, *, nodes: int, log, env: dict | None = None, extra=()) -> list[int]:
    train = ["-m", "treadle", *args(shards, out, *RUN, *extra)]
    if nodes == 1:
        return _launch([["--standalone", "--nproc_per_node=2", "--max-restarts=1", *train]], env or _env(), log)
    rdzv = [f"--nnodes={nodes}", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=treadle-test-{uuid.uuid4().hex[:8]}"]
    return _launch([[*rdzv, *train]] * nodes, env or _env(), log)


@pytest.fixture(scope="module")
def jobs(shards, tmp_path_factory):
    """{name: (run directory, exit codes of the launchers, their output)}"""
    root = tmp_path_factory.mktemp("elastic")
    specs = {
        "standalone": dict(nodes=1, extra=("--resilience.inject_kill_step=6", "--resilience.inject_kill_rank=1")),
        "two_nodes": dict(nodes=2),
        "two_nodes_killed": dict(nodes=2, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                 extra=("--resilience.inject_kill_step=3", "--resilience.inject_kill_rank=0")),
    }
    done, timings = {}, []
    for name, spec in specs.items():
        t0 = time.perf_counter()
        with open(root / f"{name}.log", "w") as log:
            codes = _torchrun(shards, root / name, log=log, **spec)
        timings.append(f"{time.perf_counter() - t0:5.1f} s  {name}")
        done[name] = (root / name, codes, (root / f"{name}.log").read_text())
    print("\n" + "\n".join(timings))  # pytest -s shows where the time goes
    return done


def _assert_same(ref, run, key):
    a, b = records(ref, key), records(run, key)
    assert a.keys() == b.keys() and a, (key, a, b)
    assert all(math.isclose(a[s], b[s], rel_tol=RTOL, abs_tol=0) for s in a), (key, a, b)


def _assert_same_run(ref, run):
    for key in ("loss", "grad_norm", "lr", "tokens", "eval_loss"):
        _assert_same(ref, run, key)
    wa, wb = load_file(ref / "hf" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=RTOL, atol=RTOL * wa[k].abs().max().item()), k
    assert (run / "checkpoints" / "latest").resolve().name == "step_8"


def _restarts(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("event") == "elastic_restart"]


def test_a_rank_killed_under_torchrun_restarts_and_resumes_to_the_uninterrupted_result(jobs):
    run, codes, log = jobs["standalone"]
    assert codes == [0], log[-6000:]
    assert "resilience.inject_kill_step = 6: SIGKILL to this rank" in log
    # The second attempt ran: it said so once, at the step it resumed from, from the newest complete checkpoint.
    assert _restarts(run) == [{"step": 6, "event": "elastic_restart", "attempt": 1,
                               "resumed_from": str(run / "checkpoints" / "step_6")}]
    assert sorted(records(run)) == list(range(1, 9))  # every step logged once: none lost, none twice
    ref, codes, log = jobs["two_nodes"]
    assert codes == [0, 0], log[-6000:]
    _assert_same_run(ref, run)


def test_two_launchers_as_two_nodes_train_one_job_and_survive_a_lost_rank(jobs):
    """The uninterrupted two-node job equals the standalone one (above); here a two-node job loses its rank 0."""
    ref, codes, log = jobs["two_nodes"]
    assert codes == [0, 0], log[-6000:]
    assert not _restarts(ref)
    # Restarts allowed on two nodes sharing the agent's store: the launch is warned that a restart can hang.
    assert "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node" in log
    run, codes, log = jobs["two_nodes_killed"]
    assert codes == [0, 0], log[-6000:]
    assert "resilience.inject_kill_step = 3: SIGKILL to this rank" in log and "can hang at its start" not in log
    assert [(r["step"], r["attempt"], r["resumed_from"]) for r in _restarts(run)] == \
        [(3, 1, str(run / "checkpoints" / "step_3"))]
    assert sorted(records(run)) == list(range(1, 9))
    _assert_same_run(ref, run)


def test_drill_keys_that_cannot_fire_are_refused_before_anything_is_written(shards, tmp_path, capsys):
    out = tmp_path / "run"
    for extra, needle in [(("--resilience.inject_kill_rank=1",), "inject_kill_rank = 1 is not a rank of this launch"),
                          (("--resilience.inject_kill_step=9",), "inject_kill_step = 9 is after train.max_steps = 8"),
                          (("--resilience.inject_kill_step=4",), "inject_kill_step = 4 is not a checkpoint step")]:
        argv = args(shards, out, *[a for a in RUN if "engine" not in a], "--resilience.inject_kill_step=3", *extra)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
