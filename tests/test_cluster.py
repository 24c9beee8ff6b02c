"""docs/cluster.md's recipes, run here as far as this machine can: the Kubeflow manifests' command line started
from the PET_* variables the torch plugin injects (two "pods" on the loopback), and Ray Train's TorchTrainer on 2
CPU workers with one worker killed (when ray is installed). The SLURM recipe runs on a real one-host SLURM in
``make slurm-check`` (scripts/slurm_check.py): it needs root, three daemons and ~5 minutes of one-minute time limits,
so the suite runs it only when asked (TREADLE_SLURM_CHECK=1); it always checks the docs' copy of the script.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.distributed import free_port
from tests.helpers import args, records
from treadle.cli import main

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "cluster.md"
TIMEOUT_S = 240


def fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_the_sbatch_script_in_the_docs_is_the_one_slurm_check_runs():
    script = (REPO / "examples" / "slurm" / "treadle.sbatch").read_text()
    assert script in [block for block in fenced("bash")], "docs/cluster.md's copy of treadle.sbatch differs from it"


@pytest.mark.skipif(os.environ.get("TREADLE_SLURM_CHECK") != "1",
                    reason="the sbatch recipe runs on a real SLURM in `make slurm-check` (root, 3 daemons, ~5 min of "
                           "one-minute time limits); TREADLE_SLURM_CHECK=1 runs it here")
def test_the_sbatch_recipe_on_a_real_one_host_slurm():
    if shutil.which("slurmctld") is None:
        pytest.skip("slurm-wlm is not installed (as root: apt-get install -y slurm-wlm munge)")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "slurm_check.py")], capture_output=True, text=True)
    assert done.returncode == 0 and "slurm-check: passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def _run_pods(argv: list[str], envs: list[dict], cwd: Path) -> list[tuple[int, str]]:
    """Start one process per pod at once (they meet at the rendezvous); SIGKILL every one of them on a timeout."""
    logs = [cwd / f"pod{i}.log" for i in range(len(envs))]
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for env, log in zip(envs, logs)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the launcher and the ranks it started
            p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def test_kubeflow_manifests_start_a_two_node_run_from_the_pet_variables(shards, tmp_path):
    trainjob, pytorchjob = (yaml.safe_load(block) for block in fenced("yaml")[:2])
    assert (trainjob["kind"], pytorchjob["kind"]) == ("TrainJob", "PyTorchJob")
    trainer = trainjob["spec"]["trainer"]
    command = [*trainer["command"], *trainer["args"]]
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the operator injects its variables into the container of this name
        assert [*container["command"], *container["args"]] == command  # one command line for both operators
    # torchrun takes every launch setting from PET_*: a flag in the manifest would override what the plugin set.
    assert command[:4] == ["torchrun", "-m", "treadle", "train"], command

    config = tmp_path / "run.toml"  # the pod's mounted config (the manifest's path, replaced by this file only)
    config.write_text('[train]\nmax_steps = 4\n')
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run",
            *[str(config) if a == "/etc/treadle/run.toml" else a for a in command[1:]],
            *args(shards, out, "--train.grad_accum_steps=1")[1:]]
    port = str(free_port())
    # What the torch plugin sets on pod i of a 2-node TrainJob (PET_MASTER_ADDR: node 0's address).
    envs = [{**os.environ, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node),
             "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "OMP_NUM_THREADS": "1"} for node in (0, 1)]
    (code0, log0), (code1, log1) = _run_pods(argv, envs, tmp_path)
    assert (code0, code1) == (0, 0), log0[-3000:] + log1[-3000:]
    # Rank 0 (it alone prints the run's opening line) lives on node 0: PET_NODE_RANK orders the ranks.
    assert "on 2 ranks" in log0 and "on 2 ranks" not in log1, log0[-2000:]
    assert sorted(records(out)) == [1, 2, 3, 4]
    assert (out / "checkpoints" / "latest").resolve().name == "step_4"



def test_ray_train_restores_after_a_worker_is_killed(shards, tmp_path, monkeypatch):
    """examples/ray_train.py on 2 CPU workers (2 ranks x 2 micro-batches): worker 1 SIGKILLs itself after step 3's
    checkpoint, Ray (FailureConfig) starts the worker group again, and the run resumes at step 3 and ends with the
    losses of one uninterrupted process taking 4 micro-batches a step (the same global batch)."""
    pytest.importorskip("ray.train", reason="ray is not installed (the [ray] extra: pip install -e '.[ray]')")
    run = tmp_path / "ray" / "run" / "treadle"
    argv = [sys.executable, str(REPO / "examples" / "ray_train.py"), "--workers=2", f"--storage={tmp_path / 'ray'}",
            "--name=run", "--max-failures=1", "--drill-kill-step=3",
            *args(shards, run, "--train.max_steps=6", "--checkpoint.export_hf=false")[1:]]
    ((code, log),) = _run_pods(argv, [{**os.environ, "OMP_NUM_THREADS": "1"}], tmp_path)
    assert code == 0, log[-4000:]
    assert "SIGKILL to this rank (a drill)" in log and f"resumed from {run}/checkpoints/step_3 at step 3" in log, log

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    one = tmp_path / "one"
    assert main(args(shards, one, "--train.max_steps=6", "--train.grad_accum_steps=4",
                     "--checkpoint.export_hf=false")) == 0
    for key in ("loss", "grad_norm"):
        got, want = records(run, key), records(one, key)
        assert sorted(got) == sorted(want) == list(range(1, 7))
        assert all(math.isclose(got[s], want[s], rel_tol=1e-5) for s in want), (key, got, want)
