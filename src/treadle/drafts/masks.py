"""A draft's attention masks written once, as rules: FlexAttention's ``mask_mod`` ``(b, h, q, k) -> bool``.

Each rule gives both forms a draft attends through, so they cannot disagree:

- ``Rule.dense()``: the boolean ``[B, 1, Q, K]`` mask (the rule evaluated on broadcast index tensors), attended by
  sdpa: the CPU path, and every decode;
- ``Rule.block_mask``: a FlexAttention ``BlockMask`` (blocks the rule masks whole are skipped, no ``[Q, K]`` mask or
  score kept): a training run whose ``model.attention`` resolved to varlen or flex on CUDA (``DraftRunModel.flex_masks``,
  set by train/run.py's ``choose_attention``).

A rule indexes tensors only with its arguments (``doc[b, q]``), so it runs both broadcast and under FlexAttention's
vmap. The rules here are what GLIDE's, EAGLE-3's and DFlash's training passes attend with; MTP's and frozen_kv's masks
go into transformers modules as 4-D tensors (their dense forms, from the same rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Rule:
    """Which of ``keys`` keys each of ``queries`` queries of each of ``batch`` rows may read (True: may)."""

    allowed: Callable  # (b, h, q, k) -> bool, FlexAttention's mask_mod
    batch: int
    queries: int
    keys: int
    device: torch.device
    flex: bool = False  # attend through a BlockMask (FlexAttention) instead of the dense mask

    def dense(self) -> torch.Tensor:
        b, q, k = (torch.arange(n, device=self.device) for n in (self.batch, self.queries, self.keys))
        out = self.allowed(b[:, None, None, None], torch.zeros_like(b)[:1, None, None, None], q[None, None, :, None],
                           k[None, None, None, :])
        return out.expand(self.batch, 1, self.queries, self.keys)

    @cached_property  # once per rule: every layer of a forward, and its recomputation, attends with the same one
    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(self.allowed, self.batch, None, self.queries, self.keys, device=self.device)


def index_rule(q_idx: torch.Tensor, k_idx: torch.Tensor, *, min_gap: int = 0, window: int = 0,
               q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, flex: bool = False) -> Rule:
    """Query i may read key j iff k_idx[j] <= q_idx[i] - min_gap, within ``window`` tokens (0 = unlimited) and, when
    documents are given, in the same document (``glide.model.attention_mask`` is its dense form)."""
    B = max(q_idx.shape[0], k_idx.shape[0])
    q_idx, k_idx = q_idx.expand(B, -1), k_idx.expand(B, -1)
    if q_doc is not None:
        q_doc, k_doc = q_doc.expand(B, -1), k_doc.expand(B, -1)

    def allowed(b, h, q, k):
        out = k_idx[b, k] <= q_idx[b, q] - min_gap
        if window:
            out = out & (q_idx[b, q] - k_idx[b, k] < window)
        if q_doc is not None:
            out = out & (q_doc[b, q] == k_doc[b, k])
        return out

    return Rule(allowed, B, q_idx.shape[1], k_idx.shape[1], q_idx.device, flex)


def ttt_rule(doc: torch.Tensor, step: int, window: int = 0, flex: bool = False) -> Rule:
    """Training-time-test step ``step``'s row t over the keys of steps 0..step (key blocks of T in step order): step
    0's rows s <= t of t's document, and row t of each later step, all within ``window`` tokens of t + step
    (``glide.model.ttt_mask`` is its dense form; its docstring says why)."""
    B, T = doc.shape

    def allowed(b, h, q, k):
        j, s = k // T, k % T
        context = (j == 0) & (s <= q) & (doc[b, q] == doc[b, s])
        chain = (j > 0) & (s == q)
        if window:
            context = context & (q + step - s < window)
            chain = chain & (step - j < window)
        return context | chain

    return Rule(allowed, B, T, T * (step + 1), doc.device, flex)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Rule) -> torch.Tensor:
    """Attention with grouped K/V heads and rows that may see nothing (output 0), under a dense boolean mask or a
    ``Rule`` (its BlockMask when ``flex``, else its dense form).

    A fully masked row would come out of SDPA as NaN (PLATFORM.md): such rows are unmasked for the kernel and their
    output zeroed, so they contribute nothing. FlexAttention gives such a row 0 itself.
    """
    if isinstance(mask, Rule):
        if mask.flex:
            from treadle.models.attention import flex_function

            return flex_function(q.device)(q, k, v, block_mask=mask.block_mask, enable_gqa=k.shape[1] != q.shape[1])
        mask = mask.dense()
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seen = mask.any(-1, keepdim=True)  # [B, 1, Tq, 1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen)
    return out * seen.to(out.dtype)
