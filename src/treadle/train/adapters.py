"""``[lora]`` in a run: the adapters put on the model a run trains (a target, or the base draft of ``draft.init``),
the identity of the base the checkpoints name, and the start line that says so (the adapters themselves:
models/lora.py)."""

from __future__ import annotations

import torch

from treadle.config import Config
from treadle.errors import UserError
from treadle.models.lora import Adapters, apply_lora, base_identity, bitsandbytes_backend, quantize_base


def lora_adapters(cfg: Config, model: torch.nn.Module, meta: dict) -> Adapters:
    """``[lora]``: PEFT's adapters injected into ``model``, the base frozen; the checkpoint's meta names the base
    (its identity), so a resume against another base is refused (checkpoint/compat.py)."""
    identity = base_identity(cfg.model, model.config, cfg.train.seed)  # of the base's full-precision weights
    meta["base_fingerprint"], meta["base"] = identity["fingerprint"], identity
    if cfg.lora.quantize == "4bit":  # QLoRA: the frozen base's decoder linears held in NF4 by bitsandbytes
        why = bitsandbytes_backend(torch.device("cpu") if cfg.train.device == "auto" and not torch.cuda.is_available()
                                   else torch.device("cuda" if cfg.train.device == "auto" else cfg.train.device))
        if why:
            raise UserError(f"lora.quantize = '4bit' cannot hold the base in 4-bit: {why}; accepted: lora.quantize = "
                            "'none'")
        quantize_base(model)
    return apply_lora(model, cfg.lora, identity)


def describe_adapters(adapters: Adapters | None) -> str | None:
    """The run's start line about its adapters (None: no adapters)."""
    if adapters is None:
        return None
    c = adapters.peft_config
    saved = f", {', '.join(sorted(c.modules_to_save))} trained in full" if c.modules_to_save else ""
    # PEFT puts an MoE's fused expert projections (3-D parameters in transformers 5) under target_parameters
    experts = f", experts' {', '.join(sorted(c.target_parameters))}" if getattr(c, "target_parameters", None) else ""
    return (f"treadle: LoRA rank {c.r}, alpha {c.lora_alpha:g} on {', '.join(sorted(c.target_modules))}{experts}"
            f"{saved}; the base is frozen")


def draft_lora_adapters(cfg: Config, model: torch.nn.Module, meta: dict) -> Adapters:
    """``[lora]`` in a draft run: PEFT's adapters on the draft module only (``model.draft_model``, the base draft
    of ``draft.init``), frozen with the target; the checkpoint's meta names the base draft (kind, files, target),
    so a resume against another base draft is refused (checkpoint/compat.py)."""
    from treadle.drafts.kind import init_dir
    from treadle.models.lora import draft_base_identity

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise UserError(f"lora.rank in a {cfg.draft.kind} draft run under a launcher of "
                        f"{torch.distributed.get_world_size()} processes: adapters on a draft are built and tested "
                        "in one process only (a draft is small: its adapters train fast on one device); accepted: "
                        "one process (no launcher), or lora.rank unset")
    identity = draft_base_identity(cfg.draft.kind, init_dir(cfg.draft.init), model.target.config)
    meta["base_fingerprint"], meta["base"] = identity["fingerprint"], identity
    return apply_lora(model.draft_model, cfg.lora, identity, prefix="draft_model.")
