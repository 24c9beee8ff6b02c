"""A DFlash draft as a ``Drafter`` for the speculative decoding loop: one draft forward proposes a whole block.

The drafter keeps, per draft layer, the keys and values of the fused context of every token the target has
processed (they depend only on accepted tokens and the target's own features, so they never need cutting back).
A proposal appends the new context rows, then runs one forward over ``[bonus, MASK, ..., MASK]`` (the whole
block, at positions bonus..bonus + block_size - 1) reading every cached context row and the block itself; slots
1..gamma give the proposals, and the block's own keys are dropped. This is the training forward of one block
anchored at the bonus, whose context is exactly the tokens strictly before it.

Sampled: slot k's token is drawn from its own distribution, which does not depend on the tokens drawn at the
other slots (the block's inputs are mask tokens), so each q row is the distribution its token came from.
"""

from __future__ import annotations

import torch

from treadle.drafts.dflash.model import DFlashModel
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler


class DFlashDrafter:
    name = "dflash"

    def __init__(self, model: DFlashModel):
        self.model = model.eval()
        self.feature_layers = model.draft_model.feature_layers  # the decode loop hands over these layers' outputs
        self.block_size = model.draft_model.block_size
        self.forwards = 0  # draft forwards run (one per proposal)
        self.reset(None)

    def reset(self, prompt_ids) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.rows = 0  # context rows in self.kv

    def _absorb(self, context_ids: torch.Tensor, state: TargetState) -> None:
        """Append the context rows of the target's new features (positions self.rows .. L - 2)."""
        features = getattr(state, "hidden", None)
        if features is None:
            raise ValueError("a DFlash draft needs the target's hidden states (state.hidden)")
        model, draft = self.model, self.model.draft_model
        end = context_ids.shape[1] - 1  # the bonus (the anchor) has no features yet
        if self.rows + features.shape[1] != end:
            raise RuntimeError(f"dflash drafter: features for {self.rows + features.shape[1]} tokens, expected {end}")
        if features.shape[1] == 0:
            return
        context = draft.fuse(features)
        positions = torch.arange(self.rows, end, device=context.device)[None]
        new = draft.context_kv(context, model.rotary(context, positions))
        self.kv = new if self.kv is None else [(torch.cat((k0, k1), 2), torch.cat((v0, v1), 2))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.rows = end

    def block_logits(self, context_ids: torch.Tensor) -> torch.Tensor:
        """The draft's logits [block_size - 1, V] of slots 1.. of the block anchored at the last token."""
        return self.model.draft_logits(self.block_hidden(context_ids))[0].float()

    def block_hidden(self, context_ids: torch.Tensor) -> torch.Tensor:
        """The draft's final hidden states [1, block_size - 1, d] of slots 1.. of the block anchored at the last
        token (one draft forward)."""
        return self.block_states(context_ids)[:, 1:]

    def block_states(self, context_ids: torch.Tensor) -> torch.Tensor:
        """The draft's final hidden states [1, block_size, d] of every slot of the block anchored at the last token,
        the anchor's included (DSpark's drafts too): one draft forward."""
        model, draft = self.model, self.model.draft_model
        anchor = context_ids.shape[1] - 1
        tokens = context_ids.new_full((1, self.block_size), draft.mask_token_id)
        tokens[0, 0] = context_ids[0, -1]
        embeds = model.target.get_input_embeddings()(tokens)
        positions = torch.arange(anchor, anchor + self.block_size, device=embeds.device)[None]
        mask = self.block_mask(anchor, embeds.device)
        hidden = model.draft_blocks(embeds, model.rotary(embeds, positions), self.kv, mask, tokens[None])
        self.forwards += 1
        return hidden

    def block_mask(self, anchor: int, device) -> torch.Tensor:
        """[1, 1, block, context rows + block]: which keys the block's slots read (every one: the block attends
        bidirectionally over itself and the whole context)."""
        return torch.ones(1, 1, self.block_size, self.rows + self.block_size, dtype=torch.bool, device=device)

    @torch.inference_mode()
    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        if gamma > self.block_size - 1:
            raise ValueError(f"gamma {gamma} exceeds what one {self.name} forward proposes (block_size - 1 = "
                             f"{self.block_size - 1}); accepted: --gamma <= {self.block_size - 1}")
        self._absorb(context_ids, state)
        return self.draw(context_ids, gamma, sampler)

    def draw(self, context_ids: torch.Tensor, gamma: int, sampler: Sampler) -> Proposal:
        """Slots 1..gamma of the block anchored at the last token, the context rows absorbed: each slot's own
        distribution (a kind that walks its slots, each after the token before it, overrides this)."""
        logits = self.block_logits(context_ids)[:gamma]
        if sampler.greedy:
            return Proposal(logits.argmax(-1).tolist())
        drawn = [sampler.draw(row) for row in logits]
        return Proposal([t for t, _ in drawn], torch.stack([q for _, q in drawn]))

    def accept(self, n_context: int) -> None:
        pass  # the cache holds context rows of processed tokens only; the next state brings the newly processed ones
