"""How a model is wrapped and stepped: one interface (``LocalEngine``'s), four engines.

``build_engine`` is the only place that knows which engine runs; the loop calls the
interface and never branches on it (DESIGN.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treadle import compat
from treadle.config import Config
from treadle.distributed import DistInfo
from treadle.engine.local import LocalEngine
from treadle.errors import UserError

__all__ = ["LocalEngine", "build_engine", "builds_empty", "read_deepspeed_config", "resolve_engine"]

ENGINES = ("local", "ddp", "fsdp2", "deepspeed")


def resolve_engine(name: str, info: DistInfo, pipeline_parallel: int = 1, draft: bool = False) -> str:
    """``auto`` -> local for one process, fsdp2 under a launcher (pipeline with pipeline stages: ``auto`` or
    ``fsdp2`` say how the stages' data ranks work, ``build_engine``); refuse combinations that cannot work
    (``draft``: a draft run, whose frozen target FSDP2 shards beside the draft)."""
    resolved = _resolve(name, info, pipeline_parallel)
    if resolved == "fsdp2" and draft and not compat.FSDP2_TRAINS_DRAFTS:
        raise UserError(f"distributed.engine = {name!r} (fsdp2) for a draft run needs torch >= 2.13: under torch "
                        f"{torch.__version__}'s FSDP2 the draft beside a frozen target fails in backward or is not "
                        "updated; accepted: distributed.engine = 'deepspeed', or torch 2.13 to 2.15")
    return resolved


def _resolve(name: str, info: DistInfo, pipeline_parallel: int) -> str:
    if pipeline_parallel > 1:
        from treadle.engine.pipeline import check_layout

        if name not in ("auto", "fsdp2"):
            raise UserError(f"distributed.engine = {name!r} with pipeline_parallel = {pipeline_parallel}: the stages "
                            "run on torch's pipeline schedules; accepted: distributed.engine = auto (each stage whole "
                            "on its data-parallel ranks, gradients summed as DDP does) or fsdp2 (each stage sharded "
                            "over them)")
        check_layout(pipeline_parallel, info.world_size)
        return "pipeline"
    if name == "auto":
        return "fsdp2" if info.distributed else "local"
    if name == "local" and info.world_size > 1:
        raise UserError(f"distributed.engine = 'local' runs one process, but this launch has {info.world_size}; "
                        "accepted here: auto, ddp, fsdp2, deepspeed")
    if name != "local" and not info.distributed:
        launcher = "deepspeed --num_gpus N --module" if name == "deepspeed" else "torchrun --nproc_per_node N -m"
        raise UserError(f"distributed.engine = {name!r} needs a process group: launch with "
                        f"'{launcher} treadle train ...' (RANK/WORLD_SIZE unset here); accepted without one: auto, local")
    return name


def read_deepspeed_config(path: str | None) -> dict | None:
    """The user's DeepSpeed JSON (keys override the generated ones), checked before anything is written."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"distributed.deepspeed_config = {path!r} does not exist; accepted: a DeepSpeed JSON file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"distributed.deepspeed_config = {path!r} is not readable JSON ({str(exc).splitlines()[0]}); "
                        "accepted: a DeepSpeed JSON object") from None
    if not isinstance(data, dict):
        raise UserError(f"distributed.deepspeed_config = {path!r} holds a {type(data).__name__}; accepted: a JSON object")
    return data


def builds_empty(name: str, cfg: Config, world_size: int, deepspeed_json: dict | None = None) -> bool:
    """Whether a model this run reads from disk (``model.path``, a draft's target) is built on the meta device, for
    ``build_engine`` to allocate and read as the engine partitions it (FSDP2: each rank its shards, after sharding;
    a pipeline: each rank its stages, after the split; ZeRO-3: module by module). Otherwise it is read whole, on
    every rank."""
    if cfg.model.path is None and not cfg.draft.frozen_target:
        return False
    if cfg.lora.rank is not None:  # PEFT injects its layers into real modules, and the adapters are in no file
        return False
    if cfg.distributed.tensor_parallel > 1:  # read whole, then split: the shard-on-read path knows 1-D shards only
        return False  # a preset is built whole and seeded: the same weights under every engine
    return name in ("fsdp2", "pipeline") or (name == "deepspeed" and _zero3(cfg, deepspeed_json, world_size) is not None)


def _zero3(cfg: Config, deepspeed_json: dict | None, world_size: int) -> dict | None:
    """The DeepSpeed config when it partitions parameters (ZeRO stage 3, the user's JSON included), else None."""
    from treadle.engine.deepspeed import deepspeed_config

    config = deepspeed_config(world_size=world_size, **_deepspeed_settings(cfg, deepspeed_json))
    return config if config.get("zero_optimization", {}).get("stage") == 3 else None


def _deepspeed_settings(cfg: Config, deepspeed_json: dict | None) -> dict:
    """The config's DeepSpeed settings: ``DeepSpeedEngine``'s keywords, and with the world size ``deepspeed_config``'s."""
    d, t = cfg.distributed, cfg.train
    return dict(zero_stage=d.zero_stage, micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps,
                grad_clip=t.grad_clip, bf16=cfg.model.dtype == "bf16", offload=d.cpu_offload, user_config=deepspeed_json)


def build_engine(name: str, model: nn.Module, cfg: Config, device: torch.device, deepspeed_json: dict | None = None,
                 mesh=None):
    """Move ``model`` (fp32, identical on every rank) to ``device``, wrap it and build its optimizer in the engine.

    Parts of ``model`` may be empty (on the meta device, ``builds_empty``): FSDP2 reads its shards after sharding,
    a pipeline its stages after the split, ZeRO-3 reads and partitions it module by module, the others read it
    whole first. ``mesh`` (engine/mesh.py): the launch's axes; FSDP2 takes its shard / replicate dims, the
    tensor-parallel dim and the group its sums go over from it (None: FSDP2 over every rank).
    """
    from treadle.engine.optim import build_optimizer
    from treadle.models.sharded_load import is_empty, materialize, materialize_by_module

    d = cfg.distributed
    if name == "deepspeed" and is_empty(model):  # built empty for ZeRO-3 only (builds_empty)
        from treadle.engine.deepspeed import zero3_partitioner

        zero3 = _zero3(cfg, deepspeed_json, torch.distributed.get_world_size())
        materialize_by_module(model, device, zero3_partitioner(zero3, device), read=torch.distributed.get_rank() == 0)
    elif name not in ("fsdp2", "pipeline"):  # those two materialize what each rank keeps, once it is known
        materialize(model, device)
    if name not in ("fsdp2", "pipeline"):
        model.to(device)
    if name == "pipeline":
        from treadle.engine.pipeline import PipelineEngine

        bf16 = cfg.model.dtype == "bf16"
        # engine = fsdp2: FSDP2 inside each stage. Its parameters stay fp32 (bf16 runs under the stages' autocast,
        # as without FSDP); the reduction dtype, the reshard and the offload are FSDP2Engine's settings.
        fsdp = (dict(reduce_dtype=torch.bfloat16 if d.reduce_dtype == "bf16" else torch.float32,
                     reshard_after_forward=d.reshard_after_forward, cpu_offload=d.cpu_offload)
                if d.engine == "fsdp2" else None)
        return PipelineEngine(model, lambda m: build_optimizer(m, cfg), device, pipeline_parallel=d.pipeline_parallel,
                              schedule=d.pipeline_schedule, micro_batches=cfg.train.grad_accum_steps,
                              autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
                              mesh=mesh, fsdp=fsdp)
    if name == "local" and cfg.model.dtype == "bf16-weights":
        from treadle.engine.bf16_weights import Bf16WeightsEngine

        return Bf16WeightsEngine(model, build_optimizer(model, cfg), device)
    if name == "local":
        return LocalEngine(model, build_optimizer(model, cfg), device)
    if name == "ddp":
        from treadle.engine.ddp import DDPEngine

        return DDPEngine(model, build_optimizer(model, cfg), device)
    if name == "fsdp2":
        from treadle.engine.fsdp2 import FSDP2Engine

        bf16 = cfg.model.dtype in ("bf16", "fp8")  # fp8: torchao's float8 layers take the bf16 weights (torchtitan)
        return FSDP2Engine(model, lambda m: build_optimizer(m, cfg), device,
                           mp_param_dtype=torch.bfloat16 if bf16 else None,
                           reduce_dtype=torch.bfloat16 if d.reduce_dtype == "bf16" else torch.float32,
                           reshard_after_forward=d.reshard_after_forward, cpu_offload=d.cpu_offload,
                           whole_root=cfg.draft.beside,
                           **(dict(mesh=mesh.fsdp_mesh, tp_mesh=mesh.tp_mesh, loss_group=mesh.loss_group)
                              if mesh is not None else {}))
    if name == "deepspeed":
        from treadle.engine.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, build_optimizer(model, cfg), device, **_deepspeed_settings(cfg, deepspeed_json))
    raise UserError(f"distributed.engine = {name!r} is unknown; accepted: auto, {', '.join(ENGINES)}")
