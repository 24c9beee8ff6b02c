"""DFlash: a block draft that proposes ``block_size - 1`` tokens in one forward over the target's fused features.

Written from the DFlash design as z-lab's reference model (z-lab/dflash ``dflash/model.py`` @44947fb), SpecForge
(sgl-project/SpecForge ``specforge/modeling/draft/dflash.py``) and speculators (vllm-project/speculators
``src/speculators/models/dflash/``) describe it:

    c_t = hidden_norm(fc([h_l1 ; ... ; h_ln]_t))        the chosen target layers' states at context token t,
                                                        fused once (``feature_layers``: output_hidden_states
                                                        indices, treadle's one convention)
    x   = embed([anchor, MASK, ..., MASK])               a block of ``block_size`` rows, the target's frozen
                                                        embedding; the anchor is the last accepted token
    per draft layer (Qwen3-style: pre-norm, q/k per-head norm, SwiGLU MLP, residuals):
        q = q_norm(q_proj(norm(x)))                     the block only
        K = k_norm(k_proj([c ; norm(x)])), V = v_proj([c ; norm(x)])
                                                        the context enters as extra keys/values through the
                                                        layer's own projections, never its residual stream
        x = x + o_proj(Attn(q, K, V)); x = x + MLP(norm(x))
    logits = target.lm_head(norm(x))                    the target's frozen head, the draft's own final norm

RoPE: context token t at its own position, block slot j at the anchor's position + j. Attention: a block sees
the context strictly before its anchor (in the anchor's document: packed rows are never crossed) and its own
slots, bidirectionally. Slot k >= 1 guesses the token at anchor + k (no EAGLE-style shift); slot 0 is not
scored. At decode time the anchor is the bonus token, which has no target features yet: exactly "context
strictly before the anchor".

Training runs every sampled anchor of a packed row in one forward: the queries are the blocks' rows, the keys
the whole row's context followed by every block; ``block_mask`` says which key each block row may read
(by position, never by block id: overlapping anchors must not leak a later anchor's context, SpecForge #472).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from treadle.drafts.kind import init_dir
from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dflash import settings
from treadle.drafts.dflash import speculators as dflash_speculators
from treadle.drafts.eagle3.model import draft_rotary, draft_shape
from treadle.drafts.glide.model import (
    WHOLE, RMSNorm, checked_export, document_ids, init_linears, rotate, sdpa, target_mask,
)
from treadle.drafts.masks import Rule
from treadle.drafts.run_model import DraftRunModel, FusedFeatureReads
from treadle.drafts.targets import capture_features, draft_target
from treadle.errors import UserError
from treadle.data.packed import IGNORE_INDEX
from treadle.models.chunked_ce import chunked_rows, model_logits
from treadle.models.upcast import at_least_fp32

KIND = "dflash"


def default_feature_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """z-lab's picks (``build_target_layer_ids``: ``count`` decoder layers spread evenly over 1..N-3, or N // 2 for
    one), as output_hidden_states indices: z-lab's decoder-layer index + 1 (Qwen3-8B, 5 picks: 2, 10, 18, 26, 34).
    A target too shallow for distinct picks gets up to ``count`` distinct indices spread over 1..N-1."""
    n = num_target_layers
    if count == 1:
        zlab = [n // 2]
    else:
        zlab = [int(round(1 + i * (n - 4) / (count - 1))) for i in range(count)]
    picks = tuple(i + 1 for i in zlab)
    if all(1 <= i < n for i in picks) and all(a < b for a, b in zip(picks, picks[1:])):
        return picks
    m = max(1, min(count, n - 1))
    if m == 1:
        return (max(1, n // 2),)
    return tuple(sorted({int(round(1 + i * (n - 2) / (m - 1))) for i in range(m)}))


def check_feature_layers(layers, num_layers: int, key: str) -> None:
    """What the engines serve: one or more strictly increasing output_hidden_states indices in 1..N-1 (index N is
    a normalized state in Hugging Face's tuple and no engine captures it; index 0 would be z-lab's -1)."""
    layers = list(layers)
    if not layers or any(not 1 <= i < num_layers for i in layers) or any(a >= b for a, b in zip(layers, layers[1:])):
        raise UserError(f"{key} = {layers}: accepted: one or more strictly increasing output_hidden_states indices "
                        f"in 1..{num_layers - 1} (i = decoder layer i's output)")


def default_mask_token(target_vocab: int, data_vocab: int) -> int:
    """A row of the target's embedding no data token uses where there is one (the first past the tokenizer's, as
    Qwen3's 151669), else the last row."""
    return data_vocab if data_vocab < target_vocab else target_vocab - 1


# ----------------------------------------------------------------------------- masks


def block_rule(doc: torch.Tensor, anchors: torch.Tensor, block_size: int, flex: bool = False,
               window: int = 0) -> Rule:
    """What the rows of N anchored blocks may read among a packed row's T context keys followed by the blocks' own
    N * block_size keys. Block j (anchor index ``anchors[b, j]``) reads context index t iff t < anchor and t is in
    the anchor's document (and, with ``window``, t >= anchor - window), and every row of its own block."""
    B, T = doc.shape
    N = anchors.shape[1]

    def allowed(b, h, q, k):
        block, anchor = q // block_size, anchors[b, q // block_size]
        context = (k < anchor) & (doc[b, k.clamp(max=T - 1)] == doc[b, anchor])  # k < anchor < T
        if window:
            context = context & (k >= anchor - window)
        return context | ((k >= T) & ((k - T) // block_size == block))

    return Rule(allowed, B, N * block_size, T + N * block_size, doc.device, flex)


def block_mask(doc: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, 1, N * block_size, T + N * block_size] bool: ``block_rule``'s dense form."""
    return block_rule(doc, anchors, block_size).dense()


# ----------------------------------------------------------------------------- the draft


class DFlashLayer(nn.Module):
    """One Qwen3-style decoder layer whose attention also reads the fused context as keys/values."""

    def __init__(self, s):
        super().__init__()
        d, hd = s.hidden_size, s.head_dim
        self.head_dim = hd
        self.input_layernorm = RMSNorm(d, eps=s.rms_norm_eps)
        self.q_proj = nn.Linear(d, s.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, s.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, s.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, eps=s.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=s.rms_norm_eps)
        self.gate_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, d, bias=False)
        self.act = ACT2FN[s.hidden_act]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], x.shape[-1] // self.head_dim, self.head_dim)  # [B, T, H, D]: the per-head norm acts on D

    def keys(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, H_kv, T, D] of ``h`` (the fused context, or the block's normed rows)."""
        k = rotate(self.k_norm(self._heads(self.k_proj(h))).transpose(1, 2), cos, sin)
        v = self._heads(self.v_proj(h)).transpose(1, 2)
        return k, v

    def attend(self, h: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
               sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The attention sublayer's output for the normed block rows ``h`` (queries, and keys after the context's)."""
        q = rotate(self.q_norm(self._heads(self.q_proj(h))).transpose(1, 2), cos, sin)
        k, v = self.keys(h, cos, sin)
        k, v = torch.cat((context_kv[0].to(k.dtype), k), 2), torch.cat((context_kv[1].to(v.dtype), v), 2)
        return self.o_proj(sdpa(q, k, v, mask).transpose(1, 2).flatten(2))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.input_layernorm(x), context_kv, cos, sin, mask)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class BlockDraftHooks:
    """What ``build_dflash`` and ``draft_from_layout`` ask of a draft class: DFlash's answers, which a kind built on
    its backbone (DFlash2, LiLiCorr, DSpark) overrides where it differs."""

    kind = KIND
    layout = dflash_layout  # the module that writes and reads its z-lab layout
    speculators = dflash_speculators  # its speculators table (None: speculators has no class for the kind)
    settings = settings  # the module whose block_size / num_layers give the [draft] keys' defaults

    @classmethod
    def run_options(cls, cfg) -> dict:
        """Constructor keywords a new draft takes from a ``DraftConfig`` beyond DFlash's (none)."""
        return {}

    @classmethod
    def layout_options(cls, config: dict, target_config, where) -> dict:
        """Constructor keywords a draft in its layout takes from its config.json beyond DFlash's (none)."""
        return {}

    def init_keys(self) -> tuple:
        """(draft.key, this draft's value) pairs a ``draft.init`` run must not contradict beyond DFlash's (none)."""
        return ()

    @classmethod
    def layout_name(cls) -> str:
        """What a directory in its layout holds, as the refusal of one that is not names it."""
        return (f"{cls.layout.TITLE} draft in z-lab's layout (config.json with architectures = "
                f"[{cls.layout.ARCHITECTURE!r}])")

    @classmethod
    def layout_spec(cls, config: dict, target_config, where) -> dict:
        """The constructor keywords (beyond the target's config) of the draft a config.json in its layout describes,
        checked against the target (a treadle export's fingerprint is checked before)."""
        dflash_layout.check_fits(config, target_config, where)
        layers = dflash_layout.feature_layers(config, target_config.num_hidden_layers, where)
        check_feature_layers(layers, target_config.num_hidden_layers, f"{where}/config.json target_layer_ids + 1")
        return {"feature_layers": layers, "num_layers": config["num_hidden_layers"],
                "block_size": dflash_layout.block_size(config),
                "mask_token_id": dflash_layout.mask_token_id(config, where),
                **cls.layout_options(config, target_config, where)}


class DFlashDraft(BlockDraftHooks, nn.Module):
    """The trainable draft: fc + hidden_norm, ``num_layers`` layers, the final norm. It owns no embedding or head
    (the target's are shared, frozen)."""

    def __init__(self, target_config, feature_layers: tuple[int, ...], num_layers: int = settings.NUM_LAYERS,
                 block_size: int = settings.BLOCK_SIZE, mask_token_id: int | None = None):
        super().__init__()
        s = self.shape = draft_shape(target_config)
        d = s.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.block_size = block_size
        self.target_vocab_size = target_config.vocab_size
        self.mask_token_id = target_config.vocab_size - 1 if mask_token_id is None else mask_token_id
        if not 0 <= self.mask_token_id < target_config.vocab_size:
            raise UserError(f"draft.mask_token_id = {self.mask_token_id} is not a row of the target's embedding; "
                            f"accepted: 0..{target_config.vocab_size - 1}")
        self.fc = nn.Linear(len(self.feature_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.layers = nn.ModuleList(self.new_layer(s) for _ in range(num_layers))
        self.norm = RMSNorm(d, eps=s.rms_norm_eps)
        init_linears(self, target_config)

    def new_layer(self, s) -> nn.Module:
        """One draft layer of shape ``s`` (a kind built on this draft, DFlash2, makes its own)."""
        return DFlashLayer(s)

    # torch.utils.checkpoint's keyword arguments when activation checkpointing is on (models/checkpointing.py).
    checkpoint_kwargs: dict | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The context [B, T, d] every layer reads, from the target's concatenated states [B, T, n * d]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> list[tuple]:
        """Per layer, the context's rotated keys and values (what a decode caches; training recomputes them)."""
        cos, sin = rope
        return [layer.keys(context, cos, sin) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context_kv: list[tuple],
                mask: torch.Tensor) -> torch.Tensor:
        """The block rows' final hidden states [B, Q, d] (after the draft's norm: the head reads them).

        ``context_kv``: per layer the keys/values the rows may read before their own (``context_kv``, or a
        decode's cache); ``mask`` [B, 1, Q, keys] says which (True: may read)."""
        cos, sin = rope
        x = embeds
        for layer, kv in zip(self.layers, context_kv):
            if self.checkpoint_kwargs is not None and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, kv, cos, sin, mask, **self.checkpoint_kwargs)
            else:
                x = layer(x, kv, cos, sin, mask)
        return self.norm(x)

    def export_config(self) -> dict:
        """treadle's own keys in config.json; the rest is z-lab's layout (``dflash_layout.config_of``)."""
        return {"treadle_draft_kind": self.kind}


# ----------------------------------------------------------------------------- draft and target together


@dataclass
class DFlashOutput:
    logits: torch.Tensor | None  # the draft's [B, N, block_size - 1, V]: slot k's guess of token anchor + k (k = 1..)
    target_logits: torch.Tensor | None  # the target's [B, N, block_size - 1, V] at index anchor + k - 1 (its guess)
    target_ce: torch.Tensor  # the target's own CE summed over the row's labels (the floor), scalar
    # With a chunked loss (loss_chunk_tokens, slot_labels given) the logits are never whole; per slot [B, N, K]:
    ce: torch.Tensor | None = None  # the draft's CE on slot_labels (0 where ignored)
    kl: torch.Tensor | None = None  # KL(target || draft) (0 where ignored)
    hit: torch.Tensor | None = None  # the draft's argmax equals the target's (bool)
    teacher_top: torch.Tensor | None = None  # the target's argmax (its greedy token) per slot, [B, N, K]
    # The draft's final hidden states of slots 1.. [B, N, K, d]: what a head on the slots' candidates (DFlash2's
    # selector, LiLiCorr's correlator) scores beside the logits.
    hidden: torch.Tensor | None = None
    # With a chunked loss: the target's final hidden states at index anchor + k - 1 [B, N, K, d], what its logits at
    # a few ids are computed from (``target_logits`` is never whole then).
    teacher_hidden: torch.Tensor | None = None
    # The draft's final hidden state of slot 0 (the anchor's row) [B, N, d]: a head over the whole block (XPress's
    # refiner) reads it beside ``hidden``.
    anchor_hidden: torch.Tensor | None = None


def _slot_scores(hidden: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, config):
    """One chunk of slot rows through the shared head: the draft's CE on ``labels``, KL(target || draft), whether
    the two argmaxes agree and the target's argmax (fp32 softmaxes; the target's logit transform applied to both, as
    its forward does)."""
    logp = F.log_softmax(at_least_fp32(model_logits(config, F.linear(hidden, weight))), -1)
    with torch.no_grad():  # the teacher is fixed: recomputed in backward, never differentiated
        teacher_logp = F.log_softmax(at_least_fp32(model_logits(config, F.linear(teacher, weight))), -1)
    valid = labels != IGNORE_INDEX
    ce = F.nll_loss(logp, labels, ignore_index=IGNORE_INDEX, reduction="none")
    kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="none").sum(-1) * valid
    teacher_top = teacher_logp.argmax(-1)
    hit = (logp.detach().argmax(-1) == teacher_top) & valid
    return ce, kl, hit, teacher_top


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the k best logits, their ids, the log-normalizer) of fp32 ``logits`` [..., V]; differentiable in the logits
    (the ids are fixed)."""
    ids = logits.detach().topk(k, dim=-1).indices
    return logits.gather(-1, ids), ids, logits.logsumexp(-1)


def _target_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, config) -> tuple[torch.Tensor]:
    """One chunk of the target's own per-token CE (the floor a draft run logs as target_loss)."""
    logits = at_least_fp32(model_logits(config, F.linear(hidden, weight)))
    return (F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none"),)


class DFlashModel(FusedFeatureReads, DraftRunModel):
    """What a dflash draft run trains: a frozen target and a trainable ``draft_model`` on its fused features."""

    draft_class = DFlashDraft  # what build_dflash / load_dflash make for this run model

    def __init__(self, target, draft_model: DFlashDraft):
        super().__init__(target, draft_model)
        self.rotary = draft_rotary(target.config)  # buffers only, not saved
        self.sequences = WHOLE

    # Methods evaluations call directly: a sharding engine gathers parameters around them (see GlideModel).
    fsdp_forward_methods = ("chain_guesses", "continue_greedily")

    def _target_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden: bool = False,
                        reads: dict | None = None):
        """The target's logits (or, ``hidden``, the final hidden states its head reads) and its features
        ([B, T, len(feature_layers) * d]) for packed rows, without grad; from ``reads`` (a store's,
        drafts/run_model.py) when given."""
        if reads is not None:
            return self.from_reads(reads, hidden)
        self.check_live()
        run = self.target.model if hidden else self.target
        mask = target_mask(position_ids, self.target)
        with torch.no_grad(), capture_features(self.target, self.draft_model.feature_layers) as tap:
            out = run(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=mask)
            return out.last_hidden_state if hidden else out.logits, tap.take()

    def _blocks(self, input_ids: torch.Tensor, position_ids: torch.Tensor, features: torch.Tensor,
                anchors: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        """The draft's final hidden states of the blocks anchored at ``anchors`` [B, N] (indices into the rows):
        [B, N, block_size, d]."""
        draft = self.draft_model
        bs = draft.block_size
        B, N = anchors.shape
        tokens = input_ids.new_full((B, N, bs), draft.mask_token_id)
        tokens[:, :, 0] = input_ids.gather(1, anchors)
        embed = self.target.get_input_embeddings()
        embeds = embed(tokens.flatten(1))
        block_pos = (position_ids.gather(1, anchors)[..., None] + torch.arange(bs, device=anchors.device)).flatten(1)
        context = draft.fuse(features)
        kv = draft.context_kv(context, self.rotary(context, position_ids))
        hidden = self.draft_blocks(embeds, self.rotary(embeds, block_pos), kv, self._block_rule(doc, anchors), tokens)
        return hidden.view(B, N, bs, -1)

    def draft_blocks(self, embeds: torch.Tensor, rope, kv: list[tuple], mask, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's forward over blocks of ``tokens`` [B, N, block_size] (``embeds`` their rows [B, Q, d]): the
        final hidden states [B, Q, d]. A draft that reads the block's tokens themselves (DSpine's anchor code)
        overrides it; the drafter's one block goes through here too."""
        return self.draft_model(embeds, rope, kv, mask)

    def _block_rule(self, doc: torch.Tensor, anchors: torch.Tensor) -> Rule:
        """Which keys the blocks' rows read (``block_rule``); a draft that sees less context overrides it."""
        return block_rule(doc, anchors, self.draft_model.block_size, self.flex_masks)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared head on the draft's final hidden states [..., d] (flattened: one matmul, not a batched one
        over a sliced block)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return model_logits(self.target.config, self.target.get_output_embeddings()(flat)).view(*hidden.shape[:-1], -1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, anchors: torch.Tensor,
                doc_position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                slot_labels: torch.Tensor | None = None, reads: dict | None = None) -> DFlashOutput:
        """Blocks at ``anchors`` [B, N] (indices; any valid index where a row has fewer, never scored) scored
        against the target: slot k's logits and the target's at index anchor + k - 1 (clamped at the row's end:
        such slots are never scored). With ``loss_chunk_tokens`` > 0 and ``slot_labels`` ([B, N, K] data tokens,
        -100 where a slot is not scored): per-slot scores computed a chunk of rows at a time instead."""
        from treadle.data.packed import row_cross_entropy

        doc = document_ids(position_ids if doc_position_ids is None else doc_position_ids)
        bs = self.draft_model.block_size
        rows = (anchors[..., None] + torch.arange(bs - 1, device=anchors.device)).clamp_max(input_ids.shape[1] - 1)
        B, N, K = rows.shape
        if self.loss_chunk_tokens and slot_labels is not None:
            # Both heads a chunk of rows at a time (here, inside forward: a sharding engine holds the head's weight).
            target_hidden, features = self._target_forward(input_ids, position_ids, hidden=True, reads=reads)
            blocks = self._blocks(input_ids, position_ids, features, anchors, doc)
            hidden = blocks[:, :, 1:]
            teacher = target_hidden.gather(1, rows.flatten(1)[..., None].expand(-1, -1, target_hidden.shape[-1]))
            weight, config, chunk = self.target.get_output_embeddings().weight, self.target.config, self.loss_chunk_tokens
            ce, kl, hit, top = chunked_rows(lambda h, t, y: _slot_scores(h, t, weight, y, config),
                                            [hidden.flatten(0, -2), teacher.flatten(0, -2), slot_labels.flatten()],
                                            chunk)
            target_ce = target_hidden.new_zeros(())
            if labels is not None:
                with torch.no_grad():
                    target_ce = chunked_rows(lambda t, y: _target_ce(t, weight, y, config),
                                             [target_hidden.flatten(0, -2), labels.flatten()], chunk)[0].sum()
            out = DFlashOutput(None, None, target_ce, ce.view(B, N, K), kl.view(B, N, K), hit.view(B, N, K),
                               top.view(B, N, K), hidden, teacher.view(B, N, K, -1), blocks[:, :, 0])
        else:
            target_logits, features = self._target_forward(input_ids, position_ids, reads=reads)
            hidden = self._blocks(input_ids, position_ids, features, anchors, doc)
            teacher = target_logits.gather(1, rows.flatten(1)[..., None].expand(-1, -1, target_logits.shape[-1]))
            target_ce = (row_cross_entropy(target_logits, labels).sum() if labels is not None
                         else target_logits.new_zeros(()))
            out = DFlashOutput(self.draft_logits(hidden[:, :, 1:]), teacher.view(B, N, K, -1), target_ce,
                               hidden=hidden[:, :, 1:], anchor_hidden=hidden[:, :, 0])
        return self.head_scores(out, input_ids, anchors, doc, features, slot_labels)

    # ------------------------------------------------------------------ hooks for a head on the slots' candidates
    # A kind built on DFlash that picks its proposals among each slot's top-k candidates (DFlash2's selector,
    # LiLiCorr's correlator) overrides ``head_scores`` (training: its picks and loss terms beside the backbone's) and
    # ``slot_guesses`` (the same picks for tau_sim), and reads the candidates through ``slot_top_k``.

    def head_scores(self, out: DFlashOutput, input_ids: torch.Tensor, anchors: torch.Tensor, doc: torch.Tensor,
                    features: torch.Tensor, slot_labels: torch.Tensor | None) -> DFlashOutput:
        """``forward``'s output with a head's scores added: its picks against the target's greedy token as ``hit``
        (what the acceptance metrics count) and, with ``slot_labels``, its per-slot loss terms (the objective's
        ``row_loss`` adds them). ``doc``: the rows' document ids; ``features``: the target's [B, T, n * d] the blocks
        read. DFlash has no head: the slots' argmaxes are its picks."""
        return out

    def slot_guesses(self, texts: torch.Tensor, anchors: torch.Tensor, hidden: torch.Tensor, features: torch.Tensor,
                     doc: torch.Tensor) -> torch.Tensor:
        """[N, n, k] the draft's guesses at slots 1..k of the blocks anchored at ``anchors`` [N, n] in ``texts``, from
        their final hidden states [N, n, k, d] (``features`` and ``doc`` as ``head_scores``'s): each slot's argmax
        (a head walks its candidates instead, each slot after the text's tokens before it: what the decode proposes
        wherever the chain has been accepted up to that slot)."""
        return self.draft_logits(hidden).argmax(-1)

    def block_guesses(self, texts: torch.Tensor, anchors: torch.Tensor, blocks: torch.Tensor, features: torch.Tensor,
                      doc: torch.Tensor, gamma: int) -> torch.Tensor:
        """``slot_guesses`` of slots 1..gamma from the blocks' every slot [N, n, block_size, d] (a head over the whole
        block, XPress's refiner, reads the anchor's row and the slots past gamma too)."""
        return self.slot_guesses(texts, anchors, blocks[:, :, 1 : gamma + 1], features, doc)

    def slot_top_k(self, hidden: torch.Tensor, k: int, logits: torch.Tensor | None = None):
        """(logits [..., k], ids [..., k], log-normalizer [...]) of the k best tokens at slots with final hidden
        states ``hidden`` [..., d]: fp32, the target's logit transform applied, differentiable in the logits (the
        ids are fixed). From ``logits`` [..., V] when the caller has them, else through the shared head, with
        ``loss_chunk_tokens`` a chunk of rows at a time (never whole [rows, V] logits)."""
        if logits is None and not self.loss_chunk_tokens:
            logits = self.draft_logits(hidden)
        if logits is not None:
            return _top_k(at_least_fp32(logits), k)
        weight, config = self.target.get_output_embeddings().weight, self.target.config
        top, ids, norm = chunked_rows(lambda h: _top_k(at_least_fp32(model_logits(config, F.linear(h, weight))), k),
                                      [hidden.reshape(-1, hidden.shape[-1])], self.loss_chunk_tokens)
        lead = hidden.shape[:-1]
        return top.view(*lead, k), ids.view(*lead, k), norm.view(lead)

    @torch.no_grad()
    def chain_guesses(self, texts: torch.Tensor, gamma: int, chunk: int = 64) -> list[torch.Tensor]:
        """Per chain step k = 1..gamma, [N, L] target ids: entry i is the draft's guess for token i + 1 when a
        decode's block was anchored at token i - k + 1 (-1 where no such anchor exists). A DFlash block's slots do
        not depend on one another's acceptance, so this is what the decode loop proposes from every start."""
        if gamma > self.draft_model.block_size - 1:
            raise ValueError(f"gamma {gamma} exceeds the block's {self.draft_model.block_size - 1} drafts")
        N, L = texts.shape
        positions = torch.arange(L, device=texts.device).expand_as(texts)
        _, features = self._target_forward(texts, positions, hidden=True, reads=self.eval_reads(texts))
        doc = torch.ones_like(texts)
        slots = []  # per anchor chunk: [N, n, gamma] guesses of slots 1..gamma
        for first in range(0, L, chunk):
            anchors = torch.arange(first, min(L, first + chunk), device=texts.device).expand(N, -1)
            blocks = self._blocks(texts, positions, features, anchors, doc)
            slots.append(self.block_guesses(texts, anchors, blocks, features, doc, gamma))
        guess = torch.cat(slots, dim=1)  # [N, L, gamma]: anchor a's slot k guesses token a + k
        out = []
        for k in range(1, gamma + 1):  # entry i = a + k - 1
            g = guess[:, :, k - 1]
            out.append(torch.cat((g.new_full((N, k - 1), -1), g[:, : L - k + 1]), dim=1))
        return out


# ----------------------------------------------------------------------------- building and loading


def build_dflash(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False,
                 model_class=None):
    """(DFlashModel, target dir, target identity) for a ``DraftConfig``; from ``draft.init`` the directory's draft
    (its layers, block size and mask token are the run's). ``model_class``: the run model of a kind built on DFlash
    (DFlash2Model, LiLiCorrModel), whose ``draft_class`` says what it reads from the config and from its layout."""
    model_class = model_class or DFlashModel
    draft_class = model_class.draft_class
    target_dir, target, ident = draft_target(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    if cfg.init is not None:
        draft = draft_from_layout(init_dir(cfg.init), target, "draft.init", draft_class)
        check_init_keys(cfg, draft)
        return model_class(target, draft), target_dir, ident
    n = target.config.num_hidden_layers
    if n < 2:
        raise UserError(f"draft.target {target_dir} has {n} decoder layer; a {cfg.kind} draft reads states of "
                        "decoder layers before the last; accepted: a target with 2 or more layers")
    count = draft_class.settings.num_layers(cfg)
    layers = tuple(cfg.feature_layers) if cfg.feature_layers else default_feature_layers(n, count)
    check_feature_layers(layers, n, "draft.feature_layers")
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token(target.config.vocab_size,
                                                                                         data_vocab)
    draft = draft_class(target.config, layers, count, draft_class.settings.block_size(cfg), mask,
                        **draft_class.run_options(cfg))
    return model_class(target, draft), target_dir, ident


def check_init_keys(cfg, draft) -> None:
    """A ``draft.init`` run's keys, where set, are the initial draft's (DFlash's shape and ``draft.init_keys()``)."""
    for key, have in (("feature_layers", list(draft.feature_layers)), ("num_layers", draft.num_layers),
                      ("block_size", draft.block_size), ("mask_token_id", draft.mask_token_id), *draft.init_keys()):
        want = getattr(cfg, key)
        if want is not None and want != have:
            raise UserError(f"draft.{key} = {want} but draft.init {cfg.init} has {have}; accepted: draft.{key} unset "
                            "(the initial draft's) or equal to it")


def draft_from_layout(draft_dir, target, where: str, draft_class=None) -> DFlashDraft:
    """The draft (a ``draft_class``, DFlashDraft by default) a z-lab-layout directory holds, checked against
    ``target`` (a treadle export also by its target's config fingerprint, one trained elsewhere by its dimensions)."""
    from safetensors.torch import load_file

    from treadle.models.finite import check_tensors

    draft_class = draft_class or DFlashDraft
    # draft_class.speculators: a speculators-format draft read as the layout, for a kind speculators has
    config = draft_class.layout.read_config(draft_dir, draft_class.speculators)
    if config is None:
        raise UserError(f"{where} {draft_dir} is not a {draft_class.layout_name()}")
    if "target" in config:
        checked_export(draft_dir, target, draft_class.kind, f"a {draft_class.kind}")
    draft = draft_class(target.config, **draft_class.layout_spec(config, target.config, draft_dir))
    file = Path(draft_dir) / "model.safetensors"
    tensors = check_tensors(load_file(str(file)), file, where)
    draft.load_state_dict(draft_class.layout.import_weights(tensors, draft, draft_dir))
    return draft


def load_dflash(draft_dir, target, model_class=None) -> DFlashModel:
    """A DFlash draft in z-lab's layout (treadle's export, or one trained elsewhere for this target) attached to
    ``target`` (``model_class``: as ``build_dflash``'s)."""
    model_class = model_class or DFlashModel
    return model_class(target, draft_from_layout(draft_dir, target, "draft", model_class.draft_class)).eval()
