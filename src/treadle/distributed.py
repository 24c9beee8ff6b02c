"""The process group: one place that reads torchrun's environment and picks device and backend.

Launched by ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set),
``init_distributed`` joins the process group; launched plainly, it is one process and
creates no group, so every single-process path (tests, the CLI on a laptop) stays free
of torch.distributed. The collectives the engines share (sum, agree, any) live here too:
each is exactly one collective, because every one is a synchronisation point of the loop.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from treadle.errors import UserError, first_line

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise UserError(f"environment variable {name} is missing; accepted: launch with torchrun, which sets "
                            f"{', '.join(_TORCHRUN_ENV)}, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def choose_device(pref: str, local_rank: int = 0, key: str = "train.device") -> torch.device:
    """``auto`` takes the accelerator when there is one; a bare accelerator type gets this process's local rank.
    ``key``: the setting named in a refusal."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"  # device-ok: chosen from availability
    try:
        device = torch.device(pref)
    except RuntimeError:
        raise UserError(f"{key} = {pref!r} is not a device; accepted: auto, cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return device
    module = torch.get_device_module(device)
    if not module.is_available():
        raise UserError(f"{key} = {pref!r} but no {device.type} device is available; accepted here: auto, cpu")
    if device.index is None:  # one accelerator per local rank, as torchrun lays processes out
        device = torch.device(device.type, local_rank)
    if device.index >= module.device_count():
        raise UserError(f"device {device} does not exist: this node has {module.device_count()} {device.type} devices "
                        f"(local rank {local_rank})")
    module.set_device(device)
    return device


def init_distributed(device_pref: str = "auto", *, num_threads: int | None = None,
                     timeout: datetime.timedelta | None = None) -> DistInfo:
    """Join torchrun's process group (or stay one process when its environment is absent).

    The backend follows the device (nccl on CUDA, gloo on CPU). ``num_threads``: intra-op
    threads; by default a multi-rank CPU job uses one per rank (ranks share the cores, and
    more threads only make them fight), unless OMP_NUM_THREADS says otherwise. ``timeout``
    bounds every collective, so a rank that died does not hang the others forever.
    """
    if not all(name in os.environ for name in _TORCHRUN_ENV):
        device = choose_device(device_pref)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)

    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", default=rank)
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            _env_int(name)  # raises the one-line error about the launch
    device = choose_device(device_pref, local_rank)
    backend = dist.get_default_backend_for_device(device)  # nccl for CUDA, gloo for CPU
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif device.type == "cpu" and world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if not dist.is_initialized():
        if timeout is None:  # torch's own default per backend (NCCL's is the shorter)
            timeout = default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout else default_pg_timeout
        kwargs = {"device_id": device} if device.type != "cpu" else {}  # binds the communicator to the device eagerly
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=_attempt_store(rank, world_size, timeout), **kwargs)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def restart_count() -> int:
    """How many times torchrun (``--max-restarts``) has restarted this job's workers; 0 outside torchrun."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", default=0)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The store the default group bootstraps on: what ``init_process_group`` would make, under a key prefix that
    is this attempt's own when the store outlives attempts.

    torchrun's c10d rendezvous hosts one TCPStore in its agent for the whole job and hands every attempt the same
    MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True). ``init_process_group`` keys its bootstrap under a
    fixed prefix, so a restarted attempt reads the dead attempt's entries: gloo dials the old ranks' addresses
    (``connectFullMesh``: Connection refused), NCCL takes the old unique id, and an attempt after that can hang.
    Every other group (``new_group``, device meshes, the checkpoint writer's and the health check's groups)
    derives its keys from the default group's store, so this one prefix covers them all. The restart count is
    counted by each node's agent, and an agent that restarts its workers because another node re-joined does not
    count: across nodes the counts can differ. Without the agent's store (c10d rendezvous with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or another launcher) rank 0 hosts a fresh store on a fresh port
    each attempt, so the plain prefix is safe and no count has to agree (docs/multinode.md).
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = "default_pg"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        prefix = f"treadle/attempt_{restart_count()}/default_pg"
        nodes = _env_int("GROUP_WORLD_SIZE", default=1)
        if rank == 0 and nodes > 1 and _env_int("TORCHELASTIC_MAX_RESTARTS", default=0) > 0:
            print(f"treadle: warning: torchrun --max-restarts on {nodes} nodes sharing the agent's store: nodes count "
                  "restarts apart, so a restarted attempt can hang at its start; set "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (docs/multinode.md)", file=sys.stderr, flush=True)
    return dist.PrefixStore(prefix, store)


@dataclass(frozen=True)
class Layout:
    """Data-parallel ranks x context-parallel groups (``distributed.context_parallel``), as the device mesh
    (engine/mesh.py ``Mesh.layout``) lays them out.

    Ranks ``[g * cp, (g + 1) * cp)`` form context group ``g`` (neighbours: on GPUs, one node's fast links carry
    the all-to-alls) and share one data-parallel rank, ``g``: they are handed the same micro-batches and each
    takes slice ``cp_rank`` of every sequence. With ``cp == 1`` this is plain data parallelism.
    """

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: object = None  # the context group's ProcessGroup (None when cp_size == 1)


@contextlib.contextmanager
def quiet_single_process_dcp() -> Iterator[None]:
    """Around treadle's own DCP save/load: without a process group DCP warns on every call that it assumes one
    process, which is exactly how treadle means it. The filter lives only inside this block (a library must not
    change its host's warnings). ``catch_warnings`` swaps the process-wide filter list, so it is used on the main
    thread only: a background checkpoint writer leaves the warning as Python shows it (once per process).
    """
    if (dist.is_available() and dist.is_initialized()) or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def destroy() -> None:
    """Leave the process group (a no-op for a single process)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- collectives shared by the distributed engines (one collective each) ----

def all_reduce_sum(t: torch.Tensor, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over the ranks of ``group`` (None: all), on ``device``; the caller's tensor is left untouched."""
    out = t.detach().to(device, copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_agree(ok: bool, device: torch.device) -> bool:
    """True on every rank only if true on every rank."""
    flag = torch.tensor(1 if ok else 0, dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if true on any rank."""
    t = torch.tensor(1 if flag else 0, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The element-wise max over ranks (per-rank peaks: the largest rank's)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """``obj`` as rank ``src`` has it, on every rank of ``group`` (itself when there is no process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def on_main(fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only; a UserError it raises is raised on every rank.

    For the few things one process must do alone (create the run directory, write the
    resolved config): the other ranks wait for the outcome instead of running ahead into
    a collective that rank 0, having failed, will never join.
    """
    error = result = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except UserError as exc:
            error = str(exc)
    error = broadcast_object(error)
    if error is not None:
        raise UserError(error)
    return result


class HealthCheck:
    """A cheap all-ranks round trip with its own deadline, so a hung rank is named, not waited on.

    The loop's own collectives block until the process-group timeout (minutes, because a
    slow checkpoint is legitimate). This check runs on a separate gloo group with a short
    timeout at step boundaries, where every healthy rank arrives within one step time: a
    rank that does not arrive is stuck (in I/O, in a deadlock, or stopped by a debugger),
    and every rank that did arrive fails with a line that says so instead of stalling.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # new_group is itself collective: every rank builds the checker at the same point.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def check(self, step: int) -> None:
        alive = torch.ones(1)
        try:
            dist.all_reduce(alive, group=self.group)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError on timeout or a lost peer
            raise HealthCheckFailed(
                f"health check after step {step}: not every one of {dist.get_world_size()} ranks answered within "
                f"{self.timeout_s:g} s (distributed.health_check_timeout_s); a rank is hung or dead "
                f"({first_line(exc)})") from None
        if int(alive.item()) != dist.get_world_size():
            raise HealthCheckFailed(f"health check after step {step}: {int(alive.item())} of "
                                    f"{dist.get_world_size()} ranks answered")


class HealthCheckFailed(RuntimeError):
    pass
