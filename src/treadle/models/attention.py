"""``model.attention``: the documents of a packed row kept apart without a dense ``[T, T]`` mask.

A packed row holds several documents; their positions restart where each begins. transformers' sdpa path turns that
into a dense boolean ``[B, 1, T, T]`` mask: T^2 memory (CPU sdpa also keeps a float copy of it per layer for backward)
and a masked kernel instead of flash. The two paths here attend each document by itself:

- ``varlen``: CUDA runs torch's ``varlen_attn`` (flash) over the batch flattened, documents cut by their cumulative
  lengths. Elsewhere each document's span goes through sdpa with ``is_causal`` (CPU's flash kernel: memory linear in
  the row), a sliding-window layer's long document in window-sized query blocks.
- ``flex``: FlexAttention with a document-causal ``BlockMask`` (masked blocks are skipped). CUDA only: torch has no
  FlexAttention backward on CPU (its forward runs there, which is how the tests check it).

Each is registered under its own name with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``. A
forward over whole rows with no padding and no cache (training, eval, a prompt's prefill) builds no mask; any other
(a decode step with a cache, a left-padded batch) gets sdpa's mask and attends through sdpa, so the same model
still generates. A caller's own 4-D mask (a draft run's target) is used as given.

Documents are found as treadle's data makes them: a position that does not exceed its predecessor's starts one.
transformers' rule ("not one more than its predecessor") also cuts at the forward jumps a draft run's anchor offsets
make inside a document; on consecutive positions the two agree.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from treadle.errors import UserError

CHOICES = ("auto", "dense", "varlen", "flex")
NAMES = {"varlen": "treadle_varlen", "flex": "treadle_flex"}

try:  # torch 2.11+: flash over cumulative sequence lengths (CUDA)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - every supported torch has it
    varlen_attn = None
# enable_gqa appeared after 2.11: before it, keys and values are repeated per query head first.
_VARLEN_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash's; an fp32 CUDA run attends per document through sdpa
# Below this many tokens a CPU row attends through the dense mask: the mask is small, and one masked call beats a
# call per document (bench/attention.py measures the crossing).
CPU_DENSE_UP_TO = 2048
# On CUDA, rows shorter than this keep sdpa's dense mask (which cuDNN's flash kernel takes on Hopper); from it on
# FlexAttention's document BlockMask skips the masked blocks. Measured on an H200 (torch 2.11, bf16, the 1.1B Llama's
# width, docs/benchmarks.md, fourth GPU run): at 2,048 tokens the dense model ran at the HF Trainer's speed (47.3k vs
# 48.2k tokens/s, 8 rows); at 8,192 flex ran 1.26x dense and varlen_attn 0.21x dense (so auto never picks varlen on
# CUDA). 32k did not come back; the mask alone is 1 GiB per row there, flex's memory is linear in the row.
CUDA_FLEX_FROM = 8192


@dataclass(frozen=True)
class Documents:
    """Where the documents of each row of a ``[B, T]`` position-id tensor start and end."""

    spans: tuple[tuple[tuple[int, int], ...], ...]  # per row, (start, end) of each document
    ids: torch.Tensor  # [B, T] document index within the row

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> Documents:
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
        ids = starts.long().cumsum(-1) - 1
        T = position_ids.shape[-1]
        rows: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
        for b, t in starts.nonzero().tolist():  # the one host sync of a forward
            rows[b].append(t)
        spans = tuple(tuple(zip(r, r[1:] + [T])) for r in rows)
        return cls(spans, ids)

    @cached_property  # once per forward, with the spans
    def cumulative(self) -> tuple[torch.Tensor, int]:
        """The batch flattened row after row: cumulative document lengths (int32 on the ids' device, varlen's
        ``cu_seq``) and the longest document."""
        T = self.ids.shape[-1]
        bounds = [b * T + s for b, row in enumerate(self.spans) for s, _ in row] + [len(self.spans) * T]
        longest = max(e - s for row in self.spans for s, e in row)
        return torch.tensor(bounds, dtype=torch.int32, device=self.ids.device), longest


class _LastDocuments:
    """The documents of the last position-id tensor seen: every layer of one forward (and its recomputation under
    activation checkpointing) is handed the same tensor, so the spans are found once per forward. The key is that
    tensor itself (and its version: written in place, it is found again), not a view of it made per call (a new
    object each time: one host sync per layer). Outside any compiled graph: finding them reads the positions on
    the host."""

    def __init__(self):
        self.key: tuple | None = None
        self.value: Documents | None = None

    @torch.compiler.disable
    def __call__(self, position_ids: torch.Tensor, rows: int) -> Documents:
        seen = self.key is not None and self.key[0] is position_ids
        if not (seen and self.key[1:] == (position_ids._version, rows)):
            self.key = (position_ids, position_ids._version, rows)
            self.value = Documents.of(position_ids.expand(rows, -1))
        return self.value


_documents = _LastDocuments()


def _span(q, k, v, scale, window: int, dropout: float) -> torch.Tensor:
    """One document ([1, H, L, D] each) attended causally, within ``window`` tokens when set, in query blocks of
    ``window`` rows (each sees at most 2 * window keys: memory linear in L)."""
    L = q.shape[2]
    if not window or L <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    out = []
    for a in range(0, L, window):
        b, lo = min(a + window, L), max(0, a - window + 1)
        qi = torch.arange(a, b, device=q.device)[:, None]
        ki = torch.arange(lo, b, device=q.device)[None]
        allowed = (ki <= qi) & (qi - ki < window)
        out.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=allowed,
                                                  dropout_p=dropout, scale=scale))
    return torch.cat(out, 2)


def per_document(query, key, value, docs: Documents, scale, window: int, dropout: float = 0.0) -> torch.Tensor:
    """[B, H, T, D] queries (keys and values may have fewer heads) -> [B, T, H, D], each document by itself."""
    rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, rep), repeat_kv(value, rep)
    rows = []
    for b, spans in enumerate(docs.spans):
        parts = [_span(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], scale, window, dropout)
                 for s, e in spans]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, 2))
    return torch.cat(rows, 0).transpose(1, 2).contiguous()


def flash_varlen(query, key, value, docs: Documents, scale, window: int) -> torch.Tensor:
    """The same on CUDA through ``varlen_attn``: [B, H, T, D] -> [B, T, H, D]."""
    B, H, T, D = query.shape
    extra = {}
    if _VARLEN_GQA:
        extra["enable_gqa"] = True
    else:
        rep = H // key.shape[1]
        key, value = repeat_kv(key, rep), repeat_kv(value, rep)
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value))
    cu, longest = docs.cumulative
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale,
                      window_size=(window - 1 if window else -1, 0), **extra)
    return out.reshape(B, T, H, D)


def document_mask_mod(ids: torch.Tensor, window: int):
    """FlexAttention's rule for one document per row (``ids`` [B, T]): causal, same document, within the window."""
    def allowed(b, h, q, k):
        same = (ids[b, q] == ids[b, k]) & (q >= k)
        return same & (q - k < window) if window else same
    return allowed


class _LastBlockMasks:
    def __init__(self):
        self.key, self.masks = None, {}

    @torch.compiler.disable
    def __call__(self, docs: Documents, heads: int, window: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        if self.key is not docs:
            self.key, self.masks = docs, {}
        if window not in self.masks:
            B, T = docs.ids.shape
            self.masks[window] = create_block_mask(document_mask_mod(docs.ids.to(device), window), B, None, T, T,
                                                   device=device)
        return self.masks[window]


_block_masks = _LastBlockMasks()
_compiled_flex = None


def flex_function(device: torch.device):
    """``flex_attention``, compiled on CUDA (eager FlexAttention computes every score); eager elsewhere, which the
    tests run on CPU, forward only."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex(query, key, value, docs: Documents, scale, window: int) -> torch.Tensor:
    """FlexAttention over the documents' BlockMask: [B, H, T, D] -> [B, T, H, D] (``flex_function``)."""
    mask = _block_masks(docs, query.shape[1], window, query.device)
    out = flex_function(query.device)(query, key, value, block_mask=mask, scale=scale,
                                      enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def _attention(kind: str):
    def attend(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               sliding_window=None, position_ids=None, **kwargs):
        if attention_mask is not None or query.shape[2] != key.shape[2]:  # a mask was built: sdpa, as dense would
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          sliding_window=sliding_window, **kwargs)
        if position_ids is None:  # every HF decoder treadle trains hands them on; a row of one document otherwise
            position_ids = torch.arange(query.shape[2], device=query.device)[None]
        docs = _documents(position_ids, query.shape[0])
        window = sliding_window or 0
        if kind == "flex":
            return flex(query, key, value, docs, scaling, window), None
        if query.is_cuda and varlen_attn is not None and not dropout and query.dtype in _FLASH_DTYPES:
            return flash_varlen(query, key, value, docs, scaling, window), None
        return per_document(query, key, value, docs, scaling, window, dropout), None
    return attend


def _mask(*, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """No mask for a forward over whole rows without padding or cache (the attention finds the documents); sdpa's
    mask for any other."""
    whole = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0 \
        and q_length == kv_length
    if whole and attention_mask is None:
        return None
    return sdpa_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, **kwargs)


for _kind, _name in NAMES.items():
    AttentionInterface.register(_name, _attention(_kind))
    AttentionMaskInterface.register(_name, _mask)


def obstacle(config) -> str | None:
    """Why this model's attention cannot run per document (None: it can): what sdpa cannot compute either way."""
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention soft-caps its scores (attn_logit_softcapping)"
    if getattr(config, "model_type", None) in ("gpt_oss",):
        return "its attention has learned sinks"
    if config._attn_implementation not in ("sdpa", *NAMES.values()):
        return f"it attends through {config._attn_implementation!r} (model.overrides attn_implementation)"
    return None


def resolve(choice: str, config, device: torch.device, seq_len: int, context_parallel: int = 1) -> tuple[str, str]:
    """``model.attention`` for this run: (the choice, why). ``auto`` keeps the dense mask where it is fastest or the
    only way (small CPU rows, a context-parallel run, a model whose attention sdpa alone computes)."""
    why_not = obstacle(config)
    if context_parallel > 1:
        why_not = why_not or "context parallelism attends through its own all-to-all over sdpa"
    if choice == "auto":
        if why_not:
            return "dense", why_not
        cuda = device.type == "cuda"
        where = "CUDA" if cuda else "CPU"
        if cuda and seq_len >= CUDA_FLEX_FROM:
            return "flex", (f"rows of {seq_len} tokens on CUDA: FlexAttention skips the masked blocks (measured 1.26x "
                            f"the dense mask at {CUDA_FLEX_FROM} on an H200), memory linear in the row")
        if not cuda and seq_len > CPU_DENSE_UP_TO:
            return "varlen", f"rows of {seq_len} tokens on CPU: each document by itself, no mask, memory linear in the row"
        return "dense", f"rows of {seq_len} tokens on {where}: one masked call is faster than one call per document"
    if choice != "dense" and why_not:
        raise UserError(f"model.attention = {choice!r} cannot run this model: {why_not}; accepted: 'dense' or 'auto'")
    if choice == "flex" and device.type != "cuda":
        raise UserError("model.attention = 'flex' needs CUDA (torch has no FlexAttention backward on CPU); accepted: "
                        "'varlen', 'dense' or 'auto'")
    return choice, "as set"


def use(model: nn.Module, choice: str) -> None:
    """Switch ``model``'s attention to ``choice`` (resolved: dense, varlen or flex), in place."""
    if choice in NAMES:
        model.set_attn_implementation(NAMES[choice])
