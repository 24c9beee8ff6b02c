"""``model.dtype = "bf16-weights"``: parameters and activations in bf16, the update exact to fp32.

The model computes with bf16 parameters (no autocast: every activation is bf16, no per-op casts), while each
parameter's fp32 master tensor is what the optimizer updates. One ``nn.Parameter`` object holds both in turn, by
swapping its ``.data``: bf16 for forward and backward, the fp32 master for the clip, the update, checkpoints and
export. So the optimizer, DCP's ``get_state_dict`` (parameters matched by identity) and every checkpoint see the
same fp32 tensors as an fp32 run's: a checkpoint resumes in either mode, and an export is fp32.

Gradients leave each parameter as soon as autograd has accumulated them (``register_post_accumulate_grad_hook``)
and are summed in fp32, so accumulation over micro-batches does not round to bf16 between them.
"""

from __future__ import annotations

import torch
from torch import nn

from treadle.engine.local import LocalEngine


class Bf16WeightsEngine(LocalEngine):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        super().__init__(model, optimizer, device)
        self._master = {p: p.data for p in model.parameters()}  # fp32; updated in place by the optimizer
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # fp32 sums over the step's micro-batches
        for p in self._master:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)
        self._computing = False  # True while .data holds the bf16 copies
        self._to_compute()

    def _accumulate(self, p: nn.Parameter) -> None:
        g = p.grad.float()
        p.grad = None
        if p in self._grads:
            self._grads[p] += g
        else:
            self._grads[p] = g

    def _to_compute(self) -> None:
        """bf16 copies of the masters in the parameters (after an update, before forward)."""
        if not self._computing:
            for p, master in self._master.items():
                p.grad = None
                p.data = master.to(torch.bfloat16)
            self._computing = True

    def _to_master(self) -> None:
        """The fp32 masters back in the parameters, with the step's fp32 gradients as their ``.grad``."""
        if self._computing:
            for p, master in self._master.items():
                p.data = master
                p.grad = self._grads.pop(p, None)
            self._computing = False

    def forward_backward(self, micro_batches, fn):
        self._to_compute()
        return super().forward_backward(micro_batches, fn)

    def forward_only(self, batches, fn):
        self._to_compute()
        return super().forward_only(batches, fn)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self._to_master()  # the norm and the clip in fp32
        return super().clip_grad_norm(max_norm)

    def step(self) -> None:
        self._to_master()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self._grads.clear()
        super().zero_grad()

    def state_dict(self) -> dict:
        self._to_master()
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._to_master()
        super().load_state_dict(state)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        self._to_master()
        return super().export_state_dict()

    def memory_report(self) -> dict[str, int]:
        report = super().memory_report()
        if self._computing:  # the parameters hold bf16 copies; the fp32 masters live beside them
            report["params"] += sum(m.numel() * m.element_size() for m in self._master.values())
        return report
