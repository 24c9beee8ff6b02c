"""Context parallelism (Ulysses): every sequence is split across the ranks of a group, attention is not.

The model transform half of ``distributed.context_parallel`` (the data half is the loader's slice,
``data/loader.py: slice_sequences``). Each rank of a context group runs the model on its slice of the
sequence: embeddings, MLPs, norms and the head see ``T / cp`` tokens. Attention alone needs every token:
its queries, keys and values are exchanged with one all-to-all so that each rank holds *all* ``T``
positions for ``H / cp`` of the heads, attends, and a second all-to-all sends each rank its own positions
back with all the heads (DeepSpeed-Ulysses' scheme). Activations per rank shrink by ``cp``; attention's
result is exactly one process's.

Why treadle's own wrapper and not DeepSpeed's ``UlyssesSPAttentionHF``: DeepSpeed 0.19.8 drops the 4-D
attention mask and attends plain-causally, so packed documents would see each other on CPU (research:
scale-apis.md §1.2 p3). Here the position ids of the whole sequence are gathered (once per forward) and
the packed-causal mask is rebuilt from them by transformers' own rule (a position that does not follow
its predecessor by one starts a new document), exactly the mask one process builds.

The wrapper is registered with transformers' ``AttentionInterface`` under its own name and the model is
switched to it (``set_attn_implementation``): models stay unaware, and a model without the transform in
the same process keeps plain sdpa. That name is not a mask implementation, so transformers builds no mask
for the local slice at all.

Gradients: autograd through the all-to-all hands each rank the gradient of its own loss term only, so
the gradients must be SUMMED over the context group. Every treadle engine already sums over all ranks
(the loss is pre-divided by the step's global token count), which is exactly that: no engine changes.

Draft runs whose model slices its own sequences (it holds a ``sequences`` view): the frozen
target runs this same attention, but only inside the draft model's ``forward`` (the
sliced training and eval batches; ``SequenceSlices.attention`` switches it on for the call), because the
acceptance evaluation runs whole prompts on every rank with plain sdpa. The target is handed its own 4-D
mask of the whole sequence (documents start where positions restart at 0: anchor offsets make jumps inside
a document, so transformers' rule would cut them), which the wrapper uses as given. The one-layer draft
needs no head exchange: it all-gathers keys and values (the target's last-layer K/V for its cross-attention,
its own for its self-attention) and attends from its slice's queries; the gather's backward hands each rank
the gradient of the keys it made. The lag and offset rules are unchanged: masks use whole-sequence indices.
EAGLE-3 drafts the same way: the target on its slice, step 0's draft keys all-gathered (each unroll step's chain
keys are at its own rows, local), the tokens, labels, document positions and the target's final hidden states
gathered so that a row near the cut is scored against the teacher ahead of it (drafts/eagle3/model.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import find_packed_sequence_indices

from treadle.errors import UserError

# A differentiable all-gather along a dim: torch 2.13's all_gather_single; before it, all_gather_tensor_autograd
# (deprecated from 2.13, when all_gather_single gained a backward).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd

ATTENTION_NAME = "treadle_context_parallel"


def check_model(config, cp: int, tp: int = 1) -> None:
    """A one-line UserError when ``cp`` ranks cannot split this model's attention.

    Ulysses gives each rank ``heads / cp`` query heads; with tensor parallelism (``tp``) a rank's attention holds
    ``heads / tp`` of them already, which the context group splits again: ``heads / tp / cp``. Key/value heads need not divide: when they do not, they
    are replicated to one per query head before the exchange (as DeepSpeed does), which costs traffic, not
    exactness. The wrapper runs sdpa itself, so the model must be an sdpa model (eager would be silently replaced,
    flex attention has no CPU backward, flash kernels would need their own mask handling).
    """
    attn = config._attn_implementation
    if attn != "sdpa":
        raise UserError(f"distributed.context_parallel = {cp} needs sdpa attention, the model uses {attn!r}; "
                        "accepted: model.overrides attn_implementation = 'sdpa' (or unset)")
    heads = config.num_attention_heads
    if tp > 1 and heads % (cp * tp):
        raise UserError(f"distributed.context_parallel = {cp} x tensor_parallel = {tp} does not divide the model's "
                        f"{heads} attention heads (num_attention_heads: each tensor-parallel rank's {heads} / {tp} are "
                        f"split again over the context group); accepted: axes whose product divides {heads}")
    if heads % cp:
        raise UserError(f"distributed.context_parallel = {cp} does not divide the model's {heads} attention heads "
                        f"(num_attention_heads); accepted: a divisor of {heads}")


def split_model_config(model: nn.Module):
    """The config whose attention context parallelism splits: a draft run's target, else the model's own.

    A draft run's model is known by what it holds (a frozen ``target`` beside its ``draft_model``), not by its
    class: the engine sits below the draft kinds and names none of them."""
    return model.target.config if hasattr(model, "draft_model") else model.config


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Switch ``model``'s attention to the all-to-all wrapper over ``group`` (in place, before any engine wraps it);
    a model that slices its own sequences (its ``sequences`` attribute, a draft kind's capability) is told it is
    handed slices (``SequenceSlices``) instead."""
    check_model(split_model_config(model), dist.get_world_size(group))
    AttentionInterface.register(ATTENTION_NAME, UlyssesAttention(group))
    if hasattr(model, "sequences"):
        model.sequences = SequenceSlices(group)
    else:
        model.set_attn_implementation(ATTENTION_NAME)


class SequenceSlices:
    """A sequence-slicing draft model's view of its context group (drafts/glide/model.py ``WholeSequences`` is the
    one-process view)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order (= sequence order); the backward sums the
        gradients of the whole and hands each rank its part."""
        return funcol.wait_tensor(_all_gather(x.contiguous(), dim, self.group))

    def start(self, length: int) -> int:
        return self.rank * length

    @contextlib.contextmanager
    def attention(self, model: nn.Module):
        """``model`` (a draft's target) attends through the all-to-all wrapper while inside; sdpa again after."""
        before = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION_NAME  # read by every attention layer at each call
        try:
            yield
        finally:
            model.config._attn_implementation = before


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk ``i`` of dim 0 to rank ``i``; chunk ``i`` of the result from rank ``i``. Differentiable: backward is the
    same exchange of the gradients (torch's functional collective; its older twin in torch.distributed.nn is
    deprecated in 2.13). The ``_autograd`` name: before torch 2.13 the plain one has no backward; from 2.13 both
    are the same function."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, None, None, group))


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[B, H, T/cp, D] on each rank (its positions, all heads) -> [B, H/cp, T, D] (all positions, its heads)."""
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()  # chunk c goes to rank c
    recv = _all_to_all(send, group)  # [cp: from rank, B, h/cp, t, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[B, H/cp, T, D] (its heads, all positions) -> [B, T/cp, H, D] (its positions, all heads; HF's output layout)."""
    b, h, T, d = x.shape
    send = x.reshape(b, h, cp, T // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # position chunk c goes to rank c
    recv = _all_to_all(send, group)  # [cp: head chunk, B, h, t, D]
    return recv.permute(1, 3, 0, 2, 4).reshape(b, T // cp, cp * h, d)


def packed_causal_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor | None:
    """[B, 1, T, T] bool: causal, and within one packed document (transformers' rule on ``position_ids``);
    None when every row is one document and there is no window (plain causal: sdpa's ``is_causal``)."""
    docs = find_packed_sequence_indices(position_ids)
    if docs is None and not sliding_window:
        return None
    T = position_ids.shape[-1]
    i = torch.arange(T, device=position_ids.device)
    mask = (i[:, None] >= i[None, :])[None]
    if sliding_window:
        mask = mask & (i[:, None] - i[None, :] < sliding_window)[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    return mask[:, None]


class UlyssesAttention:
    """transformers' attention-function signature; all-to-all around sdpa with the whole sequence's mask."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.cp = dist.get_world_size(group)
        # The local position_ids tensor of the last forward, and the masks built from the whole sequence's positions
        # (one per sliding window: layers may differ). Every layer of one forward (and its recomputation under
        # activation checkpointing) is handed the same tensor, so the gather runs once per forward; every rank of
        # the group runs the same forwards, so all hit or all miss and the gather's collective always matches.
        self._positions: torch.Tensor | None = None
        self._masks: dict[tuple, torch.Tensor | None] = {}
        self._whole: torch.Tensor | None = None
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None  # a caller's 4-D mask and its additive form

    def _mask(self, position_ids: torch.Tensor, batch: int, sliding_window: int | None,
              dtype: torch.dtype) -> torch.Tensor | None:
        """The whole sequence's mask, additive (0 / dtype's min) in the queries' dtype, or None (plain causal).

        Additive, not boolean: CPU sdpa converts a boolean mask to a float one on every call and keeps that copy
        for backward, one [T, T] float per layer (measured: 4 layers at 8k tokens, 917 MiB for boolean masks,
        193 MiB for one shared float mask). One float mask shared by every layer is kept once.
        """
        if self._positions is not position_ids:
            parts = [torch.empty_like(position_ids) for _ in range(self.cp)]
            dist.all_gather(parts, position_ids.contiguous(), group=self.group)
            self._positions, self._masks, self._whole = position_ids, {}, torch.cat(parts, dim=-1)
        key = (sliding_window, dtype)
        if key not in self._masks:
            allowed = packed_causal_mask(self._whole.expand(batch, -1), sliding_window)
            self._masks[key] = None if allowed is None else torch.zeros(allowed.shape, dtype=dtype,
                device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return self._masks[key]

    def _given_mask(self, mask: torch.Tensor, whole: int, dtype: torch.dtype) -> torch.Tensor:
        """A 4-D boolean mask the caller built over the whole sequence (a sequence-slicing draft's target), additive, once per tensor."""
        if mask.dtype != torch.bool or mask.shape[-2:] != (whole, whole):
            raise RuntimeError(f"context-parallel attention was handed a {tuple(mask.shape)} {mask.dtype} mask; it "
                               f"takes a boolean mask over the whole sequence ({whole} x {whole}) or none")
        if self._given is None or self._given[0] is not mask or self._given[1].dtype != dtype:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
            self._given = (mask, additive)
        return self._given[1]

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 position_ids: torch.Tensor | None = None, sliding_window: int | None = None, **kwargs):
        if attention_mask is not None:  # transformers hands a caller's 4-D mask through unchanged
            mask = self._given_mask(attention_mask, query.shape[2] * self.cp, query.dtype)
        elif position_ids is None:  # treadle always passes them; a 1-D RoPE default would be wrong for a slice
            raise RuntimeError("context-parallel attention needs position_ids (the positions of this rank's slice)")
        else:
            mask = self._mask(position_ids, query.shape[0], sliding_window, query.dtype)
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % self.cp:  # replicate: one key/value head per query head, then split like the queries
            key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
        q, k, v = (_seq_to_heads(x, self.cp, self.group) for x in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention on this rank's share of the heads
            k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             is_causal=mask is None)
        return _heads_to_seq(out, self.cp, self.group), None
