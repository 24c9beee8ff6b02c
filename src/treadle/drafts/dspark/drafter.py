"""A DSpark draft as a ``Drafter``: one backbone forward over the block, then the Markov head left to right.

The backbone is DFlash's (the context keys/values cached as dflash/drafter.py caches them). Slot k's logits are the
head on its hidden state plus the Markov bias of the token drawn at slot k - 1 (the bonus for slot 0), so each q row
is the distribution its token was drawn from given the drafts before it: chain verification stays exact.

Confidence early stop, as the engines serve it (both off by default: the whole block is verified):
- ``confidence_rule = "sglang"`` (SGLang's ``--speculative-dspark-confidence-threshold``, DeepSpec's eval): the
  drafts up to the first slot whose sigmoid(c_k) < threshold;
- ``"vllm"`` (vLLM's ``dspark_confidence_threshold``, ``spec_decode/dspark/capacity.py``): the drafts whose prefix
  survival prod_{i <= k} sigmoid(c_i) >= threshold.
"""

from __future__ import annotations

import dataclasses

import torch

from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dspark.model import DSparkModel
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler

RULES = ("sglang", "vllm")


def kept_drafts(confidence: torch.Tensor, threshold: float, rule: str) -> int:
    """How many leading drafts an engine verifies given the slots' confidence logits."""
    if threshold <= 0.0:
        return len(confidence)
    p = torch.sigmoid(confidence.double())
    keep = p >= threshold if rule == "sglang" else p.cumprod(0) >= threshold
    return int(keep.long().cumprod(0).sum())


class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    cuts_proposals = True  # a confidence threshold may propose fewer than gamma drafts (decode.py accepts it)

    def __init__(self, model: DSparkModel, confidence_threshold: float = 0.0, confidence_rule: str = "sglang"):
        super().__init__(model)
        if confidence_rule not in RULES:
            raise ValueError(f"confidence rule {confidence_rule!r}; accepted: {', '.join(RULES)}")
        self.confidence_threshold = confidence_threshold
        self.confidence_rule = confidence_rule
        self.last_confidence: torch.Tensor | None = None  # the latest block's confidence logits

    def block_hidden(self, context_ids: torch.Tensor) -> torch.Tensor:
        """The backbone's final hidden states [block_size, d] of the block anchored at the last token: every slot,
        the anchor's included (DFlash's ``block_states``)."""
        return self.block_states(context_ids)[0]

    @torch.inference_mode()
    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        if gamma > self.block_size:
            raise ValueError(f"gamma {gamma} exceeds what one DSpark forward proposes (block_size = "
                             f"{self.block_size}); accepted: --gamma <= {self.block_size}")
        self._absorb(context_ids, state)
        model, draft = self.model, self.model.draft_model
        hidden = self.block_hidden(context_ids)
        prev = context_ids[0, -1]
        tokens, qs, conf = [], [], []
        for k in range(gamma):
            embed = draft.markov_w1(prev)
            logits = model.slot_logits(hidden[k], embed).float()
            conf.append(draft.confidence_logit(hidden[k], embed).float())
            if sampler.greedy:
                token = int(logits.argmax())
            else:
                token, q = sampler.draw(logits)
                qs.append(q)
            tokens.append(token)
            prev = torch.tensor(token, device=context_ids.device)
        self.last_confidence = torch.stack(conf)
        n = kept_drafts(self.last_confidence, self.confidence_threshold, self.confidence_rule)
        return Proposal(tokens[:n], torch.stack(qs)[:n] if qs else None)


class StagesDrafter(DSparkDrafter):
    """DSpark stages a DeepSeek-V4 target ships (dspark/v4.py): the target's layer outputs averaged over their mHC
    streams, and the block reading the last ``window`` context rows only, as tokenspeed's window cache holds them."""

    name = "dspark-stages"

    def _absorb(self, context_ids: torch.Tensor, state: TargetState) -> None:
        hidden = getattr(state, "hidden", None)
        if hidden is not None and hidden.dim() == 4:  # [1, n, hc_mult, len * d]: each layer's streams averaged
            state = dataclasses.replace(state, hidden=hidden.mean(-2))
        super()._absorb(context_ids, state)

    def block_mask(self, anchor: int, device) -> torch.Tensor:
        keys = torch.arange(self.rows + self.block_size, device=device)
        seen = (keys >= self.rows) | (keys >= anchor - self.model.draft_model.window)  # context rows: 0 .. anchor - 1
        return seen.expand(1, 1, self.block_size, -1)
