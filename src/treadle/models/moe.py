"""Mixture-of-experts routers of Hugging Face models: what they are, and their losses from the router logits.

A supported MoE model is an HF ``*ForCausalLM`` whose config has ``output_router_logits`` and which names its
``num_experts`` and ``num_experts_per_tok`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ... in transformers 5.23).
Called with ``output_router_logits=True`` it returns ``router_logits``: one raw ``[B*L, E]`` tensor per MoE layer
(recorded by hooks on the router, before the softmax), from which everything here is computed.

Both losses are taken over the positions that carry a label (``mask``): the tokens the cross-entropy counts, so
padding of packed SFT rows never counts, and the step can normalize the router losses by the same token count N as
the CE. Pre-training rows have no padding; the positions left out there are the last token of each document
(when ``data.mask_cross_doc``) and, in SFT, the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    aux_loss_coef: float  # the HF config's own coefficient (0 when it has none)


def router_spec(model: nn.Module) -> RouterSpec | None:
    """The model's routing, or None for a model without experts (or one whose router treadle does not know)."""
    if not hasattr(getattr(model, "config", None), "output_router_logits"):
        return None
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not (isinstance(experts, int) and isinstance(top_k, int)):
        return None
    return RouterSpec(experts, top_k, float(getattr(model.config, "router_aux_loss_coef", None) or 0.0))


@dataclass
class RouterLosses:
    aux: torch.Tensor  # scalar: the load-balancing loss of this batch (differentiable)
    z_rows: torch.Tensor  # [B]: per row, the sum over its labelled positions of logsumexp^2, averaged over layers
    counts: torch.Tensor  # [layers, E]: top-k assignments of labelled positions per expert (no grad)


def router_losses(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor, spec: RouterSpec) -> RouterLosses:
    """Load-balancing loss, z-loss and expert counts of one batch over the positions where ``mask`` ([B, L]) is true.

    aux = E * sum_e f_e * P_e with f_e the share of top-k assignments and P_e the mean router probability of
    expert e, both pooled over the MoE layers: exactly transformers' ``load_balancing_loss_func`` with
    ``attention_mask=mask`` (tests compare them), except that a batch without labelled positions gives 0, not NaN.
    The z-loss (ST-MoE; Megatron's ``z_loss_func``) is logsumexp(logits)^2, a per-token quantity: returned per row.
    """
    B, L = mask.shape
    flat = mask.reshape(-1).to(torch.float32)
    per_choice, per_token = flat.repeat_interleave(spec.top_k), flat.unsqueeze(-1)  # the same for every layer
    layers = len(router_logits)
    counts, prob_sum, z_rows = [], 0.0, 0.0
    for logits in router_logits:
        logits = logits.float()  # bf16 under autocast: the softmax and logsumexp in fp32
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, spec.top_k, dim=-1).indices
        counts.append(torch.zeros(spec.num_experts, device=logits.device).scatter_add_(
            0, chosen.reshape(-1), per_choice))
        prob_sum = prob_sum + (probs * per_token).sum(0)
        z_rows = z_rows + (torch.logsumexp(logits, dim=-1).square() * flat).view(B, L).sum(-1)
    counts = torch.stack(counts)
    rows = flat.sum() * layers
    aux = spec.num_experts * (counts.sum(0) / rows.clamp_min(1) * prob_sum / rows.clamp_min(1)).sum()
    return RouterLosses(aux=aux, z_rows=z_rows / layers, counts=counts.detach())
