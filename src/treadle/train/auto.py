"""``model.dtype`` / ``model.compile`` = ``auto`` resolved for one run (the measuring is ``models/autotune.py``).

What a run can use depends on its engine; rank 0 measures and every rank takes its answer (one choice, or ranks
would run different graphs); the resolved values replace ``auto`` in the run's config, so config.toml records
what ran and a resume runs the same.
"""

from __future__ import annotations

import torch
from torch import nn

from treadle import distributed
from treadle.config import Config
from treadle.errors import UserError
from treadle.models.autotune import choose_compile, choose_dtype, probe
from treadle.models.hf import decoder_layers


def dtype_candidates(cfg: Config, engine: str) -> tuple[str, ...]:
    """The dtypes this run's engine can train in (fp32 first)."""
    found = ["fp32"]
    if not (engine == "deepspeed" and cfg.distributed.zero_stage == 0):  # DeepSpeed refuses bf16 at stage 0
        found.append("bf16")
    if engine == "local" and not cfg.draft.kind:  # the one engine that keeps fp32 masters beside bf16 weights
        found.append("bf16-weights")
    return tuple(found)


def check_dtype(cfg: Config, engine: str) -> None:
    if cfg.model.dtype not in ("auto", *dtype_candidates(cfg, engine)):
        what = "a draft run" if cfg.draft.kind else f"distributed.engine {engine!r}"
        raise UserError(f"model.dtype = {cfg.model.dtype!r} is not available to {what} (bf16 weights with fp32 masters "
                        "are the local engine's, for a model run; FSDP2's bf16 already computes in bf16 weights over "
                        f"fp32 shards); accepted: {', '.join(('auto', *dtype_candidates(cfg, engine)))}")


def resolve_auto(cfg: Config, model: nn.Module, engine: str, device: torch.device) -> tuple[Config, list[str]]:
    """``cfg`` with ``auto`` replaced by the choices for this run, and a line per choice saying why."""
    check_dtype(cfg, engine)
    m, t = cfg.model, cfg.train
    if m.dtype != "auto" and m.compile != "auto":
        return cfg, []

    def decide() -> list[tuple[str, str | bool, str]]:
        rows, seq_len = t.micro_batch_size, cfg.data.seq_len
        decided = []
        if m.dtype == "auto":
            choice, layer_s, steady = choose_dtype(model, rows, seq_len, device, dtype_candidates(cfg, engine))
            decided.append(("dtype", choice.value, choice.why))
        else:
            seconds, _, steady = probe(model, rows, seq_len, device, (m.dtype,))
            layer_s = seconds[m.dtype]
        if m.compile == "auto":  # a draft run compiles its one block; the frozen target stays eager
            layers = 1 if cfg.draft.kind else len(decoder_layers(model))
            choice = choose_compile(layer_s, layers, t.max_steps * t.grad_accum_steps, device, steady)
            decided.append(("compile", choice.value, choice.why))
        return decided

    decided = distributed.broadcast_object(distributed.on_main(decide))
    cfg = cfg.model_copy(deep=True)
    lines = []
    for key, value, why in decided:
        setattr(cfg.model, key, value)
        shown = str(value).lower() if isinstance(value, bool) else value
        lines.append(f"treadle: model.{key} = auto -> {shown}: {why}")
    return cfg, lines
