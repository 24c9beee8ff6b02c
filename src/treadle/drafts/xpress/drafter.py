"""An XPress draft as a ``Drafter``: DFlash's block forward (drafts/dflash/drafter.py, its context cache and
hand-over), then the refiner's Jacobi passes over the whole block (xpress/model.py), as vLLM PR #54448 serves it:
the proposal is the last pass's slots 1..gamma.

Sampled: slot k's token is drawn from the last pass's row k, which depends on the context and on argmaxes only,
never on a token drawn in this proposal: each q row is the distribution its token came from, so speculative
sampling stays exact.
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.drafter import DFlashDrafter


class XPressDrafter(DFlashDrafter):
    name = "xpress"

    def block_logits(self, context_ids: torch.Tensor) -> torch.Tensor:
        """The served logits [block_size - 1, V] of slots 1.. of the block anchored at the last token."""
        blocks = self.block_states(context_ids)[None]  # [1, 1, block, d]
        return self.model.served(blocks, context_ids[:, -1:])[0, 0, 1:].float()
