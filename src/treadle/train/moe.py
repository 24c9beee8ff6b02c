"""What an MoE run adds to the step: the router losses in the objective, expert-load statistics in the metrics.

The step divides every micro-batch's summed loss by N, the step's label tokens over all ranks. The router terms
enter that sum as token sums, so they are normalized by the same N:

- z-loss: ``router_z_loss_coef * sum over labelled positions of logsumexp(router logits)^2`` (averaged over the
  MoE layers). A sum of per-token terms: exact under any GA and world size, like the CE.
- load balancing: ``router_aux_loss_coef * aux(micro-batch) * n(micro-batch)``, n its label tokens. aux is a
  product of two means over a batch (HF's definition), not a token sum: the step's value is the label-token-
  weighted mean of its micro-batches' aux. It does not depend on how the micro-batches are spread over GA and
  ranks (GA=2 on 1 rank = GA=1 on 2 ranks), but it does depend on the micro-batch size: GA=2 x 2 rows is not
  GA=1 x 4 rows, as for HF, KempnerForge (aux / GA) and Megatron's default micro-batch-level loss. A step-wide
  aux would need every micro-batch's expert counts before the first backward (a second forward).

Each row's share: its own z sum, and aux * (its label tokens), so per-source losses see the router terms too.
Logged, unscaled by their coefficients: ``router_aux_loss`` and ``router_z_loss``; ``loss`` is the objective
(CE + coef * each), as HF's ``out.loss`` with labels. Evaluation reports the CE alone as ``eval_loss`` (so
``eval_ppl`` is a perplexity) and the router losses beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from treadle.config import ModelConfig
from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError
from treadle.models.moe import RouterLosses, RouterSpec, router_losses, router_spec
from treadle.train.callbacks import Callback, is_log_step
from treadle.train.step import Batch, StepResult, forward_row_ce

if TYPE_CHECKING:
    from treadle.train.trainer import Trainer


def router_objective(model: nn.Module, cfg: ModelConfig) -> RouterObjective | None:
    """The loss of an MoE model with the configured coefficients (unset aux: the HF config's own), or None for a
    model without a router, whose router keys must then be off."""
    spec = router_spec(model)
    if spec is None:
        refuse_router_keys(cfg, f"the model ({model.config.model_type}) has no experts" if not hasattr(
            model.config, "output_router_logits") else f"{type(model).__name__} does not name its num_experts and "
            "num_experts_per_tok (treadle reads its router from them)")
        return None
    aux = spec.aux_loss_coef if cfg.router_aux_loss_coef is None else cfg.router_aux_loss_coef
    return RouterObjective(spec, aux, cfg.router_z_loss_coef)


def refuse_router_keys(cfg: ModelConfig, why: str) -> None:
    """A router coefficient set for a model without a router would silently do nothing: refused, naming the key."""
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(cfg, key)
        if value:
            raise UserError(f"model.{key} = {value} but {why}; accepted: 0 or unset, or an MoE model "
                            "(e.g. model.preset = \"tiny-moe\", a Mixtral / Qwen-MoE / OLMoE model.path)")


class RouterObjective:
    """The step's loss function for an HF MoE model: CE plus the router losses, and the step's expert counts."""

    eval_label = "cross-entropy per label token"

    def __init__(self, spec: RouterSpec, aux_coef: float, z_coef: float):
        self.spec, self.aux_coef, self.z_coef = spec, aux_coef, z_coef
        terms = [(aux_coef, "router aux loss"), (z_coef, "router z-loss")]
        self.label = " + ".join(["cross-entropy", *(f"{c:g} x {what}" for c, what in terms if c)]) + " per label token"
        self.counts: torch.Tensor | None = None  # [layers, E] of the micro-batches trained since the last take

    def _forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, RouterLosses, torch.Tensor]:
        ce, out = forward_row_ce(model, batch, output_router_logits=True)  # chunked CE too, when the head is
        labelled = batch["labels"] != IGNORE_INDEX
        routers = router_losses(out.router_logits, labelled, self.spec)
        return ce, routers, labelled.sum(-1)

    def __call__(self, model: nn.Module, batch: Batch):
        ce, r, tokens = self._forward(model, batch)
        self.counts = r.counts if self.counts is None else self.counts + r.counts
        rows = ce
        if self.aux_coef:  # a zero coefficient adds nothing at all (not 0 * a value that might be NaN)
            rows = rows + self.aux_coef * r.aux * tokens
        if self.z_coef:
            rows = rows + self.z_coef * r.z_rows
        return rows, self._side(r, tokens)

    def evaluate(self, model: nn.Module, batch: Batch):
        ce, r, tokens = self._forward(model, batch)
        return ce, self._side(r, tokens)

    @staticmethod
    def _side(r: RouterLosses, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        # Sums that the step divides by N: aux weighted by the micro-batch's label tokens, z summed per token.
        return {"router_aux_loss": r.aux * tokens.sum(), "router_z_loss": r.z_rows.sum()}

    def take_counts(self) -> torch.Tensor | None:
        counts, self.counts = self.counts, None
        return counts


class ExpertLoadCallback(Callback):
    """After each step: expert counts summed over micro-batches and ranks (one small all-reduce), into the metrics.

    ``expert_tokens``: per expert, the labelled tokens routed to it in the step (top-k assignments, summed over the
    MoE layers); ``expert_load_max_mean``: the most loaded expert's count over the mean count, in the worst layer
    (1 = balanced, E / top_k = every token in top_k experts). Runs before the metrics callback, which logs them;
    on the steps it does not log, the counts are dropped without the all-reduce.
    """

    def __init__(self, objective: RouterObjective, log_every: int):
        self.objective = objective
        self.log_every = log_every

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        counts = self.objective.take_counts()
        if counts is None or not is_log_step(trainer.state.step, self.log_every, trainer.max_steps):
            return
        counts = trainer.engine.all_reduce_sum(counts.double()).cpu()
        mean = counts.mean(-1).clamp_min(1e-9)
        result.metrics["expert_load_max_mean"] = float((counts.max(-1).values / mean).max())
        result.metrics["expert_tokens"] = [int(c) for c in counts.sum(0).round().tolist()]
