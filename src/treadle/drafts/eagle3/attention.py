"""Training-time-test attention without dense masks (EAGLE-3's unroll, drafts/eagle3/model.py).

Step k's query at row t attends to step 0's keys s <= t of t's document (the context a decode has accepted) and
to its own chain: step j's key at the same row t, j = 1..k (``ttt_mask`` in drafts/glide/model.py is the same rule as a
dense [T, T * (k + 1)] mask). Written densely, every step holds a mask and scores over T * (k + 1) keys: O(K^2 T^2)
over an unroll of K steps. Here the two parts are computed apart and merged in one softmax:

* the diagonal part is one score per row and chain step, ``sum(q_t * k_j,t)``: [B, H, T, k];
* the step-0 part is ordinary causal attention within documents, computed ``chunk_rows`` query rows at a time over
  the keys those rows can reach (from the earliest document start among them to the last row), each chunk under
  activation checkpointing, so no [T, T] score, mask or softmax is kept for backward: what a step keeps is O(T * k).

The softmax over the union of both key sets is the dense one's exactly (same scores, same normalizer), so outputs
and gradients equal the dense mask's up to summation order. A row always sees itself at step 0, so no row is empty.

Context parallelism: the queries are this rank's slice of the rows (``start`` is its first row's index in the
whole sequence), step 0's keys and the document ids are the whole sequence's (``gather``: an all-gather whose
backward hands each rank the gradient of the keys it made, as GLIDE's draft does); the chain's keys are local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# Query rows per chunk of the step-0 attention: a chunk's scores are chunk_rows x keys x heads, e.g. 256 x 16k x 32
# fp32 = 512 MiB at most (rows late in a long document); short documents cut the keys to the document's.
CHUNK_ROWS = 256


def _gqa(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _chunk(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, allowed: torch.Tensor, diag_scores: torch.Tensor,
           diag_v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a chunk of query rows ([B, H, C, D]) over step-0 keys ``k0`` / ``v0`` ([B, H, L, D]) where
    ``allowed`` ([B, 1, C, L]) and over its chain's keys (scores [B, H, C, k], values [B, H, C, k, D]), one softmax."""
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(torch.cat((scores, diag_scores), dim=-1), dim=-1)
    L = k0.shape[-2]
    out = p[..., :L] @ v0
    if diag_v.shape[-2]:
        out = out + (p[..., L:].unsqueeze(-1) * diag_v).sum(-2)
    return out


def unroll_attention(q: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                     chain: tuple[tuple[torch.Tensor, torch.Tensor], ...], doc: torch.Tensor, start: int = 0,
                     chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """[B, H, T, D] attention of TTT step ``len(chain)``'s queries ``q`` (rows start..start+T-1 of the sequence).

    ``first``: step 0's keys and values of the whole sequence, [B, Hkv, N, D]; ``chain``: steps 1..k's keys and
    values at the query rows, [B, Hkv, T, D] each; ``doc``: [B, N] document ids of the whole sequence.
    """
    B, H, T, D = q.shape
    groups = H // first[0].shape[1]
    scale = D ** -0.5
    k0, v0 = _gqa(first[0], groups), _gqa(first[1], groups)
    if chain:
        diag_k = torch.stack([_gqa(k, groups) for k, _ in chain], dim=-2)  # [B, H, T, k, D]
        diag_v = torch.stack([_gqa(v, groups) for _, v in chain], dim=-2)
        diag_scores = (q.unsqueeze(-2) * diag_k).sum(-1) * scale  # [B, H, T, k]
    else:
        diag_v = q.new_zeros(B, H, T, 0, D)
        diag_scores = q.new_zeros(B, H, T, 0)
    # Where each row's document starts (index of its first token): its keys begin there.
    idx = torch.arange(doc.shape[1], device=doc.device)
    doc_start = torch.where(torch.cat((doc.new_ones(B, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]), 1), idx, 0).cummax(1).values
    grad = torch.is_grad_enabled() and (q.requires_grad or k0.requires_grad or v0.requires_grad)
    parts = []
    for c0 in range(0, T, chunk_rows):
        c1 = min(T, c0 + chunk_rows)
        lo, hi = int(doc_start[:, start + c0].min()), start + c1  # the keys these rows can reach
        q_idx, k_idx = idx[start + c0:hi], idx[lo:hi]
        allowed = ((k_idx[None, :] <= q_idx[:, None])[None]
                   & (doc[:, start + c0:hi, None] == doc[:, None, lo:hi])).unsqueeze(1)
        args = (q[:, :, c0:c1], k0[:, :, lo:hi], v0[:, :, lo:hi], allowed, diag_scores[:, :, c0:c1],
                diag_v[:, :, c0:c1], scale)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    return torch.cat(parts, dim=2)


@dataclass(frozen=True)
class UnrollKeys:
    """What TTT step ``len(chain)`` attends to, handed to ``Eagle3Draft`` in place of a dense mask.

    Immutable: activation checkpointing recomputes a step's block in backward with the object it was given, so the
    next step builds a new one (``after``) instead of appending to this one.
    """

    doc: torch.Tensor  # [B, N] document ids of the whole sequence
    start: int = 0  # the first query row's index in the whole sequence (context parallelism: this rank's slice)
    first: tuple[torch.Tensor, torch.Tensor] | None = None  # step 0's K/V of the whole sequence (None: this is step 0)
    chain: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # steps 1..k-1's K/V at the query rows
    gather: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # the rows of every rank (None: one process)
    chunk_rows: int = CHUNK_ROWS

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(attention output [B, H, T, D], the K/V this step adds for later steps): step 0's keys of the whole
        sequence at step 0, the step's own local keys after."""
        if self.first is None:
            keys = (k, v) if self.gather is None else (self.gather(k, 2), self.gather(v, 2))
            return unroll_attention(q, keys, (), self.doc, self.start, self.chunk_rows), keys
        chain = (*self.chain, (k, v))
        return unroll_attention(q, self.first, chain, self.doc, self.start, self.chunk_rows), (k, v)

    def after(self, kv: tuple[torch.Tensor, torch.Tensor]) -> UnrollKeys:
        """The next step's keys, given what this step's ``attend`` returned."""
        if self.first is None:
            return UnrollKeys(self.doc, self.start, kv, (), self.gather, self.chunk_rows)
        return UnrollKeys(self.doc, self.start, self.first, (*self.chain, kv), self.gather, self.chunk_rows)
