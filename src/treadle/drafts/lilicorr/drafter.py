"""A LiLiCorr draft as a ``Drafter``: DFlash's block forward (drafts/dflash/drafter.py, its context cache and
hand-over), then the correlator over the first gamma slots' top-k candidates, and the walk through that lattice.

As vLLM serves it (``lilicorr.py``: 1 <= num_speculative_tokens < block_size, a shorter draft scoring the learned
prefix of slots): the lattice holds the first gamma slots only, so at gamma < block_size - 1 the correlator sees
fewer slots than it was trained on, exactly as in the engine. The anchor row is the fused target row before the
bonus (the newest the target has processed), kept from the last hand-over.

Greedy: slot 0's best start, then each slot's best pair row leaving the pick before it. Sampled: slot s's token is
drawn (the sampler's temperature and top-p) from the softmax of its row over the slot's k candidates, the row
leaving the token drawn at s - 1; that distribution (zero off the candidates) is the q row verification uses, and
it depends on the earlier draws only, never on the token it draws: speculative sampling stays exact.
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.lilicorr.model import greedy_walk
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler


class LiLiCorrDrafter(DFlashDrafter):
    name = "lilicorr"

    def reset(self, prompt_ids) -> None:
        super().reset(prompt_ids)
        self.anchor: torch.Tensor | None = None  # [1, 1, d]: the fused row at the bonus's index - 1

    def _absorb(self, context_ids: torch.Tensor, state: TargetState) -> None:
        super()._absorb(context_ids, state)
        features = state.hidden
        if features.shape[1]:
            self.anchor = self.model.draft_model.fuse(features[:, -1:])

    def lattice(self, context_ids: torch.Tensor, gamma: int):
        """(candidate ids [gamma, k], start [k], pair [gamma - 1, k, k]) of the block anchored at the last token."""
        model = self.model
        hidden = self.block_hidden(context_ids)[:, :gamma][None]  # [1, 1, gamma, d]
        ids, log_probs = model.candidates(hidden)
        valid = torch.ones(1, 1, dtype=torch.bool, device=hidden.device)
        start, pair = model.lattice(hidden, ids, log_probs, self.anchor.view(1, 1, -1), valid)
        return ids[0, 0], start[0, 0], pair[0, 0]

    def draw(self, context_ids: torch.Tensor, gamma: int, sampler: Sampler) -> Proposal:
        ids, start, pair = self.lattice(context_ids, gamma)
        if sampler.greedy:
            pick = greedy_walk(start[None], pair[None])[0]
            return Proposal(ids.gather(-1, pick[:, None]).squeeze(-1).tolist())
        vocab = self.model.target.get_output_embeddings().out_features
        tokens, qs, row = [], [], start
        for s in range(gamma):
            logits = row.new_full((vocab,), float("-inf")).scatter(0, ids[s], row)
            token, q = sampler.draw(logits)
            tokens.append(token)
            qs.append(q)
            if s + 1 < gamma:
                row = pair[s, int((ids[s] == token).nonzero()[0, 0])]
        return Proposal(tokens, torch.stack(qs))
