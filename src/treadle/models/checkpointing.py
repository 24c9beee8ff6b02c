"""Activation checkpointing per decoder layer (``model.activation_checkpointing``).

A checkpointed layer keeps only its input in forward and runs again in backward. Built on maintained APIs:
transformers' ``activation_checkpointing_enable`` (5.x; ``gradient_checkpointing_enable`` is its deprecated alias)
with torch's non-reentrant ``checkpoint``, and for ``selective`` torch's ``create_selective_checkpoint_contexts``
with the list of ops whose outputs are kept (everything else is recomputed).

It is applied before ``torch.compile`` and before the engine wraps the model. Order matters little for
correctness because transformers checkpoints a layer's ``forward``, not ``__call__``: FSDP2's / ZeRO-3's module
hooks stay outside the recomputation, and an in-place ``Module.compile()`` (which wraps ``__call__``) compiles the
checkpoint with the layer. Parameters and their names are untouched: checkpoints load with or without it.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import PreTrainedModel

from treadle.config import ModelConfig
from treadle.errors import UserError

# selective's default: the outputs of the matmuls and of attention are kept (the expensive ops); norms,
# activations, RoPE and elementwise ops are recomputed. torch's own compute-intensive list (in a private
# module) names only the CUDA attention kernels: CPU sdpa runs _scaled_dot_product_flash_attention_for_cpu,
# which would be recomputed, so it is listed here.
DEFAULT_SAVE_OPS = (
    "mm", "addmm", "bmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)


def save_ops(names: list[str] | tuple[str, ...]) -> list[torch._ops.OpOverload]:
    """Every overload of each named aten op ('mm' or 'aten.mm'); an unknown name is one UserError."""
    ops = []
    for name in names:
        packet = getattr(torch.ops.aten, name.removeprefix("aten."), None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise UserError(f"model.activation_checkpointing_save_ops: {name!r} is not an aten op; accepted: names of "
                            f"torch.ops.aten ops, e.g. {', '.join(DEFAULT_SAVE_OPS[:3])}; [] = {list(DEFAULT_SAVE_OPS)}")
        ops += [getattr(packet, overload) for overload in packet.overloads()]
    return ops


def checkpoint_kwargs(cfg: ModelConfig) -> dict | None:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint``; None when checkpointing is off."""
    if cfg.activation_checkpointing == "none":
        return None
    kwargs: dict = {"use_reentrant": False}  # the reentrant variant is deprecated and ignores selective policies
    if cfg.activation_checkpointing == "selective":
        ops = save_ops(cfg.activation_checkpointing_save_ops or DEFAULT_SAVE_OPS)
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, ops)
    return kwargs


def apply_activation_checkpointing(model: nn.Module, cfg: ModelConfig) -> None:
    """Checkpoint every ``activation_checkpointing_every``-th decoder layer of ``model`` as ``cfg`` says.

    ``model`` is a Hugging Face model, or a treadle block with a ``checkpoint_kwargs`` attribute (the GLIDE
    draft: one layer, so it is checkpointed whole whatever the stride).
    """
    kwargs = checkpoint_kwargs(cfg)
    if kwargs is None:
        return
    if isinstance(model, PreTrainedModel):
        if not model.supports_gradient_checkpointing:
            raise UserError(f"model.activation_checkpointing = {cfg.activation_checkpointing!r}: "
                            f"{type(model).__name__} does not support activation checkpointing; accepted: 'none'")
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                                  every_n_layers=cfg.activation_checkpointing_every)
        else:  # the same call under its older name (transformers < 5.23 has no activation_checkpointing_enable)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs,
                                                every_n_layers=cfg.activation_checkpointing_every)
    elif hasattr(model, "checkpoint_kwargs"):
        model.checkpoint_kwargs = kwargs
    else:
        raise UserError(f"model.activation_checkpointing = {cfg.activation_checkpointing!r}: {type(model).__name__} "
                        "has no decoder layers treadle can checkpoint; accepted: 'none'")
