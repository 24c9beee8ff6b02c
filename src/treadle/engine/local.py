"""The single-process engine: the reference every distributed engine must match.

The loop talks only to this interface (DESIGN.md): ``no_sync``, ``backward``,
``clip_grad_norm``, ``step``, ``zero_grad``, ``all_reduce_sum``, ``state_dict`` /
``load_state_dict`` and ``export_state_dict``. DDP / FSDP2 / DeepSpeed engines
implement the same methods, so the loop never branches on the engine.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from treadle import distributed


class LocalEngine:
    state_is_partial = False  # a rank's state dict holds every trainable tensor (sharded or whole)
    rank = 0
    world_size = 1
    checkpoint_format = "dcp"  # the checkpoint manager saves state_dict() with DCP (DeepSpeed writes its own)
    # What ``backward`` multiplies the loss by before it reaches autograd (the engine divides it out of its own
    # gradients; a module outside it, a draft beside the model trained jointly, divides it out itself).
    loss_multiplier = 1

    @property
    def data_rank(self) -> int:
        """Which share of each step's data this rank reads (ranks of one pipeline read the same)."""
        return self.rank

    @property
    def data_world_size(self) -> int:
        """How many shares each step's data is split into (data-parallel replicas)."""
        return self.world_size

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model = model  # what the loop calls forward on (a wrapper, on other engines)
        self.module = model  # the model itself, for evaluations that call its methods
        self.optimizer = optimizer
        self.device = device

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        # One process: there is no gradient communication to defer.
        yield

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_agree(self, ok: bool) -> bool:
        """Every rank takes the same decision (true only if true everywhere)."""
        return ok

    def any_rank(self, flag: bool) -> bool:
        """True everywhere if true on any rank (a signal seen by one rank stops all)."""
        return flag

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def forward_backward(self, micro_batches: list[dict], fn: Callable) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; ``fn(model, mb) -> (loss, report)`` gives the loss
        to backpropagate and a tensor of sums to report. Returns the reports' sum.

        One micro-batch after another, gradients accumulating (communicated once, on the last); a pipeline
        engine hands them to its schedule instead.
        """
        total = None
        for i, mb in enumerate(micro_batches):
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            with self.no_sync(last=i == len(micro_batches) - 1):
                loss, report = fn(self.model, mb)
                self.backward(loss)
            total = report if total is None else total + report
        return total

    def forward_only(self, batches: Iterable[dict], fn: Callable) -> torch.Tensor | None:
        """The sum of ``fn(model, batch)`` (a tensor of sums) over ``batches``, without gradients (evaluation)."""
        total = None
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    report = fn(self.model, {k: v.to(self.device) for k, v in batch.items()})
                    total = report if total is None else total + report
        finally:
            self.model.train()
        return total

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # max_norm 0 means "measure, do not clip": an infinite bound never scales the gradients.
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """Trainable model and optimizer state keyed by parameter name (DCP's format, engine independent).

        Frozen parameters (a draft run's target) are left out: they are an input, not a result.
        """
        model_sd, optim_sd = trainable_state(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_LOAD)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights for export (trivial here; gathered on other engines)."""
        return self.model.state_dict()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (its shards, where sharded)."""
        def nbytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = list(self.module.parameters())
        optim = sum(nbytes(v) for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None), "optim": optim}


_SAVE = StateDictOptions(ignore_frozen_params=True)


def frozen_names(model: nn.Module) -> list[str]:
    """The state-dict names of what training never changes: every name of a frozen parameter (a tied one has two),
    and every tensor of a subtree whose parameters are all frozen (a draft run's target: its buffers too)."""
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def walk(prefix: str, module: nn.Module) -> None:
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            names.extend(prefix + n for n, _ in module.named_buffers(remove_duplicate=False))
            return
        for name, child in module.named_children():
            walk(f"{prefix}{name}.", child)

    walk("", model)
    return names


def trainable_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts without what ``frozen_names`` lists. torch's ``ignore_frozen_params``
    drops a frozen parameter under one name only: a tied target head (Gemma's 262k-row embedding, also read as
    ``lm_head.weight``) stayed in every draft checkpoint under its alias, with the target's persistent buffers."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # how DCP names a parameter behind its wrappers

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_SAVE)
    frozen = {fqn for name in frozen_names(model) for fqn in _get_fqns(model, name)}
    for key in list(model_sd):
        # A frozen weight's own extra keys too: a 4-bit base (QLoRA, bitsandbytes' Linear4bit) saves its quantization
        # state as '<weight>.absmax', '<weight>.quant_map', '<weight>.quant_state.*' beside the packed weight.
        if key in frozen or _parents(key, frozen):
            model_sd.pop(key)
    return model_sd, optim_sd


def _parents(key: str, names: set[str]) -> list[str]:
    """The dotted prefixes of ``key`` that are in ``names`` ('a.b.c' -> 'a', 'a.b' where present)."""
    parts = key.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in names]
# Not strict: the frozen keys are absent by design. The checkpoint manager has already
# checked that every trainable tensor is present with the right shape (_check_fit).
_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


class CollectiveEngine(LocalEngine):
    """The decisions and sums that every multi-process engine takes over the process group (one collective each)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce_sum(t, self.device)

    def all_agree(self, ok: bool) -> bool:
        return distributed.all_agree(ok, self.device)

    def any_rank(self, flag: bool) -> bool:
        return distributed.any_rank(flag, self.device)
