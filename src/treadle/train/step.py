"""One optimizer step: micro-batching and exact loss normalization.

The loss of a step is the sum of token cross-entropies over every micro-batch on
every rank, divided by the number of valid label tokens in that whole step.
Each micro-batch therefore backpropagates ``sum_CE(mb) / N_step``, and the
accumulated gradient equals the gradient of one big batch, whatever the split
(a mean of micro-batch means would weight a token by how crowded its micro-batch was).

A loss function returns the loss summed per row ([B]); with a mixture of sources the
rows' sums, grouped by each row's ``source``, give every source's own token-weighted
loss at no extra collective.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence, Union

import torch
from torch import nn

from treadle.data.packed import IGNORE_INDEX, row_cross_entropy  # the data marks "no loss here"; the loss honours it
from treadle.models.chunked_ce import chunked_head, scoring

Batch = dict[str, torch.Tensor]
# A loss function returns the loss of a micro-batch summed per row ([B]; a scalar sum is
# accepted too), optionally with named summed side quantities (a draft run's target loss,
# ...) that are reported, not trained.
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
    by_source: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> (mean loss, label tokens)


def loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed per row ([B]) of a batch whose labels are already shifted."""
    return forward_row_ce(model, batch)[0]


def forward_row_ce(model: nn.Module, batch: Batch, **forward_kwargs) -> tuple[torch.Tensor, object]:
    """The model's forward on ``batch`` and its next-token CE summed per row ([B]); ``forward_kwargs`` go to
    the forward (an MoE's ``output_router_logits``).

    With a chunked LM head (``model.loss_chunk_tokens``) the forward returns each token's cross-entropy in
    place of the logits, which never exist whole.
    """
    head = chunked_head(model)
    with scoring(head, batch["labels"]) if head is not None else contextlib.nullcontext():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **forward_kwargs)
    rows = out.logits.sum(-1) if head is not None else row_cross_entropy(out.logits, batch["labels"])
    return rows, out


def label_tokens(batch: Batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


def _by_source(batch: Batch, per_row: torch.Tensor, num_sources: int) -> torch.Tensor:
    """[num_sources] sums of a per-row quantity, grouped by the rows' source."""
    return torch.zeros(num_sources, dtype=torch.float64, device=per_row.device).index_add_(
        0, batch["source"].to(per_row.device), per_row.detach().double())


def optimizer_step(
    engine,
    micro_batches: list[Batch],
    grad_clip: float,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    loss_fn: Callable[[nn.Module, Batch], LossOutput] = loss_sum,
    sources: Sequence[str] = (),
) -> StepResult:
    """``sources``: the names of the run's sources, when each source's loss is wanted (batches carry ``source``)."""
    S = len(sources)
    # One all-reduce for the denominators, before any backward: every rank scales by the same N.
    local = torch.zeros(1 + S, dtype=torch.float64)
    for mb in micro_batches:
        local[0] += label_tokens(mb)
        if S:
            local[1:] += _by_source(mb, (mb["labels"] != IGNORE_INDEX).sum(-1), S)
    n_tokens, *source_tokens = engine.all_reduce_sum(local).tolist()
    denom = max(n_tokens, 1.0)  # a step with no label tokens contributes zero gradient, not NaN

    def run(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: its loss scaled for backward, and [loss, *side quantities, *per-source loss] sums."""
        with autocast():
            summed, side = split_loss(loss_fn(model, mb))
        per_row = summed if summed.dim() == 1 else None
        summed = summed.sum()
        sums = torch.stack([t.detach().double() for t in (summed, *side.values())])
        if S:
            sums = torch.cat([sums, _by_source(mb, per_row, S) if per_row is not None
                              else torch.full((S,), math.nan, dtype=torch.float64, device=sums.device)])
        names[:] = side
        return summed / denom, sums

    names: list[str] = []  # the side quantities' names (on a pipeline, known where the loss runs: the last stage)
    # The engine runs forward and backward over the micro-batches: in a loop, or through a pipeline's schedule.
    total = engine.forward_backward(micro_batches, run)  # stays on the device
    reduced = engine.all_reduce_sum(total).tolist()  # one collective for all of them
    n_side = len(reduced) - 1 - S
    loss, side_values = reduced[0] / denom, [v / denom for v in reduced[1 : 1 + n_side]]
    by_source = {name: (value / count, int(count)) for name, value, count in zip(sources, reduced[1 + n_side:], source_tokens)
                 if count and math.isfinite(value)}
    grad_norm = float(engine.clip_grad_norm(grad_clip))
    # All ranks must agree, or one rank would step while another skips and the replicas drift.
    applied = engine.all_agree(math.isfinite(loss) and math.isfinite(grad_norm))
    if applied:
        engine.step()
    engine.zero_grad()
    return StepResult(loss=loss, grad_norm=grad_norm, label_tokens=int(n_tokens), applied=applied,
                      metrics=dict(zip(names, side_values)), by_source=by_source)
