"""Fully sharded data parallelism (FSDP2, ``fully_shard``): parameters, gradients and optimizer state sharded.

The same interface as ``LocalEngine``; what differs is hidden here:

* Sharding is applied in this one place: each decoder layer is a ``fully_shard`` unit
  (gathered just before it runs, freed after), then the root takes what is left
  (embeddings, final norm, LM head). The model file knows nothing about it.
* The optimizer is built after sharding, over the sharded (DTensor) parameters, hence a
  factory instead of an optimizer.
* Gradients are SUMMED over ranks, not averaged: the loop already divides each
  micro-batch's summed loss by the token count of the whole step on all ranks, so each
  rank's gradient is its share of the global gradient. FSDP's default reduce-scatter
  averages; every unit is told to divide by 1 using plain sums (gloo has no PREMUL_SUM).
* Gradient accumulation: non-final micro-batches skip the reduce-scatter
  (``set_requires_gradient_sync(False)``, unsharded gradients accumulate locally); the
  last micro-batch reduces everything once.
* Frozen parameters (a draft run's target) are sharded like the rest (they only take part
  in forward) and, as in ``LocalEngine``, left out of checkpoints.

Meshes (engine/mesh.py): ``mesh`` is what FSDP2 shards over (dp_shard x cp; 2-D with dp_replicate in front for
HSDP, where each replica's shards are all-reduced across replicas, summed as well). With ``tp_mesh`` the model is
first split by tensor parallelism (engine/tensor_parallel.py) and FSDP2 shards those DTensors again (2-D
parameters); its loss runs on vocabulary-sharded logits, so forward and backward run under ``loss_parallel`` here,
and the step's sums go over ``loss_group`` (data-parallel x context ranks: a TP group's ranks hold the same rows).

Every method that communicates (the collectives, ``clip_grad_norm``, ``state_dict``,
``load_state_dict``, ``export_state_dict``) must be called on all ranks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from treadle import distributed
from treadle.engine.local import CollectiveEngine
from treadle.engine.tensor_parallel import (apply_target_tensor_parallel, apply_tensor_parallel,
                                            vocabulary_parallel_loss)
from treadle.models.hf import decoder_layers
from treadle.models.sharded_load import materialize

# Full weights for export: gathered shard by shard and copied to CPU, on rank 0 only
# (no rank ever holds a second full copy on the accelerator).
_EXPORT = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Engine(CollectiveEngine):
    # backward, step, zero_grad and state (sharded DTensors keyed by parameter name: DCP saves
    # them, any world size loads them) are LocalEngine's.

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
        device: torch.device,
        *,
        mp_param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        mesh: DeviceMesh | None = None,
        tp_mesh: DeviceMesh | None = None,
        loss_group: dist.ProcessGroup | None = None,
        whole_root: bool = False,
    ):
        """Shard ``model`` (fp32, identical on every rank: same seed or same checkpoint) and build its optimizer.

        Parts of ``model`` may be on the meta device (``sharded_load``): they are allocated and read after sharding.

        ``mp_param_dtype``: the dtype layers compute in (e.g. bf16; None = fp32, the master
        weights' own dtype). ``reduce_dtype``: the dtype gradients are reduced in.
        ``cpu_offload``: sharded parameters, gradients and optimizer state live on the CPU.
        ``whole_root``: the root unit (embeddings, final norm, LM head) stays gathered from its forward to its
        backward, as torch does by default, for a draft beside the model that reads them in between.
        """
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Engine needs a process group: call treadle.distributed.init_distributed() first")
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if mesh is None:  # every rank one shard (the engine used alone, as tests build it)
            mesh = init_device_mesh(device.type, (self.world_size,))
        self.loss_group = loss_group
        self.tensor_parallel = False  # the model's loss runs on vocabulary shards (loss_parallel)
        # A draft run's frozen target is split for its forward only (its outputs whole); the draft stays whole.
        target = getattr(model, "target", None) if hasattr(model, "draft_model") else None
        if tp_mesh is not None and target is not None:
            apply_target_tensor_parallel(target, tp_mesh)
        elif tp_mesh is not None:  # first: FSDP2 shards the tensor-parallel DTensors again over the data dims
            apply_tensor_parallel(model, tp_mesh)
            self.tensor_parallel = True
        shard_kwargs = shard_options(mesh, device, mp_param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype,
                                     reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
        for layer in decoder_layers(model):
            fully_shard(layer, **shard_kwargs)
        # A draft beside the model (train/cotrain.py) reads the root's embedding and head after the model's forward
        # and before its backward (and after each evaluation forward): the root not resharded after its forward
        # keeps them whole there, in FSDP2's own unsharded parameters (no second gather, no copy). The backward
        # reshards them; a state_dict (checkpoint, export) reshards them first (FSDP2's pre-hooks).
        fully_shard(model, **{**shard_kwargs, "reshard_after_forward": False} if whole_root else shard_kwargs)
        sum_gradients(model.modules())
        # Methods other than forward that evaluations call (a draft's target_forward): FSDP must
        # gather the root's parameters around them as it does around forward.
        for name in getattr(model, "fsdp_forward_methods", ()):
            register_fsdp_forward_method(model, name)
        # A model built on the meta device (model.path, a draft's target) gets its shards now: each rank allocates
        # and reads only its own (sharded_load). Where offloaded, the shards live on the CPU.
        materialize(model, torch.device("cpu") if cpu_offload else device)
        self.model = self.module = model
        self.optimizer = optimizer_factory(model)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce_sum(t, self.device, self.loss_group)

    def forward_backward(self, micro_batches: list[dict], fn: Callable) -> torch.Tensor:
        if not self.tensor_parallel:
            return super().forward_backward(micro_batches, fn)
        with vocabulary_parallel_loss():  # the backward of a loss_parallel cross-entropy must run inside it too
            return super().forward_backward(micro_batches, fn)

    def forward_only(self, batches, fn: Callable) -> torch.Tensor | None:
        if not self.tensor_parallel:
            return super().forward_only(batches, fn)
        with vocabulary_parallel_loss():
            return super().forward_only(batches, fn)

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The pre-clip norm of the whole (sharded) gradient, as a plain tensor equal on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = grad_norm([p.grad for p in params])
        if max_norm > 0:
            clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU weights on rank 0 ({} elsewhere); frozen ones included, as ``LocalEngine`` exports them."""
        with _quiet_gathers():
            return get_model_state_dict(self.model, options=_EXPORT)


def shard_options(mesh: DeviceMesh, device: torch.device, *, mp_param_dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
                  cpu_offload: bool = False) -> dict:
    """``fully_shard``'s keyword arguments, the same for every unit of a model (FSDP2Engine's, a pipeline stage's)."""
    return dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype),
        # Pinned memory needs an accelerator; on a CPU-only machine the offload is a plain copy.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else OffloadPolicy(),
    )


def sum_gradients(modules) -> None:
    """Every FSDP unit among ``modules`` sums its gradients over its ranks instead of averaging them: the step has
    already divided each loss by the whole step's token count, so each rank's gradient is its share of the global
    one. Plain sums (gloo has no PREMUL_SUM for a divide factor of 1)."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` (plain tensors or DTensors) as a plain tensor: sharded gradients' per-shard norms are
    partial, and ``full_tensor()`` reduces them over the shards' mesh."""
    total = get_total_norm(grads, norm_type=2.0, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


@contextlib.contextmanager
def _quiet_gathers() -> Iterator[None]:
    """Around the export's gathers: a parameter sharded by FSDP2 over one already sharded by TP on the same dim
    gathers in two all-gathers, and DTensor warns on every rank that two collectives "may give inconsistent results
    between ranks". An all-gather only copies, so they cannot; the warning is held back here only (its logger's
    level restored after)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
