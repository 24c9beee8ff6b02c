"""A DSpine draft as a ``Drafter``: DFlash's one block forward (drafts/dflash/drafter.py: the context cache, the
block anchored at the bonus, the injection inside it), then the walk through slots 1..gamma (``DSpineModel.walk``).

Greedy: each slot's best candidate scored after the token picked before it (the anchor before slot 1), SpecForge's
``select_cached``. Sampled: each slot's token drawn from the softmax of those scores over its candidates (the
sampler's temperature and top-p applied); that row, zero off the candidates, depends on the earlier draws only and
is the slot's q, so speculative sampling stays exact.
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dspine.model import DSpineModel
from treadle.speculative.decode import Proposal
from treadle.speculative.sampling import Sampler


class DSpineDrafter(DFlashDrafter):
    name = "dspine"

    model: DSpineModel

    def draw(self, context_ids: torch.Tensor, gamma: int, sampler: Sampler) -> Proposal:
        hidden = self.block_hidden(context_ids)[0, :gamma]
        before = self.model.spine[0][0, 0, 1 : gamma + 1]
        tokens, qs = self.model.walk(hidden, before, int(context_ids[0, -1]), sampler.draw)
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))
