"""LiLiCorr: a block draft (DFlash's) whose top-k candidates per slot a small correlator reranks along a lattice.

Written from the design as ModelOpt PR #2342 trains it (NVIDIA/Model-Optimizer
``modelopt/torch/speculative/plugins/modeling_lilicorr.py`` and ``hf_lilicorr.py``) and vLLM serves it
(vllm-project/vllm ``vllm/model_executor/models/lilicorr.py`` @08f95fe5; arXiv 2608.20530):

A block draft scores each slot on its own (per-position marginals), so its per-slot argmaxes can be individually
likely and jointly incoherent. LiLiCorr keeps the backbone's top-k candidates at each of the block's slots and
scores paths through that lattice:

    per candidate c at slot s:  x = embed(c) + pass_proj(h_s) + feature_mlp(feature_norm(f_c)) + slot_s + rank_c
                                f_c = [log p(c), p(c), log p(c) - log p(top1), rank / (k - 1), [rank = 0]]
    ``layers`` pre-norm bidirectional attention layers over all slots x k candidates (an additive per-head bias by
    signed slot distance, plus a same-slot term), then output_norm;
    anchor a = anchor_norm(context_proj(c_{anchor - 1}))   the fused target row that predicted the anchor token
    u = silu(factor_input_proj([x ; a ; x * a]));  out = |out_head(u)|, in = |in_head(u)| (unit vectors)
    start[j] = scale * <|anchor_out_head(a)|, in[0, j]>,  pair[s, i, j] = scale * <out[s, i], in[s + 1, j]>

The draft proposes the greedy walk: slot 0's argmax of ``start``, then slot s's argmax of the pair row leaving the
pick before it (a prefix is what verification accepts, so the walk is greedy, not Viterbi). Sampled, each slot's
token is drawn from the softmax of that row over the slot's candidates (``drafter.py``).

The backbone is a parameter: ``LiLiCorrDraft`` wraps a block draft with DFlash's interface (``fuse``,
``context_kv``, ``forward``, ``block_size``, ``feature_layers``, ``mask_token_id``; ``backbone_class``, DFlash's
here), and ``LiLiCorrModel`` plugs the correlator into DFlash's hooks for a head on the slots' candidates
(drafts/dflash/model.py: ``head_scores``, ``slot_guesses``, ``slot_top_k``; the objective's ``row_loss``), the
ones DFlash2's selector uses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.dflash import settings as dflash_settings
from treadle.drafts.dflash.model import BlockDraftHooks, DFlashDraft, DFlashModel, DFlashOutput
from treadle.drafts.dflash2 import settings as dflash2_settings
from treadle.drafts.dflash2.model import DFlash2Draft
from treadle.drafts.glide.model import RMSNorm, init_linears
from treadle.drafts.lilicorr import layout as lilicorr_layout
from treadle.drafts.lilicorr import settings
from treadle.drafts.targets import head_rows
from treadle.errors import UserError
from treadle.models.chunked_ce import model_logits
from treadle.models.upcast import at_least_fp32

KIND = "lilicorr"
FEATURES = 5  # per candidate: log p, p, the gap to the slot's best, the rank fraction, is-top-1
MLP_RATIO = 2.0
LOGIT_SCALE = 8.0  # fixed, not learned: the factors are cosines, this is how sharp the chain may get (ModelOpt's)
VECTOR_EPS = 1e-4
FACTOR_STD = 0.02  # the factor heads start small, not zero: a zero bilinear product has no gradient (ModelOpt)


def correlator_heads(width: int) -> int:
    """The lattice attention's heads: the most of 8, 4, 2, 1 that divides the width."""
    return next(h for h in (8, 4, 2, 1) if width % h == 0)


def geometry_of(width: int, candidates: int, layers: int) -> dict:
    """The ``lilicorr_*`` keys of treadle's correlator on a draft of this width (its heads, factor width, MLP ratio,
    scale and eps follow from the width)."""
    return {"lilicorr_candidate_topk": candidates, "lilicorr_hidden_size": width, "lilicorr_num_layers": layers,
            "lilicorr_num_heads": correlator_heads(width), "lilicorr_mlp_ratio": MLP_RATIO,
            "lilicorr_factor_dim": min(128, width), "lilicorr_vector_eps": VECTOR_EPS,
            "lilicorr_logit_scale": LOGIT_SCALE}


class LatticeAttention(nn.Module):
    """Full (unmasked) attention over the flattened lattice with a learned additive bias; q/k/v in one packed
    projection, as nn.MultiheadAttention and vLLM's ``LiLiCorrLatticeAttention`` hold them."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)[None])
        return self.out_proj(out.transpose(1, 2).reshape(B, S, d))


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: int, outputs: int):
        super().__init__()
        self.up_proj = nn.Linear(inputs, hidden)
        self.down_proj = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class CorrelatorLayer(nn.Module):
    def __init__(self, width: int, heads: int, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, heads)
        self.mlp_norm = RMSNorm(width, eps=eps)
        self.mlp = MLP(width, int(width * MLP_RATIO), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class Correlator(nn.Module):
    """The lattice scorer (the parameters vLLM's ``LiLiCorrHead`` loads, by its names and shapes; the head is as
    wide as the draft, so ``token_proj`` is the identity and has no tensor)."""

    def __init__(self, width: int, block_size: int, candidates: int, num_layers: int, eps: float, target_config):
        super().__init__()
        self.width, self.block_size, self.candidates = width, block_size, candidates
        self.heads = correlator_heads(width)
        self.factor_dim = geometry_of(width, candidates, num_layers)["lilicorr_factor_dim"]
        self.logit_scale, self.vector_eps = LOGIT_SCALE, VECTOR_EPS
        slots = block_size - 1
        self.pass_hidden_proj = nn.Linear(width, width)
        self.feature_norm = nn.LayerNorm(FEATURES)
        self.feature_mlp = MLP(FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, candidates, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.heads))
        self.context_proj = nn.Linear(width, width)
        self.layers = nn.ModuleList(CorrelatorLayer(width, self.heads, eps) for _ in range(num_layers))
        self.output_norm = RMSNorm(width, eps=eps)
        self.anchor_norm = RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, self.factor_dim)
        self.in_head = nn.Linear(width, self.factor_dim)
        self.anchor_out_head = nn.Linear(width, self.factor_dim)
        init_linears(self, target_config)
        std = getattr(target_config, "initializer_range", 0.02)
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=std)
        for head in (self.out_head, self.in_head, self.anchor_out_head):
            nn.init.normal_(head.weight, std=FACTOR_STD)

    def geometry(self) -> dict:
        """The ``dflash_config.lilicorr_*`` keys vLLM rebuilds this head from (all of them: the scale and eps change
        the scores without changing a shape, so a default guessed for them would load and score another function)."""
        return geometry_of(self.width, self.candidates, len(self.layers))

    def _bias(self, slots: int, dtype) -> torch.Tensor:
        """[heads, slots * k, slots * k]: a learned scalar per head and signed slot distance, plus one for
        candidates of the same slot. Fewer slots than trained (a shorter draft) read the same distances' scalars."""
        ids = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.candidates)
        rel = ids[:, None] - ids[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        return (bias + (rel == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]).to(dtype)

    def forward(self, token_embeds: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
                anchor: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(start [B, k], pair [B, S - 1, k, k]) log-potentials (fp32) of B lattices of S slots (1 <= S <= the
        block's slots): candidates' embeddings [B, S, k, d], their backbone log-probabilities [B, S, k] (best
        first), the backbone's slot hidden states [B, S, d], the fused anchor rows [B, d] (zeroed where
        ``anchor_valid`` [B] is false: no committed row before the anchor in its document)."""
        B, S, k = log_probs.shape
        lp = at_least_fp32(log_probs)
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype) / max(k - 1, 1)
        features = torch.stack((lp, lp.exp(), lp - lp.amax(-1, keepdim=True), rank.expand_as(lp),
                                (rank == 0).to(lp.dtype).expand_as(lp)), -1)
        dtype = self.pass_hidden_proj.weight.dtype
        x = token_embeds.to(dtype) + self.pass_hidden_proj(pass_hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(features.to(dtype)))
        x = x + self.slot_embedding[:, 0, :S] + self.rank_embedding[:, 0]
        x = x.reshape(B, S * k, self.width)
        bias = self._bias(S, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(B, S, k, self.width)
        a = self.context_proj(anchor.to(dtype)) * anchor_valid[:, None].to(dtype)
        a = self.anchor_norm(a)
        rows = a[:, None, None].expand_as(x)
        u = F.silu(self.factor_input_proj(torch.cat((x, rows, x * rows), -1)))
        out = F.normalize(self.out_head(u), dim=-1, eps=self.vector_eps)
        inn = F.normalize(self.in_head(u), dim=-1, eps=self.vector_eps)
        a_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)
        start = (a_out[:, None] * inn[:, 0]).sum(-1)
        pair = out[:, :-1] @ inn[:, 1:].transpose(-1, -2)
        return self.logit_scale * at_least_fp32(start), self.logit_scale * at_least_fp32(pair)


def greedy_walk(start: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """[B, S] candidate indices of the served path: slot 0's best start, then each slot's best pair row leaving the
    pick before it."""
    pick = [start.argmax(-1)]
    for s in range(pair.shape[1]):
        pick.append(pair[:, s].gather(1, pick[-1][:, None, None].expand(-1, 1, pair.shape[-1])).squeeze(1).argmax(-1))
    return torch.stack(pick, -1)


def teacher_scores(model, out, ids: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's logits at the candidates [..., k] and at the data tokens [...]) from ``out``'s teacher rows: its
    whole logits, or with the chunked loss its final hidden states (then only the head's rows in play are
    multiplied)."""
    with torch.no_grad():
        if out.target_logits is not None:
            teacher = out.target_logits
            return teacher.gather(-1, ids), teacher.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)
        rows = torch.cat((ids, tokens.clamp_min(0)[..., None]), -1)
        weights = head_rows(model.target, rows)
        picked = model_logits(model.target.config, (out.teacher_hidden[..., None, :] * weights).sum(-1))
        return picked[..., :-1], picked[..., -1]


def lattice_terms(start: torch.Tensor, pair: torch.Tensor, truth: torch.Tensor, teacher_cand: torch.Tensor,
                  teacher_truth: torch.Tensor):
    """Per slot [..., S]: the lattice CE and the penalty along the data's path (``truth``: its candidate index per
    slot, any index where it is not a candidate)."""
    lead = start.shape[:-1]
    k = start.shape[-1]
    rows = [start]
    for s in range(pair.shape[-3]):
        leaving = truth[..., s, None, None].expand(*lead, 1, k)
        rows.append(pair[..., s, :, :].gather(-2, leaving).squeeze(-2))
    node = torch.stack(rows, -2)  # [..., S, k]
    logp = F.log_softmax(node, -1)
    ce = -logp.gather(-1, truth[..., None]).squeeze(-1)
    w = (teacher_truth[..., None] - teacher_cand).clamp_min(0.0)
    return ce, (logp.exp() * w).sum(-1)


class LiLiCorrDraft(BlockDraftHooks, nn.Module):
    """What a lilicorr run trains: a block draft (``backbone``) and its correlator (``lilicorr``). It passes the
    backbone's interface through, so the backbone's run model and drafter use it unchanged, and it is built and
    loaded as DFlash's run model builds its ``draft_class`` (drafts/dflash/model.py: ``build_dflash``,
    ``draft_from_layout``): from the backbone's shape plus ``run_options`` / ``layout_options``.

    The backbone is DFlash's, or with ``conv_group_size`` DFlash2's convolving one without its selector (LiLiCorr +
    conv: vLLM's lilicorr.py builds DFlash2's decoder layers when dflash_config has conv_kernel_size and
    conv_group_size); its own layout module writes and reads its tensors and keys (``backbone.layout``)."""

    kind = KIND
    layout = lilicorr_layout
    speculators = None  # speculators 0.9.0 has no LiLiCorr class

    def __init__(self, target_config, feature_layers, num_layers: int = dflash_settings.NUM_LAYERS,
                 block_size: int = dflash_settings.BLOCK_SIZE, mask_token_id: int | None = None,
                 candidates: int = settings.CANDIDATES, correlator_layers: int = settings.CORRELATOR_LAYERS,
                 conv_kernel_size: int = 0, conv_group_size: int = 0, backbone: DFlashDraft | None = None):
        """A new backbone of that shape, or ``backbone`` (a trained one, whose shape it is) under a new correlator."""
        super().__init__()
        if backbone is None and conv_group_size:
            backbone = DFlash2Draft(target_config, feature_layers, num_layers, block_size, mask_token_id,
                                    conv_kernel_size or dflash2_settings.CONV_KERNEL_SIZE, conv_group_size,
                                    selector=False)
        elif backbone is None:
            backbone = DFlashDraft(target_config, feature_layers, num_layers, block_size, mask_token_id)
        if getattr(backbone, "selector", None) is not None:
            raise ValueError("a LiLiCorr backbone has no selector of its own (the correlator picks the path)")
        if candidates > target_config.vocab_size:
            raise UserError(f"draft.candidates = {candidates} exceeds the target's vocabulary "
                            f"({target_config.vocab_size})")
        self.backbone = backbone
        self.lilicorr = Correlator(backbone.shape.hidden_size, backbone.block_size, candidates, correlator_layers,
                                   backbone.shape.rms_norm_eps, target_config)

    # the backbone's interface (drafts/dflash/model.py's DFlashDraft), what DFlashModel and DFlashDrafter call
    block_size = property(lambda self: self.backbone.block_size)
    mask_token_id = property(lambda self: self.backbone.mask_token_id)
    feature_layers = property(lambda self: self.backbone.feature_layers)
    num_layers = property(lambda self: self.backbone.num_layers)
    shape = property(lambda self: self.backbone.shape)
    target_vocab_size = property(lambda self: self.backbone.target_vocab_size)

    @property
    def checkpoint_kwargs(self):
        return self.backbone.checkpoint_kwargs

    @checkpoint_kwargs.setter
    def checkpoint_kwargs(self, value) -> None:  # models/checkpointing.py: the backbone's layers are checkpointed
        self.backbone.checkpoint_kwargs = value

    @property
    def conv_shape(self) -> tuple[int, int] | None:
        """(taps, group size) of a convolving backbone's layers, None for DFlash's."""
        return getattr(self.backbone, "conv_shape", None)

    @classmethod
    def run_options(cls, cfg) -> dict:
        return {"candidates": settings.candidates(cfg), "correlator_layers": settings.correlator_layers(cfg),
                "conv_group_size": settings.conv_group_size(cfg)}

    @classmethod
    def layout_options(cls, config: dict, target_config, where) -> dict:
        """The correlator's width and depth and the backbone's convolutions from a LiLiCorrDraftModel config.json,
        whose head must be the one treadle builds for this target's width."""
        geometry = lilicorr_layout.geometry(config, where)
        candidates, layers = int(geometry["lilicorr_candidate_topk"]), int(geometry["lilicorr_num_layers"])
        lilicorr_layout.check_head(geometry, geometry_of(target_config.hidden_size, candidates, layers), where)
        return {"candidates": candidates, "correlator_layers": layers, **lilicorr_layout.conv_keys(config, where)}

    def init_keys(self) -> tuple:
        conv = self.conv_shape
        return (("candidates", self.lilicorr.candidates), ("correlator_layers", len(self.lilicorr.layers)),
                ("conv_group_size", conv[1] if conv else None))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.backbone.fuse(features)

    def context_kv(self, context, rope):
        return self.backbone.context_kv(context, rope)

    def forward(self, embeds, rope, context_kv, mask):
        return self.backbone(embeds, rope, context_kv, mask)

    def export_config(self) -> dict:
        return {"treadle_draft_kind": self.kind}


@dataclass
class LiLiCorrOutput(DFlashOutput):
    # The correlator's lattice over the slots' candidates: ids [B, N, K, k], start [B, N, k], pair [B, N, K - 1, k, k].
    candidates: torch.Tensor | None = None
    start: torch.Tensor | None = None
    pair: torch.Tensor | None = None
    # With slot labels, per slot [B, N, K]: the lattice CE and penalty along the data's path (0 where not
    # supervised), whether a slot is supervised, and whether the backbone's own argmax is the target's greedy token.
    lattice_ce: torch.Tensor | None = None
    lattice_penalty: torch.Tensor | None = None
    supervised: torch.Tensor | None = None
    top1_hit: torch.Tensor | None = None


class LiLiCorrModel(DFlashModel):
    """A lilicorr run's model: the frozen target, the block draft and its correlator, on DFlash's hooks for a head on
    the slots' candidates (``head_scores``, ``slot_guesses``, ``slot_top_k``)."""

    draft_class = LiLiCorrDraft

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, log-probs) [..., k] of slot hidden states [..., d] through the shared head (best first; the
        log-probs differentiable: in a joint run they train the backbone)."""
        top, ids, norm = self.slot_top_k(hidden, self.draft_model.lilicorr.candidates)
        return ids, top - norm[..., None]

    def anchor_rows(self, features: torch.Tensor, anchors: torch.Tensor, doc: torch.Tensor):
        """([B, N, d] fused target rows at anchor - 1, [B, N] whether that row is in the anchor's document): the
        committed row that predicted the anchor token, the newest the target has when the block is drafted."""
        before = (anchors - 1).clamp_min(0)
        valid = (anchors >= 1) & (doc.gather(1, before) == doc.gather(1, anchors))
        rows = features.gather(1, before[..., None].expand(-1, -1, features.shape[-1]))
        return self.draft_model.fuse(rows), valid

    def lattice(self, hidden: torch.Tensor, ids: torch.Tensor, log_probs: torch.Tensor, anchor: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(start [B, N, k], pair [B, N, S - 1, k, k]) of blocks' first S slots: hidden [B, N, S, d], candidates
        [B, N, S, k], anchor rows [B, N, d]."""
        B, N, S, k = ids.shape
        embeds = self.target.get_input_embeddings()(ids).detach()  # an input: the target's table never trains
        start, pair = self.draft_model.lilicorr(embeds.flatten(0, 1), log_probs.flatten(0, 1), hidden.flatten(0, 1),
                                                anchor.flatten(0, 1), valid.flatten())
        return start.view(B, N, k), pair.view(B, N, S - 1, k, k)

    def _walk(self, hidden, anchors, features, doc):
        """(candidates [B, N, S, k], start, pair, the greedy walk's tokens [B, N, S]) of blocks' slot states."""
        ids, lp = self.candidates(hidden)
        anchor, valid = self.anchor_rows(features, anchors, doc)
        start, pair = self.lattice(hidden, ids, lp, anchor, valid)
        B, N, S, k = ids.shape
        pick = greedy_walk(start.flatten(0, 1), pair.flatten(0, 1)).view(B, N, S)
        return ids, start, pair, ids.gather(-1, pick[..., None]).squeeze(-1)

    def head_scores(self, out, input_ids, anchors, doc, features, slot_labels) -> LiLiCorrOutput:
        """``hit``: the served walk's pick is the target's greedy token; with ``slot_labels`` the lattice terms along
        the data's path (teacher forcing), at slots whose data tokens are in the lattice there and at every slot
        before it (past the first miss no path can be right), in blocks whose every slot is scored."""
        out = LiLiCorrOutput(**{f.name: getattr(out, f.name) for f in fields(out)})
        ids, out.start, out.pair, walked = self._walk(out.hidden, anchors, features, doc)
        out.candidates = ids
        top = out.teacher_top if out.teacher_top is not None else out.target_logits.argmax(-1)
        scored = slot_labels != IGNORE_INDEX if slot_labels is not None else torch.ones_like(walked, dtype=torch.bool)
        out.hit = (walked == top) & scored
        out.top1_hit = (ids[..., 0] == top) & scored
        if slot_labels is not None:
            in_lattice = ids == slot_labels[..., None]
            out.supervised = in_lattice.any(-1).long().cumprod(-1).bool() & scored.all(-1, keepdim=True)
            ce, penalty = lattice_terms(out.start, out.pair, in_lattice.long().argmax(-1),
                                        *teacher_scores(self, out, ids, slot_labels))
            out.lattice_ce, out.lattice_penalty = ce * out.supervised, penalty * out.supervised
        return out

    def slot_guesses(self, texts, anchors, hidden, features, doc) -> torch.Tensor:
        """The served proposals (tau_sim's): the greedy walk through the first gamma slots' lattice."""
        return self._walk(hidden, anchors, features, doc)[3]


def build_draft(backbone: DFlashDraft, target_config, candidates: int, layers: int) -> LiLiCorrDraft:
    """A new correlator on ``backbone`` (a trained block draft: a lilicorr run's ``draft.init`` in DFlash's layout,
    or DFlash2's without its selector)."""
    return LiLiCorrDraft(target_config, backbone.feature_layers, backbone.num_layers, backbone.block_size,
                         backbone.mask_token_id, candidates, layers, backbone=backbone)
