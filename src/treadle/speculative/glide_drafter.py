"""A GLIDE draft as a ``Drafter`` for the speculative decoding loop.

The draft keeps its own self-attention K/V cache over the tokens it has processed.
Those K/V depend only on token and position (one layer), so after a verification
the cache is cut back to the accepted prefix and stays exact. The cross-attention
reads the target K/V the decode loop hands over: token index p sees target indices
<= p - 1 that exist, which gives lag 1 for the bonus token and lag k for the k-th draft.
"""

from __future__ import annotations

import torch

from treadle.models.glide import GlideModel, attention_mask
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler


class GlideDrafter:
    name = "glide"

    def __init__(self, model: GlideModel):
        self.model = model.eval()
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen = 0  # tokens whose self-attention K/V are in self.kv

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.kv, self.seen = None, 0

    @torch.inference_mode()
    def _feed(self, tokens: torch.Tensor, target_kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Run the draft over ``tokens`` (indices seen..seen+n), extend the cache, return the last logits [V]."""
        model, device = self.model, tokens.device
        q_idx = torch.arange(self.seen, self.seen + tokens.shape[1], device=device)[None]
        k_idx = torch.arange(0, self.seen + tokens.shape[1], device=device)[None]
        t_idx = torch.arange(target_kv[0].shape[2], device=device)[None]
        self_mask = attention_mask(q_idx, k_idx, window=model.draft_model.window)
        cross_mask = attention_mask(q_idx, t_idx, min_gap=1)
        embeds = model.target.get_input_embeddings()(tokens)
        rope = model.rotary(embeds, q_idx)
        hidden, (k, v) = model.draft_model(embeds, rope, target_kv, self_mask, cross_mask, past_kv=self.kv)
        self.kv = (k, v) if self.kv is None else (torch.cat((self.kv[0], k), 2), torch.cat((self.kv[1], v), 2))
        self.seen += tokens.shape[1]
        return model.target.get_output_embeddings()(hidden[0, -1])

    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        if state is None:
            raise ValueError("a GLIDE draft needs the target's last-layer K/V")
        tokens, qs = [], []
        for step in range(gamma):
            fresh = context_ids[:, self.seen:] if not step else context_ids.new_tensor([[tokens[-1]]])
            token, q = sampler.draw(self._feed(fresh, state.kv))
            tokens.append(token)
            qs.append(q)
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))

    def accept(self, n_context: int) -> None:
        # The newest accepted token (the bonus) differs from the draft at that index, so
        # at most n_context - 1 cached entries still describe the accepted sequence.
        keep = min(self.seen, n_context - 1)
        if self.kv is not None:
            self.kv = (self.kv[0][:, :, :keep], self.kv[1][:, :, :keep])
        self.seen = keep
