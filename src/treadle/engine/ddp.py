"""Data parallelism with a full replica per rank (DistributedDataParallel).

The same interface as ``LocalEngine``; what differs is hidden here:

* Gradients are SUMMED over ranks, not averaged. The loop already divides every
  micro-batch's summed loss by the token count of the whole step on all ranks, so each
  rank's gradient is its share of the global gradient and the shares add up. DDP's
  default hook averages (divides by the world size), which would halve the update at
  two ranks; a comm hook replaces it.
* Non-final micro-batches run under DDP's ``no_sync``: gradients accumulate locally and
  are all-reduced once, during the backward of the last micro-batch.
* State is keyed by the unwrapped parameter names (``get_state_dict`` strips DDP's
  ``module.``), so a checkpoint does not depend on the engine or the world size.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from treadle.engine.local import CollectiveEngine


def _sum_allreduce_hook(process_group, bucket):
    """All-reduce a gradient bucket (a dist.GradBucket) without DDP's division by the world size.

    No annotations: DDP checks them against the real classes, and ``from __future__ import
    annotations`` turns them into strings it rejects.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class DDPEngine(CollectiveEngine):
    # backward, clip (every rank holds the full summed gradient), step, zero_grad and state
    # (get_state_dict strips DDP's module. prefix) are LocalEngine's.

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 find_unused_parameters: bool = False):
        """``model`` is already on ``device``; ``optimizer`` holds its parameters (DDP keeps them)."""
        if not dist.is_initialized():
            raise RuntimeError("DDPEngine needs a process group: call treadle.distributed.init_distributed() first")
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.module = model
        device_ids = None if device.type == "cpu" else [device]
        # Construction broadcasts rank 0's parameters and buffers: the replicas start identical.
        self.model = DistributedDataParallel(model, device_ids=device_ids,
                                             find_unused_parameters=find_unused_parameters)
        self.model.register_comm_hook(state=None, hook=_sum_allreduce_hook)
        self.optimizer = optimizer

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        # The backward must run inside the context: that is where DDP decides whether to reduce.
        if last:
            yield
        else:
            with self.model.no_sync():
                yield

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank holds the full weights; only rank 0 hands them out (the others export nothing)."""
        return self.module.state_dict() if self.rank == 0 else {}
