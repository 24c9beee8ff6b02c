"""Pipeline parallelism: the decoder layers split into stages over ranks, on torch.distributed.pipelining.

The same interface as ``LocalEngine``; what differs is hidden here:

* Who runs the micro-batches. ``forward_backward`` hands the step's micro-batches to a torch schedule
  (GPipe, 1F1B, interleaved 1F1B) instead of looping over them; the step's loss function runs on the
  last stage, on that stage's logits (``_Outputs`` replays them as the model's output), so the loss is
  still ``sum CE / N_step`` with N counted over the whole step before any backward (``scale_grads=False``:
  torch must not divide by the number of micro-batches again).
* The split. Each rank keeps only what its stages own; everything else in the model becomes a
  ``PassThrough`` (returns its input), so parameter names stay those of the full model: DCP checkpoints
  of the stages together hold the full model's state dict, and resume at any pipeline size (1 included).
  A stage is a *view* of the rank's model (shallow copies down to the layer list) that runs the model's
  own forward with the other stages' layers passed through: no per-architecture forward code. That
  relies on the model's forward not transforming the hidden state outside its layers, embedding and
  head (Gemma scales its embeddings there), so the split is checked once against the whole model's
  logits before anything is pruned.
* Tied embeddings: the first stage's embedding and the last stage's head are one weight on two ranks;
  their gradients are summed between those two ranks after the backward, and the norm counts it once.
* Sums and decisions. ``all_reduce_sum`` sums over data-parallel replicas (a pipeline is one replica:
  every stage saw the same micro-batches), ``all_agree`` / ``any_rank`` over every rank; the gradient
  norm is the global norm over all stages; the step's loss sums, computed on the last stage, are
  broadcast so every rank of the pipeline reports the same loss.
* Data parallelism beside the stages: a launch of ``pipeline_parallel x R`` ranks runs R pipelines, each on its
  own micro-batches. Rank ``stage_rank * R + data rank`` (the device mesh's row-major layout, engine/mesh.py: the
  ranks holding one stage are neighbours, as torchtitan lays its mesh out: on GPUs their gradient traffic is the
  heavy one, the pipeline's activations are light). Two ways, the loss already divided by the step's global token
  count as for every engine, so gradients are SUMMED over the R ranks, never averaged:

  - replicas (``distributed.engine = auto``): each stage whole on its R ranks; after the schedule's backward its
    gradients are summed over them in one flat all-reduce (DDP's result, without overlapping the backward);
  - FSDP2 inside each stage (``distributed.engine = fsdp2``): every decoder layer of the stage, then the stage
    itself (what is left: embedding, final norm, head), ``fully_shard``ed over the mesh's dp_shard dimension of
    this pipeline coordinate. The stage handed to torch's ``PipelineStage`` is the FSDP module, and torch's
    schedules then skip the reduce-scatter on all but the last backward of the step
    (``set_requires_gradient_sync(False)``, ``set_is_last_backward``) and reduce every unit once at its end
    (``PipelineStage.perform_reduce_grad``): one reduce-scatter per unit per step, as FSDP2Engine's ``no_sync``.
    Gradients, parameters and optimizer state are DTensor shards; the norm is DTensor's over the shards, then
    summed over the stages.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_

from treadle.distributed import DistInfo
from treadle.engine.fsdp2 import grad_norm, shard_options, sum_gradients
from treadle.engine.local import CollectiveEngine, trainable_state
from treadle.engine.mesh import Mesh, build_mesh
from treadle.errors import UserError
from treadle.models.hf import decoder_layers
from treadle.models.sharded_load import is_empty, materialize

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # stages per rank


def check_layout(pipeline_parallel: int, world_size: int) -> None:
    if world_size % pipeline_parallel:
        raise UserError(f"distributed.pipeline_parallel = {pipeline_parallel} does not divide this launch's "
                        f"{world_size} processes; accepted: --nproc_per_node {pipeline_parallel} or a multiple of it "
                        f"(the multiple = data-parallel pipelines)")


def _tied_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """The group of the first and the last stage rank of this rank's pipeline (a tied embedding and head), None on
    the ranks of neither. Two stage ranks: the pipeline itself. More: one pair per data coordinate, created on every
    rank in the same order (collective); rank = stage rank x data ranks + data rank (the mesh's row-major layout)."""
    pp = mesh.sizes["pp"]
    if pp == 2:
        return mesh.pp_group
    dp = mesh.world_size // pp
    return dist.new_subgroups_by_enumeration([[d, (pp - 1) * dp + d] for d in range(dp)])[0]


def _pipeline_mesh(pipeline_parallel: int, device: torch.device) -> Mesh:
    """The mesh of a pipeline engine built without one (as tests build it): stages x the data ranks left."""
    from types import SimpleNamespace

    axes = SimpleNamespace(pipeline_parallel=pipeline_parallel, data_parallel_replicate=1, data_parallel_shard=-1,
                           context_parallel=1, tensor_parallel=1)
    rank = dist.get_rank()
    return build_mesh(axes, DistInfo(rank, dist.get_world_size(), rank, device, dist.get_backend()))


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: equal, consecutive blocks."""
    per = num_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


class PassThrough(nn.Module):
    """Stands in for a module another stage owns: returns its input (a decoder layer's hidden state)."""

    def forward(self, x, *args, **kwargs):
        return x


class _Outputs:
    """The last stage's logits, handed to the step's loss function as if the whole model had produced them."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, **_):
        return self

    def modules(self):  # no chunked head here: the last stage returned logits
        return iter(())


def _shell(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with some children replaced; parameters and the other children are shared."""
    shell = copy.copy(module)
    shell._modules = {**module._modules, **children}
    return shell


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(n for n, m in parent.named_children() if m is child)


class _Parts:
    """Where the pieces of an HF causal LM are: its base model, layer list, embedding, final norm and head."""

    def __init__(self, model: nn.Module):
        self.base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        self.layers = decoder_layers(model)
        norm = getattr(self.base, "norm", None)
        head = model.get_output_embeddings()
        if self.base is None or not isinstance(norm, nn.Module) or head is None:
            raise UserError(f"distributed.pipeline_parallel: {type(model).__name__} is not a decoder with a final "
                            "norm and an output layer that can be split into stages; accepted: pipeline_parallel = 1")
        self.layers_name = _child_name(self.base, self.layers)
        self.embed_name = _child_name(self.base, model.get_input_embeddings())
        self.head_name = _child_name(model, head)
        self.tied = head.weight is model.get_input_embeddings().weight


def _view(model: nn.Module, parts: _Parts, layers: range, first: bool, last: bool) -> nn.Module:
    """The model's forward restricted to one stage: other layers, and the embedding / norm / head it does not
    own, pass their input through."""
    kept = nn.ModuleList([m if i in layers else PassThrough() for i, m in enumerate(parts.layers)])
    base = {parts.layers_name: kept}
    if not first:
        base[parts.embed_name] = PassThrough()
    if not last:
        base["norm"] = PassThrough()
    top = {getattr(model, "base_model_prefix", "model"): _shell(parts.base, **base)}
    if not last:
        top[parts.head_name] = PassThrough()
    return _shell(model, **top)


class _Stage(nn.Module):
    """What torch's PipelineStage runs: token ids (first stage) or hidden states in, hidden states or logits out."""

    def __init__(self, view: nn.Module, first: bool, autocast: Callable):
        super().__init__()
        self.view = view
        self.first = first
        self.autocast = autocast

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with self.autocast():
            return self.view(**inputs, position_ids=position_ids, use_cache=False).logits


def _check_split(model: nn.Module, views: list[nn.Module]) -> None:
    """The chained stage views give the whole model's logits (fixed ids: no RNG is drawn)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) % model.config.vocab_size)[None]
    pos = torch.arange(8, device=device)[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        x = ids
        for i, v in enumerate(views):
            v.eval()
            x = v(**({"input_ids": x} if i == 0 else {"inputs_embeds": x}), position_ids=pos, use_cache=False).logits
    model.train(was_training)
    if x.shape != want.shape or not torch.allclose(x, want, rtol=1e-5, atol=1e-6):
        raise UserError(f"distributed.pipeline_parallel: {model.config.model_type} models cannot be split into stages "
                        "by passing modules through (their forward changes the hidden state outside the layers); "
                        "accepted: pipeline_parallel = 1")


def _twin(model: nn.Module, num_stages: int) -> nn.Module:
    """A model of ``model``'s architecture with one decoder layer per stage and random weights, for ``_check_split``
    of a model built empty (its weights are read later, stage by stage): the check asks what the forward does
    outside the layers, which the weights do not change. The global RNG is left as it was."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_stages
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_stages]
    with torch.random.fork_rng(devices=[]):
        return type(model)(config)


def plan_stages(model: nn.Module, pipeline_parallel: int, schedule: str) -> tuple[_Parts, list[range]]:
    """The model's parts and each stage's layers; UserError (one line) for a model that cannot be split so."""
    v = VIRTUAL_STAGES[schedule]
    num_stages = pipeline_parallel * v
    parts = _Parts(model)
    n_layers = len(parts.layers)
    if n_layers % num_stages:
        raise UserError(f"distributed.pipeline_parallel = {pipeline_parallel}: {n_layers} decoder layers do not split "
                        f"into {num_stages} equal stages ({pipeline_parallel} ranks x {v} for {schedule!r}); accepted: "
                        f"a pipeline_parallel (x {v}) that divides {n_layers}")
    layout = stage_layers(n_layers, num_stages)
    checked, checked_parts, checked_layout = model, parts, layout
    if is_empty(model):  # nothing to run yet: the same forward with random weights, one layer per stage
        checked = _twin(model, num_stages)
        checked_parts, checked_layout = _Parts(checked), stage_layers(num_stages, num_stages)
    _check_split(checked, [_view(checked, checked_parts, checked_layout[s], s == 0, s == num_stages - 1)
                           for s in range(num_stages)])
    return parts, layout


class PipelineEngine(CollectiveEngine):
    # backward (the schedule runs it), step, zero_grad and load_state_dict are LocalEngine's.
    state_is_partial = True  # each rank's state dict holds its stages' tensors only (the checkpoint holds them all)

    def __init__(self, model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                 device: torch.device, *, pipeline_parallel: int, schedule: str, micro_batches: int,
                 autocast: Callable, mesh: Mesh | None = None, fsdp: dict | None = None):
        """Split ``model`` (fp32, on ``device``, identical on every rank) into this rank's stages.

        ``model`` may be empty (on the meta device, read from ``model.path``): each rank then allocates and reads
        only what its stages keep (``sharded_load.materialize`` after the split, and after sharding), never the
        whole model. ``mesh``: the launch's (engine/mesh.py; None: stages x the data ranks left). ``fsdp``: None
        for whole stages summed over the data ranks, else ``shard_options``' keywords (not ``mesh``) for FSDP2
        inside each stage over the mesh's shard dimension."""
        if not dist.is_initialized():
            raise RuntimeError("PipelineEngine needs a process group: call treadle.distributed.init_distributed() first")
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        check_layout(pipeline_parallel, self.world_size)
        self.mesh = mesh = mesh if mesh is not None else _pipeline_mesh(pipeline_parallel, device)
        pp, dp = pipeline_parallel, self.world_size // pipeline_parallel
        self.stage_rank, self.replica, self.replicas = mesh.coordinate("pp"), mesh.dp_rank, dp
        self.sharded = fsdp is not None
        parts, layout = plan_stages(model, pp, schedule)
        self.num_stages = len(layout)
        n_layers = len(parts.layers)
        # The optimizer's groups by the full model's parameter names: every rank saves the same lists (DCP keeps
        # one rank's copy), and a resume at another pipeline size finds each of its parameters in a group.
        names = {id(p): n for n, p in model.named_parameters()}
        self._group_names = [[names[id(p)] for p in g["params"]] for g in optimizer_factory(model).param_groups]
        # A tied head's key and the embedding's: one tensor in the export, as one process's state dict has it.
        self._tied_keys = (f"{parts.head_name}.weight", names[id(model.get_input_embeddings().weight)]) if parts.tied else None

        # Stage s runs on stage rank s % pp (the looped placement interleaved schedules expect).
        self.stage_ids = [s for s in range(self.num_stages) if s % pp == self.stage_rank]
        last_stage_rank = (self.num_stages - 1) % pp  # pp - 1: the last stage rank, also when interleaved
        self.last_rank = last_stage_rank * dp + self.replica  # global: the loss sums come from there
        self._pipeline = mesh.pp_group
        self._replicas = mesh.dp_group if dp > 1 else None
        self._tied_group = _tied_group(mesh) if parts.tied else None
        owned = {i for s in self.stage_ids for i in layout[s]}
        has_first, has_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        for i in range(n_layers):
            if i not in owned:
                parts.layers[i] = PassThrough()
        # Tied: the last rank keeps the embedding module (its head's weight), so the weight's name is the
        # embedding's on every pipeline size, as a single process names it.
        if not has_first and not (has_last and parts.tied):
            setattr(parts.base, parts.embed_name, PassThrough())
        if not has_last:
            parts.base.norm = PassThrough()
            setattr(model, parts.head_name, PassThrough())
        # Views share the model's modules (and so its parameters, also those sharding or materializing replace).
        self._stages = [_Stage(_view(model, parts, layout[s], s == 0, s == self.num_stages - 1), s == 0, autocast)
                        for s in self.stage_ids]
        if self.sharded:
            self._shard(model, parts, sorted(owned), shard_options(mesh.fsdp_mesh, device, **fsdp))
        # An empty model: this rank's tensors (shards) only, read from its files (re-tied); offloaded shards live on
        # the CPU, as FSDP2Engine keeps them.
        materialize(model, torch.device("cpu") if fsdp and fsdp.get("cpu_offload") else device)
        if not self.sharded:  # FSDP placed the shards on the mesh's device
            model.to(device)
        self.tied_weight = model.get_input_embeddings().weight if parts.tied and (has_first or has_last) else None

        self.model = self.module = model
        self.optimizer = optimizer_factory(model)
        self.autocast = autocast
        self.has_first, self.has_last = has_first, has_last
        self.n_microbatches = micro_batches
        self._loss: Callable | None = None  # the step's loss on the last stage, set per step
        pipe = [PipelineStage(st, s, self.num_stages, device, group=self._pipeline)
                for st, s in zip(self._stages, self.stage_ids)]
        cls = SCHEDULES[schedule]
        self.schedule = cls(pipe if len(pipe) > 1 else pipe[0], micro_batches, loss_fn=self._schedule_loss, scale_grads=False)

    def _shard(self, model: nn.Module, parts: _Parts, owned: list[int], options: dict) -> None:
        """FSDP2 inside the stages: each owned decoder layer a unit, then each stage (the module torch's schedule
        calls, so its hooks run: gathers before the stage's forward, the no-sync switch and the last reduce) takes
        what is left of it. Sums, not averages, as FSDP2Engine."""
        for i in owned:
            fully_shard(parts.layers[i], **options)
        for stage in self._stages:
            fully_shard(stage, **options)
        sum_gradients(m for stage in self._stages for m in stage.modules())
        head = model.get_output_embeddings()
        if parts.tied and not isinstance(head, PassThrough):
            # The last rank keeps the embedding module for the tied weight's name; its stage (not the first) passes
            # the embedding through, so FSDP replaced the head's weight only: the two are made one Parameter again.
            model.get_input_embeddings().weight = head.weight

    # Every stage of one pipeline reads the same micro-batches; the pipelines are the data-parallel replicas.
    @property
    def data_rank(self) -> int:
        return self.replica

    @property
    def data_world_size(self) -> int:
        return self.replicas

    # ------------------------------------------------------------------ forward and backward

    def _schedule_loss(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self._loss(logits, int(index))

    def _run(self, schedule, micro_batches: list[dict], fn: Callable, **step_kwargs) -> torch.Tensor | None:
        """Push ``micro_batches`` through ``schedule``; ``fn(model, mb) -> (loss, report)`` runs on the last stage.
        Returns the reports' sum on every rank (broadcast from the last stage)."""
        mbs = [{k: t.to(self.device, non_blocking=True) for k, t in mb.items()} for mb in micro_batches]
        reports: dict[int, torch.Tensor] = {}

        def loss(logits: torch.Tensor, i: int) -> torch.Tensor:
            value, reports[i] = fn(_Outputs(logits), mbs[i])
            return value

        self._loss = loss
        # The target is each micro-batch's index: the loss function looks its labels (and sources) up.
        args = (torch.cat([mb["input_ids"] for mb in mbs]),) if self.has_first else ()
        target = torch.arange(len(mbs)) if self.has_last else None
        try:
            step_kwargs["position_ids"] = torch.cat([mb["position_ids"] for mb in mbs])
            schedule(*args, target=target, return_outputs=False, **step_kwargs)
        finally:
            self._loss = None
        total = sum(reports[i] for i in sorted(reports)) if reports else None
        box = [total.cpu() if total is not None else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self._pipeline)
        return None if box[0] is None else box[0].to(self.device)

    def forward_backward(self, micro_batches: list[dict], fn: Callable) -> torch.Tensor:
        if len(micro_batches) != self.n_microbatches:
            raise RuntimeError(f"a pipeline step takes {self.n_microbatches} micro-batches, got {len(micro_batches)}")
        total = self._run(self.schedule.step, micro_batches, fn)
        if self._tied_group is not None and self.tied_weight is not None:
            # The embedding's and the head's shares of the tied weight's gradient, on two ranks: both need the sum.
            # Sharded, both hold the same shard of it (one dp_shard coordinate, the same sizes): their local parts
            # line up.
            grad = self.tied_weight.grad if self.tied_weight.grad is not None else torch.zeros_like(self.tied_weight)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            flat = local.contiguous()
            dist.all_reduce(flat, group=self._tied_group)
            if flat is not local:
                local.copy_(flat)
            self.tied_weight.grad = grad
        if self._replicas is not None and not self.sharded:  # FSDP2 has reduce-scattered them over the shards
            self._sum_over_replicas([p.grad for p in self.model.parameters() if p.grad is not None])
        return total

    def _sum_over_replicas(self, grads: list[torch.Tensor]) -> None:
        """Each gradient summed over the copies of this stage in the other pipelines: one flat all-reduce (every
        copy holds the same parameters, so the lists line up)."""
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._replicas)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def forward_only(self, batches, fn: Callable) -> torch.Tensor | None:
        """Forward through the stages with no backward (evaluation): one forward-only schedule per call."""
        batches = list(batches)  # every rank of the pipeline sees the same, equally shaped batches
        if not batches:
            return None
        pipe = [PipelineStage(st, s, self.num_stages, self.device, group=self._pipeline)
                for st, s in zip(self._stages, self.stage_ids)]
        sched = (ScheduleLoopedBFS(pipe, len(batches), loss_fn=self._schedule_loss, scale_grads=False)
                 if len(pipe) > 1 else ScheduleGPipe(pipe[0], len(batches), loss_fn=self._schedule_loss, scale_grads=False))

        def report(model, batch):
            return torch.zeros(()), fn(model, batch)

        for st in self._stages:
            st.view.eval()
        try:
            with torch.no_grad():
                return self._run(sched.eval, batches, report)
        finally:
            for st in self._stages:
                st.view.train()

    # ------------------------------------------------------------------ sums, norm, state

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the pipelines (data-parallel replicas): every stage of one already holds its sums."""
        if self._replicas is None:
            return t
        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out, group=self._replicas)
        return out

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm over every stage's gradients (a tied weight counted once), clipped on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in params if not (p is self.tied_weight and not self.has_first)]
        # This rank's stages' norm: over their shards (DTensor's reduction over dp_shard), or whole.
        local = grad_norm(counted) if counted else torch.zeros((), device=self.device)
        squares = local.double().pow(2).reshape(1)
        # Summed over the stages; the data ranks already agree (replicas hold the same summed gradients, shards
        # the same full-tensor norm).
        dist.all_reduce(squares, group=self._pipeline)
        total = squares.sqrt().to(torch.float32)[0]
        if max_norm > 0 and params and math.isfinite(total.item()):
            clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def state_dict(self) -> dict:
        model_sd, optim_sd = trainable_state(self.model, self.optimizer)
        for group, names in zip(optim_sd["param_groups"], self._group_names):
            group["params"] = list(names)
        return {"model": model_sd, "optim": optim_sd}

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's weights on rank 0 ({} elsewhere): every stage of the first pipeline sends its tensors
        (the other pipelines hold the same). Sharded stages are first gathered tensor by tensor over their shards
        (every rank of a stage takes part, data rank 0 keeps them)."""
        mine = {}
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if not self.replica:
                mine[k] = full.detach().cpu()
        if self.replica:
            return {}
        gathered = [None] * dist.get_world_size(self._pipeline) if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._pipeline)
        if self.rank:
            return {}
        merged = {k: v for part in gathered for k, v in part.items()}
        if self._tied_keys is not None:  # the two names came from two ranks as two tensors: one again
            head, embed = self._tied_keys
            merged[head] = merged[embed]
        return merged
