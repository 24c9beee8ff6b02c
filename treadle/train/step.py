"""One optimizer step: micro-batching and exact loss normalization.

The loss of a step is the sum of token cross-entropies over every micro-batch on
every rank, divided by the number of valid label tokens in that whole step.
Each micro-batch therefore backpropagates ``sum_CE(mb) / N_step``, and the
accumulated gradient equals the gradient of one big batch, whatever the split
(a mean of micro-batch means would weight a token by how crowded its micro-batch was).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Union

import torch
import torch.nn.functional as F
from torch import nn

from treadle.data.packed import IGNORE_INDEX  # the data marks "no loss here"; the loss honours it

Batch = dict[str, torch.Tensor]
# A loss function returns the summed loss of a micro-batch, optionally with named
# summed side quantities (a draft run's target loss, ...) that are reported, not trained.
LossOutput = Union[torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]]]


def split_loss(out: LossOutput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return out if isinstance(out, tuple) else (out, {})


@dataclass
class StepResult:
    loss: float  # token-weighted mean CE of the step, over all ranks
    grad_norm: float  # before clipping
    label_tokens: int  # valid label tokens in the step, over all ranks
    applied: bool  # False when a non-finite loss or gradient made us skip the update
    metrics: dict[str, float] = field(default_factory=dict)  # side quantities, normalized like the loss


def loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed next-token cross-entropy of a batch whose labels are already shifted."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"]
    # fp32 for the softmax: under bf16 autocast the logits arrive in bf16.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def label_tokens(batch: Batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


def count_label_tokens(micro_batches: list[Batch]) -> int:
    return sum(int(label_tokens(mb)) for mb in micro_batches)


def optimizer_step(
    engine,
    micro_batches: list[Batch],
    grad_clip: float,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    loss_fn: Callable[[nn.Module, Batch], LossOutput] = loss_sum,
) -> StepResult:
    # One all-reduce for the denominator, before any backward: every rank scales by the same N.
    local = torch.tensor(float(count_label_tokens(micro_batches)), dtype=torch.float64)
    n_tokens = engine.all_reduce_sum(local).item()
    denom = max(n_tokens, 1.0)  # a step with no label tokens contributes zero gradient, not NaN

    total: torch.Tensor | None = None  # [loss, *side quantities], summed; stays on the device (no sync per micro-batch)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(engine.device, non_blocking=True) for k, v in mb.items()}
        with engine.no_sync(last=i == len(micro_batches) - 1):
            with autocast():
                summed, side = split_loss(loss_fn(engine.model, mb))
            engine.backward(summed / denom)
        sums = torch.stack([t.detach().double() for t in (summed, *side.values())])
        total = sums if total is None else total + sums

    loss, *side_values = (engine.all_reduce_sum(total) / denom).tolist()  # one collective for all of them
    grad_norm = float(engine.clip_grad_norm(grad_clip))
    # All ranks must agree, or one rank would step while another skips and the replicas drift.
    applied = engine.all_agree(math.isfinite(loss) and math.isfinite(grad_norm))
    if applied:
        engine.step()
    engine.zero_grad()
    return StepResult(loss=loss, grad_norm=grad_norm, label_tokens=int(n_tokens), applied=applied,
                      metrics=dict(zip(side, side_values)))
