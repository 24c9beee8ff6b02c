"""How a model is wrapped and stepped: one interface (``LocalEngine``'s), four engines.

``build_engine`` is the only place that knows which engine runs; the loop calls the
interface and never branches on it (DESIGN.md).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from treadle.config import Config
from treadle.distributed import DistInfo
from treadle.engine.local import LocalEngine
from treadle.errors import UserError

__all__ = ["Loading", "LocalEngine", "build_engine", "model_loading", "read_deepspeed_config", "resolve_engine"]

ENGINES = ("local", "ddp", "fsdp2", "deepspeed")


def resolve_engine(name: str, info: DistInfo, pipeline_parallel: int = 1) -> str:
    """``auto`` -> local for one process, fsdp2 under a launcher (pipeline with pipeline stages); refuse
    combinations that cannot work."""
    if pipeline_parallel > 1:
        from treadle.engine.pipeline import check_layout

        if name != "auto":
            raise UserError(f"distributed.engine = {name!r} with pipeline_parallel = {pipeline_parallel}: the stages "
                            "are the engine (no FSDP2/DDP/DeepSpeed inside them yet); accepted: distributed.engine = auto")
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


@dataclass
class Loading:
    """How this engine wants a model it reads from disk (``model.path``, a draft's target) built.

    ``empty``: on the meta device; the engine allocates and reads each rank's shards after sharding (FSDP2).
    ``context``: models read from disk inside it are built partitioned (ZeRO-3). Neither: whole, on every rank.
    """

    empty: bool = False
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def model_loading(name: str, cfg: Config, device: torch.device, world_size: int,
                  deepspeed_json: dict | None = None) -> Loading:
    if cfg.model.path is None and cfg.draft.kind is None:
        return Loading()  # a preset is built whole and seeded: the same weights under every engine
    if name == "fsdp2":
        return Loading(empty=True)
    if name == "deepspeed":
        from treadle.engine.deepspeed import zero3_loading

        from treadle.engine.deepspeed import deepspeed_config

        config = deepspeed_config(world_size=world_size, **_deepspeed_settings(cfg, deepspeed_json))
        return Loading(context=lambda: zero3_loading(config, device))
    return Loading()


def _deepspeed_settings(cfg: Config, deepspeed_json: dict | None) -> dict:
    """The config's DeepSpeed settings: ``DeepSpeedEngine``'s keywords, and with the world size ``deepspeed_config``'s."""
    d, t = cfg.distributed, cfg.train
    return dict(zero_stage=d.zero_stage, micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps,
                grad_clip=t.grad_clip, bf16=cfg.model.dtype == "bf16", offload=d.cpu_offload, user_config=deepspeed_json)


def build_engine(name: str, model: nn.Module, cfg: Config, device: torch.device, deepspeed_json: dict | None = None):
    """Move ``model`` (fp32, identical on every rank) to ``device``, wrap it and build its optimizer in the engine.

    Parts of ``model`` may be empty (on the meta device, ``Loading.empty``): FSDP2 reads its shards after sharding,
    the others read it whole first.
    """
    from treadle.engine.optim import build_optimizer
    from treadle.models.sharded_load import materialize

    d = cfg.distributed
    if name != "fsdp2":
        materialize(model, device)
        model.to(device)
    if name == "pipeline":
        from treadle.engine.pipeline import PipelineEngine

        bf16 = cfg.model.dtype == "bf16"
        return PipelineEngine(model, lambda m: build_optimizer(m, cfg), device, pipeline_parallel=d.pipeline_parallel,
                              schedule=d.pipeline_schedule, micro_batches=cfg.train.grad_accum_steps,
                              autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16))
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

        bf16 = cfg.model.dtype == "bf16"
        return FSDP2Engine(model, lambda m: build_optimizer(m, cfg), device,
                           mp_param_dtype=torch.bfloat16 if bf16 else None,
                           reduce_dtype=torch.bfloat16 if d.reduce_dtype == "bf16" else torch.float32,
                           reshard_after_forward=d.reshard_after_forward, cpu_offload=d.cpu_offload)
    if name == "deepspeed":
        from treadle.engine.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, build_optimizer(model, cfg), device, **_deepspeed_settings(cfg, deepspeed_json))
    raise UserError(f"distributed.engine = {name!r} is unknown; accepted: auto, {', '.join(ENGINES)}")
