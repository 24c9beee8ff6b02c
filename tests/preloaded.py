"""Processes forked from one interpreter that has already imported torch, transformers and treadle.

A fresh interpreter spends ~3 s of CPU importing them before it does anything (most of a shortened docs command, and
of a distributed test's rank). The suite starts many: the docs pages' ~50 commands, 2 ranks per distributed test.
``context()`` is multiprocessing's forkserver with those modules preloaded: the server imports them once, and each
process forks from it, a new process (its own pid, state, exit code; SIGKILL kills it alone) that skips the imports.

What a forked child does not take from the process that starts it, it is handed explicitly: the environment (the
server keeps the one it started with) and stdout / stderr (the server's are those of whichever test started it), so
the child writes them to files its parent reads. ``cwd`` and ``sys.path`` travel with multiprocessing's own
preparation data, as under spawn.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

# What every treadle command and rank imports anyway; a module that fails to import is skipped by the server.
PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "treadle.cli", "treadle.train.run",
           "treadle.speculative.evaluate"]
# Read by libraries when they are imported, so in the server's environment, not the child's: one thread per process
# (2 shared cores; the commands and ranks set their own counts anyway) and no network (a test downloads nothing).
SERVER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def context():
    """The forkserver context, its server started (once per test session) with ``PRELOAD`` imported."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def enter(env: dict, stdout: str, stderr: str) -> None:
    """A forked child's first step: the parent's environment, and its stdout / stderr into those files."""
    os.environ.clear()
    os.environ.update(env)
    for stream, path in ((sys.stdout, stdout), (sys.stderr, stderr)):
        stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, stream.fileno())
        os.close(fd)


def _cli(argv: list[str], env: dict, stdout: str, stderr: str) -> None:
    enter(env, stdout, stderr)
    sys.argv = ["treadle", *argv]
    from treadle.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def start_treadle(argv: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path):
    """``treadle ARGV`` started (as ``python -m treadle ARGV`` runs it: ``treadle.cli.main``, its return value the
    exit code) in a forked child with ``env`` and working directory ``cwd``, writing into those files; returns the
    ``multiprocessing.Process`` (``exitcode``, ``kill()``, ``join()``)."""
    ctx = context()
    here = os.getcwd()
    os.chdir(cwd)  # the preparation data carries the parent's working directory to the child
    try:
        proc = ctx.Process(target=_cli, args=(argv, env, str(stdout), str(stderr)))
        proc.start()
    finally:
        os.chdir(here)
    return proc


def run_treadle(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``start_treadle`` run to its end, as ``subprocess.run(..., capture_output=True, text=True)`` runs a command:
    a child still running after ``timeout`` seconds is killed and ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryDirectory(prefix="treadle-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = start_treadle(argv, cwd, env, out, err)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["treadle", *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["treadle", *argv], proc.exitcode, out.read_text(), err.read_text())


class Forked:
    """``subprocess.Popen`` of ``[sys.executable, "-m", "treadle", *argv]`` as far as the tests use it (``pid``,
    ``returncode``, ``poll``, ``wait``, ``kill``, ``send_signal``, ``communicate``: text), its child forked by
    ``start_treadle``. ``merge``: stderr into stdout (``stderr=subprocess.STDOUT``)."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | None = None, merge: bool = False):
        folder = Path(tempfile.mkdtemp(prefix="treadle-cli-"))
        weakref.finalize(self, shutil.rmtree, folder, True)
        self._out, self._err = folder / "stdout", folder / ("stdout" if merge else "stderr")
        self._out.touch()
        self._err.touch()
        self._merge = merge
        self._proc = start_treadle(argv, Path.cwd() if cwd is None else cwd, env, self._out, self._err)
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"treadle (pid {self.pid})", timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self._out.read_text(), None if self._merge else self._err.read_text()
