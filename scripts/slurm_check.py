"""`make slurm-check`: docs/cluster.md's sbatch recipe (examples/slurm/treadle.sbatch) on a real one-host SLURM.

Starts the cluster with scripts/slurm_local.sh (unless one is already up: then it is left running), runs one job of
2 tasks (2 gloo ranks on the CPU) through its life, and stops the daemons it started:

1. the time limit: ``--time=3 --signal=B:USR1@60`` (SLURM's own timer sends the signal): the ranks checkpoint,
   exit 75, and the script requeues the job; the log holds treadle's stop line and no traceback;
2. the requeued job resumes from that checkpoint; ``scancel`` then stops it: a checkpoint, and the job's record
   (``scontrol show job``) reads JobState=CANCELLED ExitCode=75:0;
3. the same command, submitted again (to a near ``train.max_steps``), resumes and completes (ExitCode=0:0);
4. an uninterrupted job of the same config to the same step: every step's loss and grad norm of the stopped,
   requeued, cancelled and resubmitted run equals it (to fp32 rounding; on one machine they are bit-equal).

SLURM waits 2 minutes before it starts a requeued job; the check starts it at once (``scontrol update
StartTime=now``). SLURM's timer looks every 30 s and may send the signal up to a minute early: here 60 to 120 s
into the job, well after treadle is listening (a rank starts in ~10-25 s on 2 busy cores). It takes ~5 minutes (a
time limit has a granularity of one minute). Needs root, slurm-wlm and munge.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "slurm" / "treadle.sbatch"
CLUSTER = REPO / "scripts" / "slurm_local.sh"
# A tiny Llama on the built-in corpus, a constant schedule (so that the resubmission may name another
# train.max_steps without changing any step's learning rate), no periodic checkpoint: every checkpoint is a stop's.
CONFIG = """\
[train]
max_steps = 1000000
micro_batch_size = 2
log_every = 1
eval_every = 0
threads = 1
[model]
dtype = "fp32"
compile = false
overrides = {hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2}
[data]
seq_len = 64
[schedule]
decay = "constant"
warmup_steps = 0
[checkpoint]
every = 1000000
every_minutes = 0
export_hf = false
"""


def sh(*args: str, check: bool = True) -> str:
    out = subprocess.run(args, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"slurm-check: {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def job_field(job: str, name: str) -> str:
    m = re.search(rf"\b{name}=(\S+)", sh("scontrol", "show", "job", job))
    return m.group(1) if m else ""


def wait_for(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"slurm-check: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)


def log_has(log: Path, pattern: str) -> bool:
    return log.exists() and re.search(pattern, log.read_text(), re.M) is not None


def ended(job: str) -> bool:
    return job_field(job, "JobState") in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL")


SUBMITTED: list[str] = []


def submit(work: Path, name: str, *args: str, sbatch: tuple[str, ...] = ()) -> tuple[str, Path]:
    log = work / f"{name}.out"
    job = sh("sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", f"--output={log}", *sbatch,
             str(RECIPE), str(work / "tiny.toml"), *args).strip()
    SUBMITTED.append(job)
    print(f"slurm-check: job {job} ({name}) submitted", flush=True)
    return job, log


def stop_step(log: Path, signal: str) -> int:
    found = re.findall(rf"^treadle: stopped at step (\d+) \({signal}\)", log.read_text(), re.M)
    if not found:
        raise SystemExit(f"slurm-check: {log} has no 'stopped at step N ({signal})' line:\n{log.read_text()[-3000:]}")
    return int(found[-1])


def step_records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise SystemExit(f"slurm-check: FAILED: {message}")
    print(f"slurm-check: ok: {message}", flush=True)


def check(work: Path) -> None:
    (work / "tiny.toml").write_text(CONFIG)
    run, ref = work / "run", work / "reference"

    # 1. SLURM's timer: USR1 to the batch script 60 s before the 2-minute limit.
    job, log = submit(work, "job", f"--train.output_dir={run}", sbatch=("--time=3", "--signal=B:USR1@60"))
    wait_for("the time-limit signal, a checkpoint and the requeue",
             lambda: int(job_field(job, "Restarts") or 0) >= 1 or ended(job), 240)
    first = stop_step(log, "SIGUSR1")
    expect(job_field(job, "Restarts") == "1" and log_has(log, r"requeueing job"),
           f"the time-limit signal stopped the run at step {first} with a checkpoint and the job was requeued")
    expect((run / "checkpoints" / f"step_{first}").is_dir(), f"checkpoint step_{first} is on disk")

    # 2. The requeued job resumes; scancel stops it.
    # Skip SLURM's 2-minute requeue delay, but not all of it: a start within the second of the requeue is refused
    # ("Job credential revoked": the requeue revoked the job's credentials up to that time).
    time.sleep(5)
    sh("scontrol", "update", f"JobId={job}", "StartTime=now")
    wait_for("the requeued job to resume and train 5 steps",
             lambda: log_has(log, rf"^step {first + 5}:") or ended(job), 120)
    expect(log_has(log, rf"resumed from \S*step_{first} at step {first}"), f"the requeued job resumed at step {first}")
    sh("scancel", job)
    wait_for("the cancelled job to end", lambda: ended(job), 120)
    second = stop_step(log, "SIGTERM")
    state, code = job_field(job, "JobState"), job_field(job, "ExitCode")
    expect(state == "CANCELLED" and code == "75:0",
           f"scancel stopped the run at step {second} with a checkpoint; the job's record: JobState={state} "
           f"ExitCode={code} (75: stopped, resumable)")
    expect("Traceback" not in log.read_text(), "the job log holds no traceback")

    # 3. The same command again, to a near end.
    last = second + 10
    job2, log2 = submit(work, "resubmitted", f"--train.output_dir={run}", f"--train.max_steps={last}",
                        sbatch=("--time=10",))
    wait_for("the resubmitted job to end", lambda: ended(job2), 300)
    expect(job_field(job2, "JobState") == "COMPLETED" and job_field(job2, "ExitCode") == "0:0"
           and log_has(log2, rf"resumed from \S*step_{second} at step {second}"),
           f"the resubmitted job resumed at step {second} and completed step {last}")

    # 4. The run that was never interrupted.
    job3, log3 = submit(work, "reference", f"--train.output_dir={ref}", f"--train.max_steps={last}",
                        sbatch=("--time=10",))
    wait_for("the reference job to end", lambda: ended(job3), 600)
    expect(job_field(job3, "ExitCode") == "0:0", "the uninterrupted reference job completed")
    got, want = step_records(run), step_records(ref)
    expect(sorted(got) == sorted(want) == list(range(1, last + 1)), f"both runs logged steps 1..{last} once each")
    worst = max(abs(got[s][k] - want[s][k]) / max(abs(want[s][k]), 1e-12)
                for s in want for k in ("loss", "grad_norm"))
    expect(worst <= 1e-5 and all(math.isfinite(got[s]["loss"]) for s in got),
           f"losses and grad norms equal the uninterrupted run's at all {last} steps (largest relative "
           f"difference {worst:.1e})")


def main() -> int:
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        print("slurm-check: SLURM is not installed; as root: apt-get install -y slurm-wlm munge", file=sys.stderr)
        return 2
    started = False
    state = Path(os.environ.setdefault("TREADLE_SLURM_DIR", "/tmp/treadle-slurm"))
    if not (state / "slurmctld.pid").exists():
        subprocess.run([str(CLUSTER), "start"], check=True, stdout=subprocess.DEVNULL)
        started = True
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    # The jobs inherit this environment (sbatch --export=ALL): this interpreter's `python`, this checkout's treadle.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="treadle-slurm-check."))
    try:
        check(work)
    finally:
        if SUBMITTED:
            sh("scancel", *SUBMITTED, check=False)
        if started:
            subprocess.run([str(CLUSTER), "stop"], check=False)
        print(f"slurm-check: job logs and runs in {work}", flush=True)
    print("slurm-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
