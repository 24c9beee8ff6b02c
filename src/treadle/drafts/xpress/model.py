"""XPress: DFlash's block draft plus a causal refiner that adds a logit bias to every slot, resolved by Jacobi passes.

Written from the method as speculators 0.9.0 trains it (``speculators/models/xpress/{config,core,metrics,
model_definitions}.py``, PyPI wheel built 2026-10-15; speculators PR #1061 / RFC #1051; arXiv 2608.02438) and
vLLM PR #54448 describes serving it:

    base_k  = head(h_k)                                the backbone's slot logits (DFlash's, the target's head)
    a_k     = in_proj([down_h(h_k) ; down_g(mean_j h_j) ; embed(prev_k)])        rank r, per slot k of the block
    c_k     = a_k + sum_{j <= k} L[:, k, j] * a_j      per bottleneck channel: the causal block mixer (tril of L)
    bias_k  = readout(c_k + MLP(c_k))                  SwiGLU MLP in the bottleneck, a projection to the vocabulary
    logits_k = base_k + bias_k

``prev_k`` is the token before slot k: the anchor at slot 1, then the tokens the block proposes; slot 0 (the
anchor's own row, never scored, reaching the drafts through the mixer's first column) reads the anchor too, as vLLM
PR #54448 serves it (``xpress/speculator.py``: the anchor's predecessor is not in reach of its drafter, so the anchor
stands in for it); speculators' trainer feeds the token before the anchor there, and treadle trains what the engine
serves. The slots follow DFlash's convention (slot k guesses the token at anchor + k; slot 0 is never scored),
speculators' ``sample_from_anchor = false``.

Jacobi passes (what decode serves): start from the backbone's argmax, then ``passes`` times set slot 0 to the anchor,
feed the refiner the previous pass's argmax as ``prev`` and take the refined argmax; the last pass's logits are the
proposal's. They depend on the context alone (argmaxes, never drawn tokens): a sampled proposal draws every slot from
its own row and speculative sampling stays exact. Training (xpress/objective.py) runs the refiner teacher-forced
(``prev`` = the data's tokens) and then free-running for a few rounds, the same recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from treadle.drafts.dflash.model import DFlashDraft, DFlashModel, DFlashOutput
from treadle.drafts.xpress import settings
from treadle.drafts.xpress import layout as xpress_layout
from treadle.models.chunked_ce import chunked_rows
from treadle.models.upcast import at_least_fp32

KIND = "xpress"


class Refiner(nn.Module):
    """The refiner head; its parameter names are speculators' ``XPressRefinerHead``'s (the layout keeps them)."""

    def __init__(self, hidden_size: int, vocab_size: int, block_size: int, rank: int, mlp_ratio: int, std: float):
        super().__init__()
        self.rank, self.mlp_ratio = rank, mlp_ratio
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))  # zero: the mixer starts as a no-op
        self.mlp_gate = nn.Linear(rank, mlp_ratio * rank, bias=False)
        self.mlp_up = nn.Linear(rank, mlp_ratio * rank, bias=False)
        self.mlp_down = nn.Linear(mlp_ratio * rank, rank, bias=False)
        self.readout = nn.Linear(rank, vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)

    def summary(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., block, 2r]: each slot's projection beside the block's mean's; the same for every pass."""
        hidden = hidden.to(self.down_h.weight.dtype)
        return torch.cat((self.down_h(hidden), self.down_g(hidden.mean(-2, keepdim=True)).expand(
            *hidden.shape[:-1], self.rank)), -1)

    def forward(self, summary: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The logit bias [..., block, V] of slots whose previous tokens are ``prev`` [..., block]."""
        x = self.in_proj(torch.cat((summary, self.token_embed(prev).to(summary.dtype)), -1))
        block = x.shape[-2]
        causal = torch.ones(block, block, dtype=torch.bool, device=x.device).tril()
        x = x + torch.einsum("ckj,...jc->...kc", self.mix_l * causal, x)
        x = x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))
        return self.readout(x)


class XPressDraft(DFlashDraft):
    """The DFlash backbone plus ``refiner_head``."""

    kind = KIND
    settings = settings

    def __init__(self, target_config, feature_layers: tuple[int, ...], num_layers: int = settings.dflash.NUM_LAYERS,
                 block_size: int = settings.dflash.BLOCK_SIZE, mask_token_id: int | None = None,
                 rank: int = settings.RANK, mlp_ratio: int = settings.MLP_RATIO,
                 jacobi_passes: int = settings.JACOBI_PASSES):
        super().__init__(target_config, feature_layers, num_layers, block_size, mask_token_id)
        self.jacobi_passes = jacobi_passes
        self.refiner_head = Refiner(self.shape.hidden_size, target_config.vocab_size, block_size, rank, mlp_ratio,
                                    getattr(target_config, "initializer_range", 0.02))

    layout = xpress_layout  # vLLM's Qwen3XPressModel layout, speculators' read too (xpress/layout.py)
    speculators = None  # no table passed in: the layout reads speculators' format itself
    layout_name = staticmethod(xpress_layout.layout_name)
    layout_spec = staticmethod(xpress_layout.read_spec)

    def refiner_keys(self) -> dict:
        """The refiner's shape as speculators' config states it."""
        head = self.refiner_head
        return {"xpress_rank": head.rank, "xpress_mlp_ratio": head.mlp_ratio, "num_jacobi_passes": self.jacobi_passes}


@dataclass
class XPressOutput(DFlashOutput):
    # Per slot [B, N, K] with slot labels (0 where not scored): the refiner's loss teacher-forced and the mean of its
    # free-running rounds' (CE_WEIGHT * CE + TV_WEIGHT * TV against the target), and its teacher-forced CE.
    refined: torch.Tensor | None = None
    rounds: torch.Tensor | None = None
    refined_ce: torch.Tensor | None = None


def jacobi(refiner: Refiner, base: torch.Tensor, summary: torch.Tensor, anchor: torch.Tensor, passes: int):
    """The refined logits [..., block, V] of each of ``passes`` Jacobi passes (yielded in turn) over blocks whose
    backbone logits are ``base`` [..., block, V] and whose anchors are ``anchor`` [...]."""
    pick = base.detach().argmax(-1)
    for _ in range(passes):
        prev = torch.cat((anchor[..., None], anchor[..., None], pick[..., 1:-1]), -1)
        refined = base + refiner(summary, prev).to(base.dtype)
        yield refined
        pick = refined.detach().argmax(-1)


def refiner_loss(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per slot CE_WEIGHT * CE(draft, the target's argmax) + TV_WEIGHT * TV(draft, target), fp32."""
    logp, teacher_p = F.log_softmax(at_least_fp32(logits), -1), F.softmax(at_least_fp32(teacher), -1)
    ce = -logp.gather(-1, teacher_p.argmax(-1, keepdim=True)).squeeze(-1)
    tv = 0.5 * (logp.exp() - teacher_p).abs().sum(-1)
    return settings.CE_WEIGHT * ce + settings.TV_WEIGHT * tv


class XPressModel(DFlashModel):
    """An xpress run's model: the frozen target and the block draft with its refiner, on DFlash's hooks for a head
    (``head_scores`` for training, ``block_guesses`` for tau_sim)."""

    draft_class = XPressDraft

    def slot_logits(self, blocks: torch.Tensor) -> torch.Tensor:
        """The backbone's logits [..., block, V] of blocks' every slot (the shared head, the target's transform)."""
        return self.draft_logits(blocks)

    def served(self, blocks: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The logits [..., block, V] decode proposes from: the last of the draft's Jacobi passes."""
        refiner = self.draft_model.refiner_head
        base = self.slot_logits(blocks)
        out = base
        for out in jacobi(refiner, base, refiner.summary(blocks), anchor, self.draft_model.jacobi_passes):
            pass
        return out

    def _block_terms(self, blocks, teacher, tf_prev, anchor, scored, teacher_is_hidden: bool):
        """Per block and slot 1.. (first dimension: blocks): the refiner's teacher-forced loss, its free-running
        rounds' mean loss, its teacher-forced CE on the target's argmax and whether the served argmax is the
        target's (what ``head_scores`` computes, a chunk of blocks at a time)."""
        refiner = self.draft_model.refiner_head
        if teacher_is_hidden:
            with torch.no_grad():
                teacher = self.draft_logits(teacher)
        base = self.slot_logits(blocks)
        summary = refiner.summary(blocks)
        tf = (base + refiner(summary, tf_prev).to(base.dtype))[:, 1:]
        refined = refiner_loss(tf, teacher)
        rounds = [refiner_loss(r[:, 1:], teacher) for r in jacobi(refiner, base, summary, anchor,
                                                                   settings.CONSISTENCY_PASSES)]
        with torch.no_grad():
            last = base
            for last in jacobi(refiner, base, summary, anchor, self.draft_model.jacobi_passes):
                pass
            hit = last[:, 1:].argmax(-1) == teacher.argmax(-1)
            ce = -F.log_softmax(at_least_fp32(tf), -1).gather(-1, teacher.argmax(-1, keepdim=True)).squeeze(-1)
        mean = torch.stack(rounds).mean(0) if rounds else torch.zeros_like(refined)
        return refined * scored, mean * scored, ce * scored, hit & scored.bool()

    def head_scores(self, out, input_ids, anchors, doc, features, slot_labels) -> XPressOutput:
        """The refiner's terms and the served Jacobi argmax as ``hit`` (its agreement with the target's greedy token
        is what the acceptance metrics count)."""
        out = XPressOutput(**{f.name: getattr(out, f.name) for f in fields(out)})
        blocks = torch.cat((out.anchor_hidden[:, :, None], out.hidden), 2)
        B, N, S, _ = blocks.shape
        anchor = input_ids.gather(1, anchors)
        rows = (anchors[..., None] + torch.arange(S - 1, device=anchors.device)).clamp_max(input_ids.shape[1] - 1)
        tf_prev = torch.cat((anchor[..., None], input_ids.gather(1, rows.flatten(1)).view(B, N, S - 1)), -1)
        scored = (slot_labels != -100) if slot_labels is not None else torch.ones(B, N, S - 1, dtype=torch.bool,
                                                                                  device=blocks.device)
        teacher_is_hidden = out.target_logits is None
        teacher = out.teacher_hidden if teacher_is_hidden else out.target_logits
        flat = [x.flatten(0, 1) for x in (blocks, teacher, tf_prev, anchor, scored.to(blocks.dtype))]

        def terms(*chunk):
            return self._block_terms(*chunk, teacher_is_hidden=teacher_is_hidden)

        chunk = max(1, self.loss_chunk_tokens // S) if self.loss_chunk_tokens else 0
        refined, rounds, ce, hit = chunked_rows(terms, flat, chunk) if chunk else terms(*flat)
        out.refined, out.rounds, out.refined_ce = (x.view(B, N, S - 1) for x in (refined, rounds, ce))
        out.hit = hit.view(B, N, S - 1)
        return out

    def block_guesses(self, texts, anchors, blocks, features, doc, gamma: int) -> torch.Tensor:
        """tau_sim's guesses: the served Jacobi argmax of slots 1..gamma."""
        return self.served(blocks, texts.gather(1, anchors))[:, :, 1 : gamma + 1].argmax(-1)
