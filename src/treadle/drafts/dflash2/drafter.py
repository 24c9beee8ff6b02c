"""A DFlash2 draft as a ``Drafter``: DFlash's one block forward (drafts/dflash/drafter.py: the context cache, the
block anchored at the bonus), then the selector's walk through slots 1..gamma (``DFlash2Model.walk``).

Greedy: each slot's best-scoring candidate after the token picked before it (the anchor before slot 1), as vLLM's
DFlash2 speculator walks (``_selector_walk_kernel``, temperature 0). Sampled: each slot's token drawn from
softmax(S_t(previous, .) / T) over its candidates (the sampler's top-p applied to that row), and that row, zero
outside the candidates, is the slot's q: the distribution its token came from given the tokens drawn before it,
which is what sampled verification needs for a chain (vLLM caches the same realized scores as its draft logits).
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dflash2.model import DFlash2Model
from treadle.speculative.decode import Proposal
from treadle.speculative.sampling import Sampler


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"

    model: DFlash2Model

    def draw(self, context_ids: torch.Tensor, gamma: int, sampler: Sampler) -> Proposal:
        hidden = self.block_hidden(context_ids)[0, :gamma]
        tokens, qs = self.model.walk(hidden, self.model.draft_logits(hidden), int(context_ids[0, -1]),
                                     sampler.draw)
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))
