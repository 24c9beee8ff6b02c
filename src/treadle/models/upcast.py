"""Where a loss needs more precision than the model computes in."""

from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 when it is narrower (bf16 logits under autocast), else unchanged.

    Softmaxes and per-token losses never run in bf16 (8 bits of mantissa would round every token's loss), but a
    float64 model stays float64: that is how a test proves two loss paths equal to float64's precision instead of
    fp32's, whose rounding differs between CPUs.
    """
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
