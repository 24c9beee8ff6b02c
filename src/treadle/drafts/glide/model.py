"""GLIDE: a one-layer draft that reads the frozen target's last-layer KV cache.

The draft block (LongSpec's design, written here from the paper's description):

    h = embed(tokens)                               the target's embedding, frozen
    h = h + SelfAttn(norm(h))                       own q/k/v/o, RoPE, optional window
    h = h + CrossAttn(norm(h), K_t, V_t)            own q/o; K/V = target's last layer, post-RoPE
    h = h + MLP(norm(h))
    logits = lm_head(norm(h))                       the target's LM head, frozen

Two layouts of that block (``draft.layout``): ``treadle`` (above; q/k/v biased only where the target's are, the
window ``draft.window``) and ``longspec``, the block LongSpec's code runs (sail-sg/LongSpec
``LlamaGlideDecoderLayer`` / ``Qwen2GlideDecoderLayer``): q/k/v always biased, a self-attention window of 512 earlier
tokens (``LONGSPEC_WINDOW`` in treadle's count, which includes the token itself), and no final norm: the layer's
output goes straight into the target's LM head (LongSpec applies neither a norm of its own nor the target's).
``glide_layout`` converts the weights to LongSpec's names at the edge.

Because the draft has one layer whose self-attention keys and values depend only
on token and position, its cached self-attention K/V stay exact whatever target
context the cross-attention saw: that is what makes a decode-time cache cheap.

Time alignment (the KV lag): at decode time the target has processed every token
except the newest ("bonus") one, so the draft token at sequence index i may read
target K/V only at indices <= i - lag with lag >= 1, and the k-th token of a draft
chain sees lag k. Training draws lag in [1, gamma] so every chain position is trained.

Training-time test (``draft.ttt_steps = K > 1``): the training pass unrolls the chain as
decoding runs it. Step 0 is the teacher-forced pass with a lag L; step k >= 1 feeds, at
row t, the draft's own argmax of step k - 1 as the token at index t + k (RoPE position
t + k), its self-attention reading step 0's rows <= t and its own chain (``ttt_mask``),
its cross-attention reading target K/V <= t - L, i.e. lag L + k, as link L + k of a decode
chain does. L is drawn in [1, gamma - K + 1] (1 once K >= gamma), so links 1..gamma stay trained.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from treadle.errors import UserError
from treadle.models.chunked_ce import chunked_distillation_scores, model_logits
from treadle.drafts.masks import index_rule, sdpa, ttt_rule  # sdpa: the kinds import it from here
from treadle.models.identity import describe_target, target_config_fingerprint, target_differences
from treadle.drafts.run_model import DraftRunModel

KIND = "glide"


# ----------------------------------------------------------------------------- masks and positions


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows restart positions at 0 for each document: number the documents of each row."""
    return (position_ids == 0).long().cumsum(-1)


def attention_mask(q_idx: torch.Tensor, k_idx: torch.Tensor, *, min_gap: int = 0, window: int = 0,
                   q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, 1, Tq, Tk]: query i may read key j iff k_idx[j] <= q_idx[i] - min_gap,
    within ``window`` tokens (0 = unlimited) and, when documents are given, in the same document
    (the dense form of ``masks.index_rule``).

    Indices count tokens (not RoPE positions, which anchor offsets may shift).
    """
    return index_rule(q_idx, k_idx, min_gap=min_gap, window=window, q_doc=q_doc, k_doc=k_doc).dense()


def ttt_mask(doc: torch.Tensor, step: int, window: int = 0) -> torch.Tensor:
    """[B, 1, T, T * (step + 1)]: what training-time-test step ``step``'s row t attends to among the keys of steps
    0..step (GLIDE's and EAGLE-3's unrolls; key blocks in step order); the dense form of ``masks.ttt_rule``.

    Row t of step ``step`` stands at index t + step of a decode chain started after token t: it sees step 0's rows
    s <= t of t's document (the context a decode has accepted) and row t of each later step (the chain proposed
    from t), all within ``window`` tokens of t + step (0 = unlimited), as a decode's causal window would.
    """
    return ttt_rule(doc, step, window).dense()


def anchored_positions(position_ids: torch.Tensor, anchor: int, offset: int) -> torch.Tensor:
    """Keep positions < ``anchor`` of every document; shift the rest by ``offset``.

    Short training documents then exercise the long positions a decode will reach,
    while the first (attention-sink) positions keep their usual values.
    """
    if offset == 0:
        return position_ids
    return torch.where(position_ids >= anchor, position_ids + offset, position_ids)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed in its weight's dtype.

    Under bf16 autocast a bf16 activation (an EAGLE-3 feature is ``fc``'s bf16 output) meets
    an fp32 weight; torch's fused kernel needs both in one dtype and otherwise warns
    "Mismatch dtype ... Cannot dispatch to fused implementation" and takes a slower path.
    Upcast first, the fused kernel runs in fp32 and returns fp32, as HF's Llama norm does there.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention of Llama / Qwen2 / Mistral (cos, sin: [B, T, D])."""
    if 2 * cos.shape[-1] == x.shape[-1]:  # gpt-oss's: one angle per pair (i, i + D/2), the same rotation
        cos, sin = cos.repeat(1, 1, 2), sin.repeat(1, 1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class WholeSequences:
    """How a GlideModel sees its sequences by default: whole, in this process, so there is nothing to gather.

    Under context parallelism (``distributed.context_parallel``) the run swaps in the engine's ``SequenceSlices``
    (engine/context_parallel.py), the same three methods over a context group: ``forward`` then runs on this rank's
    slice of every sequence and gathers, across the cut, what attention needs of the whole sequence.
    """

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` of every rank of the group, concatenated along ``dim`` (differentiable)."""
        return x

    def start(self, length: int) -> int:
        """Where this rank's slice of ``length`` tokens starts in the whole sequence."""
        return 0

    def attention(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """While inside, ``model``'s own attention sees the whole sequence (its K/V across the cut)."""
        return contextlib.nullcontext()


WHOLE = WholeSequences()


# ----------------------------------------------------------------------------- the draft block


@dataclass(frozen=True)
class GlideShape:
    """The draft's dimensions, all taken from the target so its K/V and LM head fit (Gemma: hidden_activation)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool

    @classmethod
    def of(cls, target_config) -> GlideShape:
        c = target_config
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size, num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
            hidden_act=getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None) or "silu",
            attention_bias=bool(getattr(c, "attention_bias", False)),
        )


LAYOUTS = ("treadle", "longspec")
# LongSpec's self-attention: flash-attn window_size=(512, -1), query i reads keys j with i - j <= 512; treadle's
# window counts the tokens read, the query's own included (``attention_mask``: q - k < window).
LONGSPEC_WINDOW = 513

# The target families LongSpec has a decoder layer for, and that layer's class (config.json ``architectures``).
ARCHITECTURES = {"llama": "LlamaGlideDecoderLayer", "qwen2": "Qwen2GlideDecoderLayer"}


def is_layout(config: dict) -> bool:
    """A config.json of a GLIDE draft in LongSpec's layout (treadle's or one trained with LongSpec)."""
    return any(a in ARCHITECTURES.values() for a in config.get("architectures") or ())


def check_longspec_target(target_config, window: int = 0) -> None:
    """What LongSpec's layer can be built for: a Llama or Qwen2 target with head_dim = hidden / heads and no MLP
    bias; its self-attention window is fixed (``draft.window`` 0 or 513, treadle's count of LongSpec's 512)."""
    family = target_config.model_type
    if family not in ARCHITECTURES:
        raise UserError(f"draft.layout = 'longspec' with a {family!r} target: LongSpec has GLIDE layers for "
                        f"{', '.join(map(repr, ARCHITECTURES))} targets only; accepted: such a target, or "
                        "draft.layout = 'treadle'")
    heads, hidden = target_config.num_attention_heads, target_config.hidden_size
    head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise UserError(f"draft.layout = 'longspec' with a target whose head_dim ({head_dim}) x heads ({heads}) != "
                        f"hidden_size ({hidden}): LongSpec's layer computes head_dim = hidden_size / heads; "
                        "accepted: draft.layout = 'treadle'")
    if getattr(target_config, "mlp_bias", False):
        raise UserError("draft.layout = 'longspec' with a target whose MLP has biases (mlp_bias = true): treadle's "
                        "GLIDE MLP has none; accepted: draft.layout = 'treadle'")
    if window not in (0, LONGSPEC_WINDOW):
        raise UserError(f"draft.window = {window} with draft.layout = 'longspec': LongSpec's self-attention reads "
                        f"the 512 tokens before each token, fixed in its code; accepted: draft.window = 0 or "
                        f"{LONGSPEC_WINDOW} (treadle counts the token itself)")


class GlideDraft(nn.Module):
    """The trainable draft block. It owns no embedding or LM head (the target's are shared).

    ``layout``: ``"treadle"`` or ``"longspec"`` (the module docstring); a longspec block's ``window`` is always
    LongSpec's, ``LONGSPEC_WINDOW`` (``window`` may be passed as 0 or that; anything else is refused).
    """

    def __init__(self, target_config, window: int = 0, layout: str = "treadle"):
        super().__init__()
        s = self.shape = GlideShape.of(target_config)
        if layout == "longspec":
            check_longspec_target(target_config, window)
            window = LONGSPEC_WINDOW
        elif layout != "treadle":
            raise UserError(f"draft.layout = {layout!r}; accepted: {', '.join(map(repr, LAYOUTS))}")
        self.window, self.layout = window, layout
        bias = s.attention_bias or layout == "longspec"  # LongSpec hard-codes bias=True on q/k/v
        q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        self.self_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.q_proj = nn.Linear(s.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(s.hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(s.hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, s.hidden_size, bias=False)
        self.cross_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.cross_q_proj = nn.Linear(s.hidden_size, q_out, bias=bias)
        self.cross_o_proj = nn.Linear(q_out, s.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.act = ACT2FN[s.hidden_act]
        # LongSpec's block has none: its output is what the LM head reads.
        self.final_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps) if layout == "treadle" else None
        init_linears(self, target_config)

    def export_config(self) -> dict:
        """What ``load_glide`` needs besides the weights (export.py writes it to config.json)."""
        from dataclasses import asdict

        return {"treadle_draft_kind": KIND, "layout": self.layout, "window": self.window, "shape": asdict(self.shape)}

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.shape.head_dim).transpose(1, 2)  # [B, H, T, D]

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).flatten(2)

    # torch.utils.checkpoint's keyword arguments when activation checkpointing is on (models/checkpointing.py).
    checkpoint_kwargs: dict | None = None

    def forward(self, embeds: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                target_kv: tuple[torch.Tensor, torch.Tensor], self_mask: torch.Tensor, cross_mask: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                gather: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        """Hidden states the LM head reads (after the final norm, if the layout has one), and this call's
        self-attention K/V (for a decode cache).

        ``past_kv`` holds self-attention K/V of earlier tokens (decode); ``self_mask``
        then covers past + new keys. ``gather`` (context parallelism: ``embeds`` is a slice of the sequence)
        makes the self-attention's keys and values the whole sequence's; the masks then cover every position.
        """
        # Inside forward, as transformers does for its layers: an in-place compile (of __call__) then
        # compiles the checkpoint too, and module hooks stay outside the recomputation.
        if self.checkpoint_kwargs is not None and self.training and torch.is_grad_enabled():
            return checkpoint(self._block, embeds, rope, target_kv, self_mask, cross_mask, past_kv, gather,
                              **self.checkpoint_kwargs)
        return self._block(embeds, rope, target_kv, self_mask, cross_mask, past_kv, gather)

    def _block(self, embeds, rope, target_kv, self_mask, cross_mask, past_kv, gather=None):
        cos, sin = rope
        h = self.self_norm(embeds)
        q, k, v, new_kv = self_attention_inputs(self, h, cos, sin, past_kv)
        if gather is not None:  # every rank's keys (their gradients flow back to the rank that made them)
            k, v = gather(k, 2), gather(v, 2)
        x = embeds + self.o_proj(self._merge(sdpa(q, k, v, self_mask)))

        # Target K/V are already rotated at their own positions; rotating our queries at
        # ours makes the scores depend on the distance, as inside the target.
        q = rotate(self._heads(self.cross_q_proj(self.cross_norm(x))), cos, sin)
        tk, tv = target_kv
        x = x + self.cross_o_proj(self._merge(sdpa(q, tk.to(q.dtype), tv.to(q.dtype), cross_mask)))

        h = self.mlp_norm(x)
        x = x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        return (x if self.final_norm is None else self.final_norm(x)), new_kv


# ----------------------------------------------------------------------------- the target side


def last_attention(target) -> nn.Module:
    from treadle.models.hf import decoder_layers

    attn = getattr(decoder_layers(target)[-1], "self_attn", None)
    if attn is None or not (all(hasattr(attn, n) for n in ("k_proj", "v_proj")) or hasattr(attn, "qkv_proj")):
        raise UserError(f"draft.target {type(target).__name__} has no q/k/v/o self-attention in its last layer; "
                        "accepted: Llama / Qwen2 / Mistral-family decoders")
    return attn


@contextlib.contextmanager
def capture_last_kv(target) -> Iterator[dict]:
    """Record the target's last-layer post-RoPE K/V during a forward without a KV cache: training runs the target
    without one (packed documents stay apart only then, PLATFORM.md), so the K/V are rebuilt from the projections the
    layer computes plus the rotary it is handed; they equal the cache's exactly (tests/test_glide_targets.py)."""
    attn = last_attention(target)
    got: dict = {}

    def pre(_module, _args, kwargs):
        got["rope"] = kwargs["position_embeddings"]

    # K as the layer's k_norm returns it (Qwen3: per head, OLMo-2: all heads); Phi-3's fused qkv_proj cut as it does
    fused = getattr(attn, "qkv_proj", None)
    sources = {"k": getattr(attn, "k_norm", None) or fused or attn.k_proj, "v": fused or attn.v_proj}
    handles = [attn.register_forward_pre_hook(pre, with_kwargs=True)] + [
        m.register_forward_hook(lambda _m, _i, out, n=n: got.__setitem__(n, out)) for n, m in sources.items()]
    result: dict = {}
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
    head_dim = attn.head_dim
    if fused is not None:
        q, kv = target.config.num_attention_heads * head_dim, target.config.num_key_value_heads * head_dim
        got["k"], got["v"] = got["k"][..., q:q + kv] if sources["k"] is fused else got["k"], got["v"][..., q + kv:]
    k = got["k"].reshape(*got["k"].shape[:2], -1, head_dim)
    result["k"] = rotate(k.transpose(1, 2), *got["rope"])
    result["v"] = got["v"].reshape(*got["v"].shape[:2], -1, head_dim).transpose(1, 2)


def causal_document_mask(position_ids: torch.Tensor, target=None):
    """Block-diagonal causal mask for packed rows, handed to the target explicitly (GLIDE's and EAGLE-3's): HF infers
    packing from position jumps, which anchor offsets also create. HF hands a 4-D mask to the attention as it is, so
    for a ``target`` it holds what HF's masks would: the sliding window (a mask per layer type, Gemma 2/3, gpt-oss), and
    it is additive (0 / the dtype's min) unless the attention is sdpa: eager and flex add it to the scores."""
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    doc = document_ids(position_ids)
    c = getattr(target, "config", None)
    window = (getattr(c, "use_sliding_window", True) is not False and getattr(c, "sliding_window", None)) or 0
    types = getattr(c, "layer_types", None)
    mask = attention_mask(idx, idx, window=0 if types else window, q_doc=doc, k_doc=doc)
    if types and window and "sliding_attention" in types:
        mask = {"full_attention": mask, "sliding_attention": attention_mask(idx, idx, window=window, q_doc=doc,
                                                                            k_doc=doc)}
    if target is None:
        return mask
    dtype = target.get_input_embeddings().weight.dtype
    if isinstance(mask, dict):
        return {k: as_mask(m, c, dtype) for k, m in mask.items()}
    return as_mask(mask, c, dtype)


def target_mask(position_ids: torch.Tensor, target):
    """What a draft run hands its target as ``attention_mask``: nothing when the target attends through
    ``model.attention``'s varlen or flex (models/attention.py: they find the documents from ``position_ids`` and take
    each layer's own window, so no [T, T] mask is built), else ``causal_document_mask``. Both start a document where
    a position restarts at 0 (treadle's rows; anchor offsets jump forward, never back)."""
    from treadle.models.attention import NAMES

    if target.config._attn_implementation in NAMES.values():
        return None
    return causal_document_mask(position_ids, target)


def as_mask(mask: torch.Tensor, config, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as a model's attention wants it: boolean for sdpa, additive (0 / the
    dtype's min) for eager and flex, which add it to the scores."""
    if config._attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


@dataclass
class GlideOutput:
    logits: torch.Tensor | None  # the draft's, [B, T, V]
    target_logits: torch.Tensor | None  # the frozen target's on the same input, [B, T, V]
    # With a chunked loss (loss_chunk_tokens, labels given) the logits are never whole; per-token [B, T] instead:
    token_ce: torch.Tensor | None = None  # the draft's CE on the labels
    token_kl: torch.Tensor | None = None  # KL(target || draft), 0 where the label is ignored
    target_token_ce: torch.Tensor | None = None  # the target's CE on the labels
    token_hit: torch.Tensor | None = None  # bool: the draft's argmax is the target's, on labelled rows
    # Training-time test (forward with steps > 1): logits of unroll steps 1..steps-1, each [B, T, V]; row t of step
    # k guesses token t + k + 1 (``logits`` is step 0's).
    chain_logits: list[torch.Tensor] | None = None


def self_attention_inputs(block: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_kv):
    """A draft block's rotated queries and its keys / values with ``past_kv`` (its cache) in front, plus the new
    keys / values alone (what the caller appends to its cache). ``block`` has q/k/v_proj and ``_heads``."""
    q = rotate(block._heads(block.q_proj(h)), cos, sin)
    k = rotate(block._heads(block.k_proj(h)), cos, sin)
    v = block._heads(block.v_proj(h))
    new_kv = (k, v)
    if past_kv is not None:
        k, v = torch.cat((past_kv[0], k), dim=2), torch.cat((past_kv[1], v), dim=2)
    return q, k, v, new_kv


def init_linears(module: nn.Module, target_config) -> None:
    """A new draft's linear layers drawn as its target's were initialized (normal, the target's std; zero bias)."""
    std = getattr(target_config, "initializer_range", 0.02)
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class GlideModel(DraftRunModel):
    """A GLIDE draft run's model: the draft cross-attends to the frozen target's last-layer K/V."""

    def __init__(self, target, draft_model: GlideDraft):
        super().__init__(target, draft_model)
        # What ``forward`` is handed: whole sequences, or (context parallelism) a slice of each. The evaluation
        # methods below always take whole sequences (acceptance runs the same prompts on every rank).
        self.sequences = WHOLE

    # Evaluations call these methods directly (not through forward); a sharding engine (FSDP2)
    # must gather the parameters around them as around forward, so they are declared here.
    fsdp_forward_methods = ("target_forward", "draft_logits", "chain_guesses", "continue_greedily")

    def target_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Target logits and last-layer K/V for packed rows (no grad: the target is a fixed teacher)."""
        return self._target_forward(input_ids, position_ids)

    def draft_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     target_kv: tuple[torch.Tensor, torch.Tensor], lag: int,
                     doc_position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits with every position reading target K/V ``lag`` tokens behind it.

        ``doc_position_ids`` (positions before any offset) delimit the documents; it
        defaults to ``position_ids``.
        """
        return self._draft_logits(input_ids, position_ids, target_kv, lag, doc_position_ids)

    def chain_guesses(self, texts: torch.Tensor, gamma: int) -> list[torch.Tensor]:
        """Per chain step k = 1..gamma, [N, L]: entry i is the draft's argmax at index i with lag k, its guess for
        token i + 1 at step k of a decode chain (``speculative.acceptance``)."""
        positions = torch.arange(texts.shape[1], device=texts.device).expand_as(texts)
        _, target_kv = self._target_forward(texts, positions, hidden=True, reads=self.eval_reads(texts))
        return [self._draft_logits(texts, positions, target_kv, lag=k).argmax(-1) for k in range(1, gamma + 1)]

    # The public methods above and forward all call these: a method FSDP wraps must not be
    # entered from inside forward, whose hooks already hold the parameters gathered.

    def target_reads(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, (k, v) = self._target_forward(input_ids, position_ids, hidden=True)
        return {"hidden": hidden, "k": k.transpose(1, 2), "v": v.transpose(1, 2)}  # K/V token-major: [B, T, Hkv, D]

    def _target_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden: bool = False,
                        seq: WholeSequences = WHOLE, reads: dict | None = None):
        """Logits (or, ``hidden``, the final hidden states the LM head would read) of ``input_ids``, and last-layer
        K/V of the whole sequence (``seq``: gathered when ``input_ids`` is this rank's slice); from ``reads`` (a
        store's, drafts/run_model.py) when given."""
        if reads is not None:
            k, v = reads["k"].transpose(1, 2), reads["v"].transpose(1, 2)
            out = reads["hidden"] if hidden else self.teacher_logits(reads["hidden"])
            return out, (seq.gather(k, 2), seq.gather(v, 2))
        self.check_live()
        run = self.target.model if hidden else self.target
        mask = target_mask(seq.gather(position_ids, 1), self.target)  # the whole sequence's, on every rank
        with torch.no_grad(), capture_last_kv(self.target) as kv, seq.attention(self.target):
            out = run(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=mask)
        return out.last_hidden_state if hidden else out.logits, (seq.gather(kv["k"], 2), seq.gather(kv["v"], 2))

    def _draft_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      target_kv: tuple[torch.Tensor, torch.Tensor], lag: int,
                      doc_position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self._draft_hidden(input_ids, position_ids, target_kv, lag, doc_position_ids)
        return model_logits(self.target.config, self.target.get_output_embeddings()(hidden))  # as the target scores

    def _draft_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      target_kv: tuple[torch.Tensor, torch.Tensor], lag: int,
                      doc_position_ids: torch.Tensor | None = None, seq: WholeSequences = WHOLE) -> torch.Tensor:
        # Documents and token indices of the whole sequence (keys); the queries are this rank's part of them.
        doc = document_ids(seq.gather(position_ids if doc_position_ids is None else doc_position_ids, 1))
        idx = torch.arange(doc.shape[1], device=input_ids.device).expand_as(doc)
        mine = slice(seq.start(input_ids.shape[1]), seq.start(input_ids.shape[1]) + input_ids.shape[1])
        q_idx, q_doc = idx[:, mine], doc[:, mine]
        flex = self.flex_masks
        self_mask = index_rule(q_idx, idx, window=self.draft_model.window, q_doc=q_doc, k_doc=doc, flex=flex)
        cross_mask = index_rule(q_idx, idx, min_gap=lag, q_doc=q_doc, k_doc=doc, flex=flex)
        embeds = self.target.get_input_embeddings()(input_ids)
        rope = self.rotary(embeds, position_ids)
        hidden, _ = self.draft_model(embeds, rope, target_kv, self_mask, cross_mask, gather=seq.gather)
        return hidden

    def _unroll_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       target_kv: tuple[torch.Tensor, torch.Tensor], lag: int, steps: int,
                       doc_position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Draft logits of training-time-test steps 0..steps-1 (see the module docstring), each [B, T, V]."""
        doc = document_ids(position_ids if doc_position_ids is None else doc_position_ids)
        idx = torch.arange(doc.shape[1], device=input_ids.device).expand_as(doc)
        # Row t of every step reads target K/V <= t - lag: link lag + k of a chain started after token t.
        cross_mask = index_rule(idx, idx, min_gap=lag, q_doc=doc, k_doc=doc, flex=self.flex_masks)
        embed, head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        tokens, keys, out = input_ids, None, []
        for k in range(steps):
            embeds = embed(tokens)
            rope = self.rotary(embeds, position_ids + k)
            self_mask = ttt_rule(doc, k, self.draft_model.window, flex=self.flex_masks)
            hidden, (nk, nv) = self.draft_model(embeds, rope, target_kv, self_mask, cross_mask, past_kv=keys)
            keys = (nk, nv) if keys is None else (torch.cat((keys[0], nk), 2), torch.cat((keys[1], nv), 2))
            out.append(model_logits(self.target.config, head(hidden)))  # the shared head scores as the target's does
            tokens = out[-1].detach().argmax(-1)  # the draft's own guess is the next step's input; no gradient
        return out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lag: int = 1,
                doc_position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                steps: int = 1, reads: dict | None = None) -> GlideOutput:
        """``reads``: the target's reads of these rows from a store (drafts/run_model.py); None: the target runs."""
        if steps > 1:  # training-time test: whole logits per step (run.py refuses the chunked loss and slices)
            target_logits, target_kv = self._target_forward(input_ids, position_ids, reads=reads)
            logits = self._unroll_logits(input_ids, position_ids, target_kv, lag, steps, doc_position_ids)
            return GlideOutput(logits=logits[0], target_logits=target_logits, chain_logits=logits[1:])
        if labels is not None and self.loss_chunk_tokens:
            # Both models' final hidden states through the shared head a chunk at a time (here, inside forward:
            # a sharding engine holds the head's weight gathered only now).
            target_hidden, target_kv = self._target_forward(input_ids, position_ids, hidden=True, seq=self.sequences,
                                                            reads=reads)
            hidden = self._draft_hidden(input_ids, position_ids, target_kv, lag, doc_position_ids, self.sequences)
            ce, kl, target_ce, hit = chunked_distillation_scores(
                hidden, target_hidden, self.target.get_output_embeddings().weight, labels, self.loss_chunk_tokens,
                config=self.target.config)  # the target's logit transform (soft-cap, scale) inside each chunk
            return GlideOutput(None, None, token_ce=ce, token_kl=kl, target_token_ce=target_ce, token_hit=hit)
        target_logits, target_kv = self._target_forward(input_ids, position_ids, seq=self.sequences, reads=reads)
        hidden = self._draft_hidden(input_ids, position_ids, target_kv, lag, doc_position_ids, self.sequences)
        return GlideOutput(model_logits(self.target.config, self.target.get_output_embeddings()(hidden)), target_logits)


def read_draft_config(draft_dir) -> dict | None:
    """The config.json of a treadle draft export, or None if ``draft_dir`` is not one."""
    try:
        config = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    from treadle.drafts.eagle3 import layout as eagle3_layout
    from treadle.drafts.eagle3 import speculators as eagle3_speculators

    if eagle3_speculators.is_layout(config):  # speculators' EAGLE-3 (treadle's --to speculators or trained there)
        config = eagle3_speculators.as_eagle_layout(config, draft_dir)
    if "treadle_draft_kind" not in config and eagle3_layout.is_layout(config):  # an EAGLE-3 draft trained elsewhere
        config["treadle_draft_kind"] = "eagle3"
    if "treadle_draft_kind" not in config and is_layout(config):  # a GLIDE draft trained with LongSpec
        config["treadle_draft_kind"] = KIND
    return config if "treadle_draft_kind" in config else None


def checked_export(draft_dir, target, kind: str, title: str) -> dict:
    """The config.json of a ``kind`` draft export in ``draft_dir``, refused in one line unless it is one and was
    trained for ``target``'s architecture."""
    config = read_draft_config(draft_dir)
    if config is None or config["treadle_draft_kind"] != kind:
        raise UserError(f"{draft_dir} is not {title} draft export (config.json with treadle_draft_kind = '{kind}')")
    recorded = config["target"]
    if recorded.get("config_fingerprint") != target_config_fingerprint(target.config):
        raise UserError(f"draft {draft_dir} was trained for another target than this one "
                        f"({target_differences(recorded, config.get('target_config'), target.config)}); accepted: "
                        f"the target it was trained for ({describe_target(recorded)}), or a draft trained for this one")
    return config
