"""Run a function on ``world_size`` local CPU ranks (gloo) from a test, and never hang the suite.

    results = run_distributed(check_something, world_size=2, tmp=str(tmp_path))

``fn(rank, world_size, **kwargs)`` runs in each rank's process, inside a gloo process
group made by ``treadle.distributed.init_distributed`` (the project's own launch path,
with the environment torchrun would set). ``fn`` must be a module-level function (it is
pickled by name) and return something picklable. The ranks are forked from a server that
has imported torch, transformers and treadle once (tests/preloaded.py): each is a new
process with the caller's environment, working directory and sys.path, its stdout and
stderr copied to the caller's. Every launch still costs a few seconds (the process group,
the model): make each one check a lot. A script (not pytest) that calls this needs an
``if __name__ == "__main__":`` guard, or the ranks re-run it.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tests import preloaded

# After the first rank fails, the others usually fail on their own within moments (a
# collective loses its peer); their errors are collected for this long, then they are killed.
_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, timeout: float, result_dir: str, env: dict,
           kwargs: dict) -> None:
    preloaded.enter(env, f"{result_dir}/rank{rank}.stdout", f"{result_dir}/rank{rank}.stderr")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # 2 cores, 2 ranks: more threads per rank only make them fight
    # A hang shows where each rank is stuck (stderr) shortly before the parent gives up.
    faulthandler.dump_traceback_later(max(1.0, timeout - 5.0), exit=False)
    from treadle import distributed

    try:
        distributed.init_distributed("cpu", timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, **kwargs)
    except BaseException:
        # Written before leaving the group: leaving makes the peers fail, and the time
        # orders the failures (the first is the cause, the others mostly lost a peer).
        with open(Path(result_dir) / f"rank{rank}.err", "wb") as f:
            pickle.dump((time.time(), traceback.format_exc()), f)
        raise
    finally:
        distributed.destroy()
        faulthandler.cancel_dump_traceback_later()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def _copy_output(result_dir: Path, world_size: int) -> None:
    """The ranks' stdout and stderr onto the caller's (pytest shows them with a failure, as with spawned ranks)."""
    for rank in range(world_size):
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = result_dir / f"rank{rank}.{name}"
            if path.is_file() and path.stat().st_size:
                stream.write(path.read_text(errors="replace"))
        sys.stdout.flush()


class DistributedTestError(RuntimeError):
    pass


def _failures(result_dir: Path, processes) -> str:
    errors = []
    for rank, p in enumerate(processes):
        err = result_dir / f"rank{rank}.err"
        if err.is_file():
            when, trace = pickle.loads(err.read_bytes())
            errors.append((when, rank, trace))
        elif p.exitcode not in (0, None):
            errors.append((float("inf"), rank, f"exit code {p.exitcode} (negative: killed by that signal)\n"))
    errors.sort()
    return "\n".join(f"-- rank {rank}{' (first to fail)' if i == 0 else ''}:\n{trace}"
                     for i, (_, rank, trace) in enumerate(errors))


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 120, **kwargs) -> list[Any]:
    """Results of ``fn`` per rank.

    Raises ``DistributedTestError`` with every failed rank's traceback (the first failure
    first) if a rank fails, ``TimeoutError`` after ``timeout`` seconds (the ranks' stacks
    are dumped to stderr just before). No process outlives the call.
    """
    with tempfile.TemporaryDirectory(prefix="treadle-dist-") as tmp:
        result_dir = Path(tmp)
        preloaded.context()  # the forkserver, started with its modules preloaded (once a session)
        context = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), timeout, str(result_dir), dict(os.environ), kwargs),
            nprocs=world_size, join=False, start_method="forkserver",
        )
        processes = context.processes
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        try:
            while True:
                codes = [p.exitcode for p in processes]
                if all(c == 0 for c in codes):
                    break
                now = time.monotonic()
                if any(c not in (0, None) for c in codes):
                    first_failure = now if first_failure is None else first_failure
                    if None not in codes or now - first_failure > _GRACE_S:
                        raise DistributedTestError(f"{getattr(fn, '__name__', fn)} failed on {world_size} ranks:\n"
                                                   + _failures(result_dir, processes))
                if now >= deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks within "
                                       f"{timeout:.0f} s (the ranks' stacks are on stderr)")
                wait([p.sentinel for p in processes if p.exitcode is None], timeout=min(0.5, max(0.01, deadline - now)))
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
            _copy_output(result_dir, world_size)
        return [pickle.loads((result_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
