"""DFlash2: DFlash (drafts/dflash/) plus grouped dynamic convolutions inside the block and a selector that walks one
path through each slot's top-k candidates.

Sources, part by part (facts only; the code is treadle's):

- **The backbone** is DFlash's, unchanged: fused target features as extra keys/values of every layer, a block of
  ``[anchor, MASK, ...]`` drafted in one bidirectional forward, the target's frozen embedding and head
  (drafts/dflash/model.py, and its sources).
- **The convolutions** follow z-lab's published weight contract (z-lab/dflash ``tests/fixtures/dflash2-config.json``
  and ``dflash2-safetensors-header.json``; the architecture at z-lab/dflash ``dflash/model.py`` @07ebd93, as cited by
  speculators PR #1006's ``docs/user_guide/algorithms/dflash2.md``), vLLM's loader (vllm-project/vllm
  ``vllm/model_executor/models/qwen3_dflash2.py`` @030da62: ``DFlashGroupedConv``, ``DFlash2Qwen3DecoderLayer``) and
  NeMo Automodel's trainer (NVIDIA-NeMo/Automodel PR #3605, ``nemo_automodel/components/speculative/dflash/
  draft_qwen3_dflash2.py`` @36044ad: ``GroupedDynamicCausalConv``). Each draft layer wraps its attention and its MLP
  sublayer each in one module: from the normed sublayer input ``h`` a linear map predicts, per slot, a correction of
  every tap for each group of ``conv_group_size`` channels, for both the convolution before the sublayer and the one
  after it; tap ``j`` of slot ``t`` is ``base_kernel[side, j] + correction[side, j, group]`` times the value at slot
  ``t - j`` of the same block (zero before the block's first slot: taps never cross blocks, so the training layout of
  N blocks end to end equals drafting one block). ``base_kernel`` [2, taps, d] (before, after), ``kernel_projection``
  [2 * taps * d / conv_group_size, d]. Built as the identity (unit first tap, zero projection: NeMo's start), so a
  new DFlash2 draft computes what the DFlash draft with its other weights does.
- **The selector** (the "Markov path" through candidates) follows the same three: per slot ``t`` the draft's
  ``selector_top_k`` best tokens ``b`` with their logits ``U_t(b)`` (after the target's logit transform, as vLLM's
  ``compute_candidates`` applies ``output_multiplier`` and ``final_logit_softcapping``), scored after predecessor
  ``a`` as ``S_t(a, b) = U_t(b) + <P[a] * W h_t, S[b]>`` (``predecessor_codebook`` P and ``successor_codebook`` S,
  [V, rank]; ``hidden_projection`` W [rank, d]; ``h_t`` the slot's final hidden state, what the head reads). The
  decode walks it: slot 1's predecessor is the anchor (the bonus token), slot t's the token picked at t - 1; greedy
  takes the best score, sampled draws from softmax(S_t(a, .) / T) over the candidates (vLLM's speculator: Gumbel-max
  over the realized scores, whose distribution is cached as the draft's q for rejection sampling; NeMo's
  ``dflash2_rejection_sample``). Built with a zero successor codebook (NeMo's start: the selector picks the draft's
  own argmax until trained).
- **The training loss** is NeMo's (``dflash2_core.py``: ``DFlash2TrainerModule``), in treadle's normalization:
  DFlash's slot loss (drafts/dflash/objective.py: ce / kl / mix, decay or D-PACE weights) plus ``selector_weight``
  times a cross-entropy over each slot's candidates, the predecessor teacher-forced (the data token before the slot:
  what the walk commits when every earlier slot was accepted), the label the data token's place among the candidates,
  weighted by the same slot weights; a slot whose data token is not among its candidates has no selector term (NeMo;
  speculators PR #1006 instead swaps the weakest candidate for it). Gradients of the selector term reach the backbone
  through ``U`` and ``h`` (NeMo). NeMo divides each term by its own weight sum; treadle sums both per row and the
  loop divides by the step's label tokens, like every draft loss. z-lab published no training objective (speculators
  PR #1006's doc says so).

The selector plugs into DFlash's hooks for a head on the slots' candidates (drafts/dflash/model.py):
``head_scores`` (its picks and CE beside the backbone's scores, from ``DFlashOutput.hidden`` and the candidates
``slot_top_k`` gives, whole logits or a chunk of rows at a time), ``slot_guesses`` (tau_sim's picks), and the
objective's ``row_loss``; the drafter reads ``block_hidden``. LiLiCorr's correlator uses the same hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.dflash.model import DFlashDraft, DFlashLayer, DFlashModel, DFlashOutput
from treadle.drafts.dflash2 import layout as dflash2_layout
from treadle.drafts.dflash2 import settings
from treadle.drafts.dflash2 import speculators as dflash2_speculators
from treadle.errors import UserError
from treadle.models.upcast import at_least_fp32

KIND = "dflash2"


class GroupedConv(nn.Module):
    """The two in-block convolutions around one sublayer (before: ``prepare``, after: ``finish``), their dynamic taps
    predicted once from the sublayer's input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset()

    def reset(self) -> None:
        """The identity: unit first tap, no other, no dynamic correction."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, correction: torch.Tensor, side: int) -> torch.Tensor:
        """``x`` [B, Q, d] (Q = whole blocks), ``correction`` [B, Q, taps, groups]: sum over taps j of (base + the
        slot's correction) times the value j slots earlier in the same block."""
        B, Q, d = x.shape
        if Q % self.block_size:
            raise RuntimeError(f"dflash2 convolution: {Q} rows are not whole blocks of {self.block_size}")
        blocks = x.view(B, Q // self.block_size, self.block_size, self.groups, self.group_size)
        taps = (self.base_kernel[side].view(self.taps, self.groups, self.group_size).to(x.dtype)
                + correction.view(B, Q // self.block_size, self.block_size, self.taps, self.groups, 1))
        out = taps[:, :, :, 0] * blocks
        for j in range(1, self.taps):  # slot t reads slot t - j of its own block; the first j slots read zeros
            out = out + taps[:, :, :, j] * F.pad(blocks[:, :, :-j], (0, 0, 0, 0, j, 0))
        return out.view(B, Q, d)

    # One ``forward`` for both convolutions: DeepSpeed ZeRO-3 gathers a module's own parameters (base_kernel) only
    # around its forward, never around another method.
    def forward(self, x: torch.Tensor, after: torch.Tensor | None = None):
        """The sublayer's input ``x`` -> (it convolved, the corrections for the convolution after the sublayer); with
        those corrections (``after``), the sublayer's output ``x`` -> it convolved."""
        if after is not None:
            return self._convolve(x, after, 1)
        correction = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self._convolve(x, correction[..., 0, :, :], 0), correction[..., 1, :, :]

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved sublayer input, the corrections ``finish`` applies after the sublayer)."""
        return self(h)

    def finish(self, y: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
        return self(y, correction)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with each sublayer's input and output convolved inside the block."""

    def __init__(self, s, block_size: int, taps: int, group_size: int):
        super().__init__(s)
        self.attention_conv = GroupedConv(s.hidden_size, taps, group_size, block_size)
        self.mlp_conv = GroupedConv(s.hidden_size, taps, group_size, block_size)

    def forward(self, x, context_kv, cos, sin, mask):
        h, after = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.attend(h, context_kv, cos, sin, mask), after)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.feed_forward(h), after)


class CandidateSelector(nn.Module):
    """S_t(a, b) = U_t(b) + <P[a] * W h_t, S[b]> over each slot's top-k candidates b after predecessor a."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Plain [V, rank] parameters, not nn.Embedding: the layout's names are ``candidate_selector.*_codebook``.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset(self, std: float) -> None:
        """A selector that adds nothing yet (zero successors) but trains from the first step (NeMo's start)."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, std)
            self.successor_codebook.zero_()
            self.hidden_projection.weight.normal_(0.0, std)

    def scores(self, hidden, unary, candidates, predecessors) -> torch.Tensor:
        return self(hidden, unary, candidates, predecessors)  # through forward: ZeRO-3 gathers the codebooks there

    def forward(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                predecessors: torch.Tensor) -> torch.Tensor:
        """[..., k] S(a, b) for slots with final hidden states ``hidden`` [..., d], candidates ``candidates`` [..., k]
        with logits ``unary`` [..., k], each after the token ``predecessors`` [...]."""
        gate = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        pair = torch.einsum("...r,...kr->...k", gate, F.embedding(candidates, self.successor_codebook))
        return at_least_fp32(unary) + at_least_fp32(pair)


class DFlash2Draft(DFlashDraft):
    """DFlash's draft with convolving layers and a candidate selector; with ``selector = False`` the convolving
    backbone alone (what another head on the slots' candidates reads: LiLiCorr + conv, vLLM's lilicorr.py building
    its layers as DFlash2's when the config has the conv keys)."""

    kind = KIND
    layout = dflash2_layout
    speculators = dflash2_speculators

    def __init__(self, target_config, feature_layers, num_layers: int = settings.dflash.NUM_LAYERS,
                 block_size: int = settings.dflash.BLOCK_SIZE, mask_token_id: int | None = None,
                 conv_kernel_size: int = settings.CONV_KERNEL_SIZE, conv_group_size: int = settings.CONV_GROUP_SIZE,
                 selector_rank: int = settings.SELECTOR_RANK, selector_top_k: int = settings.SELECTOR_TOP_K,
                 selector: bool = True):
        d, vocab = target_config.hidden_size, target_config.vocab_size
        if d % conv_group_size:
            raise UserError(f"draft.conv_group_size = {conv_group_size} does not divide the target's hidden size {d}; "
                            f"accepted: a divisor of {d}")
        if selector and not 1 <= selector_top_k <= vocab:
            raise UserError(f"draft.selector_top_k = {selector_top_k}; accepted: 1..{vocab} (the target's vocabulary)")
        if conv_kernel_size < 1 or conv_kernel_size > block_size:
            raise UserError(f"dflash_config.conv_kernel_size = {conv_kernel_size}; accepted: 1..{block_size} (the "
                            "block size)")
        self.conv_shape = (conv_kernel_size, conv_group_size)  # read by new_layer, inside DFlashDraft.__init__
        super().__init__(target_config, feature_layers, num_layers, block_size, mask_token_id)
        self.candidate_selector = CandidateSelector(vocab, d, selector_rank, selector_top_k) if selector else None
        if selector:
            self.candidate_selector.reset(getattr(target_config, "initializer_range", 0.02))
        for layer in self.layers:  # DFlashDraft's init_linears drew the projections: back to the identity
            layer.attention_conv.reset()
            layer.mlp_conv.reset()

    def new_layer(self, s) -> nn.Module:
        return DFlash2Layer(s, self.block_size, *self.conv_shape)

    @property
    def selector(self) -> CandidateSelector | None:
        return self.candidate_selector

    def drop_selector(self) -> DFlash2Draft:
        """This draft as the backbone of another head on its slots' candidates (a LiLiCorr correlator)."""
        self.candidate_selector = None
        return self

    @classmethod
    def run_options(cls, cfg) -> dict:
        return {"conv_group_size": settings.conv_group_size(cfg), "selector_rank": settings.selector_rank(cfg),
                "selector_top_k": settings.selector_top_k(cfg)}

    @classmethod
    def layout_options(cls, config: dict, target_config, where) -> dict:
        return dflash2_layout.options(config, target_config, where)

    def init_keys(self) -> tuple:
        conv = (("conv_group_size", self.conv_shape[1]),)
        if self.selector is None:
            return conv
        return (*conv, ("selector_rank", self.selector.hidden_projection.out_features),
                ("selector_top_k", self.selector.top_k))


@dataclass
class DFlash2Output(DFlashOutput):
    # With slot labels: per slot [B, N, K] the selector's CE over the candidates (0 where the label is not one of them
    # or the slot is not scored) and whether the label is among the candidates.
    selector_ce: torch.Tensor | None = None
    in_candidates: torch.Tensor | None = None


class DFlash2Model(DFlashModel):
    """What a dflash2 draft run trains: DFlashModel's forward, plus the selector's picks and loss per slot."""

    draft_class = DFlash2Draft

    def _picks(self, hidden: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor, predecessors: torch.Tensor):
        """(scores [..., k], each slot's pick [...]) with the given predecessors."""
        scores = self.draft_model.selector.scores(hidden, unary, ids, predecessors)
        return scores, ids.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1)

    def head_scores(self, out, input_ids, anchors, doc, features, slot_labels) -> DFlash2Output:
        """``hit`` is the selector's pick (its predecessor the data token before the slot) against the target's
        argmax, and with ``slot_labels`` the selector's CE per slot."""
        out = DFlash2Output(**{f.name: getattr(out, f.name) for f in fields(out)})
        K = out.hidden.shape[2]
        rows = (anchors[..., None] + torch.arange(K, device=anchors.device)).clamp_max(input_ids.shape[1] - 1)
        predecessors = input_ids.gather(1, rows.flatten(1)).view_as(rows)  # token a + k - 1 before slot k
        unary, ids, _ = self.slot_top_k(out.hidden, self.draft_model.selector.top_k, out.logits)
        scores, pick = self._picks(out.hidden, unary, ids, predecessors)
        top = out.teacher_top if out.teacher_top is not None else out.target_logits.argmax(-1)
        valid = slot_labels != IGNORE_INDEX if slot_labels is not None else torch.ones_like(pick, dtype=torch.bool)
        out.hit = (pick == top) & valid
        if slot_labels is not None:
            match = ids == slot_labels[..., None]
            out.in_candidates = match.any(-1) & valid
            nll = F.cross_entropy(scores.flatten(0, -2), match.long().argmax(-1).flatten(), reduction="none")
            out.selector_ce = nll.view_as(pick) * out.in_candidates
        return out

    def slot_guesses(self, texts, anchors, hidden, features, doc) -> torch.Tensor:
        """The selector's picks, each slot's predecessor the text's token before it: what the decode's walk proposes
        wherever the chain has been accepted up to that slot (all that a chain's acceptance counts)."""
        unary, ids, _ = self.slot_top_k(hidden, self.draft_model.selector.top_k)
        rows = (anchors[..., None] + torch.arange(hidden.shape[2], device=anchors.device)).clamp_max(texts.shape[1] - 1)
        return self._picks(hidden, unary, ids, texts.gather(1, rows.flatten(1)).view_as(rows))[1]

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, choose) -> tuple[list[int], list]:
        """The decode's path through slots 1..k: ``hidden`` [k, d] and ``logits`` [k, V] of the block's slots,
        ``anchor`` the bonus token, ``choose(row)`` -> (token, q or None) picks from a [V] row of scores that is
        -inf outside the slot's candidates (a ``Sampler``'s draw: the best, or a draw from softmax(S / T))."""
        selector = self.draft_model.selector
        unary, ids, _ = self.slot_top_k(hidden, selector.top_k, logits)
        tokens, qs, previous = [], [], anchor
        for t in range(hidden.shape[0]):
            scores = selector.scores(hidden[t], unary[t], ids[t], torch.tensor(previous, device=ids.device))
            row = torch.full((logits.shape[-1],), float("-inf"), dtype=scores.dtype, device=scores.device)
            token, q = choose(row.scatter(0, ids[t], scores))
            tokens.append(token)
            qs.append(q)
            previous = token
        return tokens, qs
