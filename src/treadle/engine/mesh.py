"""The device mesh: every parallel axis of a launch in one object, built once from ``[distributed]``.

Ranks are laid out row-major over ``pp x dp_replicate x dp_shard x cp x tp`` (the last axis varies fastest): the
ranks of one tensor-parallel group are neighbours (on GPUs, one node's fast links carry TP's per-layer
collectives), then the context group, then the data-parallel shards; replicas (HSDP) and pipeline stages are the
outermost, where the traffic is lightest. torchtitan's ParallelDims orders its axes the same way.

Each component asks the mesh for its part instead of computing ranks itself:

* the loader: ``dp_rank`` / ``dp_size`` (which share of each step's samples: replicas x shards; the ranks of one
  TP or context group read the same rows) and ``cp_rank`` / ``cp_size`` (which slice of every sequence);
* the step's sums (label tokens, losses): ``loss_group``, data-parallel x context ranks, never over "tp" (its ranks
  hold the same rows and the same replicated loss: summing them would count every token tp times);
* FSDP2: ``fsdp_mesh`` (dp_shard x cp flattened, with dp_replicate in front for HSDP); tensor parallel:
  ``tp_mesh``; context parallel: ``layout.cp_group``. Decisions (the finite check, a stop) stay over the world.

The DeviceMesh is torch's (``init_device_mesh``); treadle adds no collectives. A pipeline run takes its stages'
group from ``pp_group``, the sums over its data-parallel ranks from ``dp_group`` and, with FSDP2 inside the stages,
the shard dimension from ``fsdp_mesh`` (engine/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treadle.distributed import DistInfo, Layout
from treadle.errors import UserError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The [distributed] key of each axis, as the one-line errors name them.
KEYS = {"pp": "pipeline_parallel", "dp_replicate": "data_parallel_replicate", "dp_shard": "data_parallel_shard",
        "cp": "context_parallel", "tp": "tensor_parallel"}


@dataclass(frozen=True)
class Mesh:
    rank: int
    world_size: int
    sizes: dict  # axis -> size, every axis of AXES
    device_mesh: DeviceMesh | None = None  # None: one process
    # Flattened dimensions by the dimensions they join, kept here: torch deprecates slicing them back out of the root.
    flattened: dict = field(default_factory=dict)

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis`` (row-major over AXES)."""
        stride = 1
        for name in reversed(AXES):
            if name == axis:
                return (self.rank // stride) % self.sizes[name]
            stride *= self.sizes[name]
        raise KeyError(axis)

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp_replicate"] * self.sizes["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp_replicate") * self.sizes["dp_shard"] + self.coordinate("dp_shard")

    def view(self, *axes: str) -> DeviceMesh:
        """The 1-D mesh over ``axes`` together (the dimensions of size 1 left out: they are not in the DeviceMesh)."""
        present = tuple(a for a in axes if a in self.device_mesh.mesh_dim_names)
        return self.device_mesh[present[0]] if len(present) == 1 else self.flattened[present]

    @property
    def layout(self) -> Layout:
        cp = self.sizes["cp"]
        group = self.device_mesh["cp"].get_group() if cp > 1 and self.device_mesh is not None else None
        return Layout(dp_rank=self.dp_rank, dp_size=self.dp_size, cp_rank=self.coordinate("cp"), cp_size=cp,
                      cp_group=group)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.device_mesh["tp"] if self.tp > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """What FSDP2 shards over: dp_shard x cp (a context group's ranks hold the same weights, so they can share
        the shards), with dp_replicate as the outer dimension (HSDP: sharded within, replicated across)."""
        if self.device_mesh is None:
            return None
        shard = self.view("dp_shard", "cp")
        if self.sizes["dp_replicate"] > 1:
            return DeviceMesh._concatenate([self.device_mesh["dp_replicate"], shard])
        return shard

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline: one per stage rank, the same data-parallel coordinate."""
        return self.device_mesh["pp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel ranks at this rank's pipeline coordinate (replicas x shards): they read different rows,
        so token counts and loss sums, and unsharded gradients, are summed over them."""
        return self.view("dp_replicate", "dp_shard", "cp").get_group()

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The group the step's token counts and loss sums are summed over (None: the world, the same ranks)."""
        if self.device_mesh is None or self.tp == 1:
            return None
        return self.view("dp_replicate", "dp_shard", "cp").get_group()

    def describe(self) -> str:
        """The axes larger than 1, as the start line shows them."""
        return " x ".join(f"{KEYS[a]} {n}" for a, n in self.sizes.items() if n > 1) or "one process"


def _sizes(d, world_size: int) -> dict:
    """Every axis's size; data_parallel_shard = -1 takes what the others leave. One line when they do not fit."""
    sizes = {"pp": d.pipeline_parallel, "dp_replicate": d.data_parallel_replicate, "dp_shard": d.data_parallel_shard,
             "cp": d.context_parallel, "tp": d.tensor_parallel}
    fixed = 1
    for axis, n in sizes.items():
        if axis != "dp_shard" or n != -1:
            fixed *= n
    if sizes["dp_shard"] == -1:
        if world_size % fixed == 0:
            sizes["dp_shard"] = world_size // fixed
            return sizes
        set_axes = [a for a, n in sizes.items() if a != "dp_shard" and n > 1]
        if len(set_axes) == 1:  # one axis: the simplest words (and the launch that would fit)
            key, n = KEYS[set_axes[0]], sizes[set_axes[0]]
            raise UserError(f"distributed.{key} = {n} does not divide the world size {world_size}; accepted: a launch "
                            f"of {n} or a multiple of {n} ranks (torchrun --nproc_per_node N, N divisible by {n}), "
                            f"or {key} = 1")
        product = " x ".join(f"{KEYS[a]} {sizes[a]}" for a in set_axes)
        raise UserError(f"distributed: {product} = {fixed} ranks per data-parallel shard does not divide the launch's "
                        f"{world_size}; accepted: a launch of a multiple of {fixed} ranks, or smaller axes")
    if fixed != world_size:
        product = " x ".join(f"{KEYS[a]} {n}" for a, n in sizes.items() if n > 1 or a == "dp_shard")
        raise UserError(f"distributed: {product} = {fixed} ranks, but the launch has {world_size}; accepted: axes "
                        f"whose product is {world_size}, or data_parallel_shard = -1 (what the others leave)")
    return sizes


def build_mesh(d, info: DistInfo) -> Mesh:
    """The launch's mesh from ``[distributed]`` (``d``: a DistributedConfig, or anything with its axis fields).

    Collective under a launcher (torch creates every dimension's group on every rank, in order): every rank calls
    it at the same point.
    """
    sizes = _sizes(d, info.world_size)
    if not info.distributed:
        return Mesh(info.rank, info.world_size, sizes)
    # Only the dimensions larger than 1 become process groups (a plain FSDP run: one, over the world), and dp_shard
    # always: FSDP2 shards over it, at size 1 too, where tensor parallelism takes every rank (its DTensors and
    # FSDP's must come from one root mesh).
    names = tuple(a for a in AXES if sizes[a] > 1 or a == "dp_shard")
    mesh = init_device_mesh(info.device.type, tuple(sizes[a] for a in names), mesh_dim_names=names)
    # Flattened views, each one process group, made here because making one is collective: FSDP's shard dimension
    # (dp_shard x cp), the loss sums' (data x context), and the meshes of the grad norm of 2-D / 3-D parameters
    # (reduced over all their dimensions at once: DTensor finds a flattened mesh of the same ranks and runs one
    # all-reduce instead of one per dimension, and warns when there is none). Kept by their dimensions: torch
    # deprecates slicing a flattened dimension back out of the root mesh.
    wanted = [("dp_shard", "cp"), ("dp_replicate", "dp_shard", "cp"), ("dp_shard", "cp", "tp"),
              ("dp_replicate", "dp_shard", "cp", "tp")]
    flat = {}
    for axes in wanted:
        present = tuple(a for a in axes if a in names)
        if len(present) > 1 and present not in flat:
            flat[present] = mesh[present]._flatten("_".join(present))
    return Mesh(info.rank, info.world_size, sizes, mesh, flat)


def context_layout(info: DistInfo, cp: int) -> Layout:
    """The layout of this launch for ``cp`` ranks per sequence (every other rank data-parallel); a one-line UserError
    when it cannot be laid out: the mesh's data x context view, for code that needs no other axis."""
    axes = SimpleNamespace(pipeline_parallel=1, data_parallel_replicate=1, data_parallel_shard=-1, context_parallel=cp,
                           tensor_parallel=1)
    return build_mesh(axes, info).layout
