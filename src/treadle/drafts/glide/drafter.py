"""A GLIDE draft as a ``Drafter`` for the speculative decoding loop.

The draft keeps its own self-attention K/V cache over the tokens it has processed.
Those K/V depend only on token and position (one layer), so after a verification
the cache is cut back to the accepted prefix and stays exact. The cross-attention
reads the target K/V the decode loop hands over: token index p sees target indices
<= p - 1 that exist, which gives lag 1 for the bonus token and lag k for the k-th draft.
"""

from __future__ import annotations

import torch

from treadle.models.chunked_ce import model_logits
from treadle.drafts.glide.model import GlideModel, attention_mask
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler
from treadle.speculative.tree import ancestor_mask, grow_tree, node_depths


class GlideDrafter:
    name = "glide"

    def __init__(self, model: GlideModel):
        self.model = model.eval()
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen = 0  # tokens whose self-attention K/V are in self.kv

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.kv, self.seen = None, 0

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, q_idx: torch.Tensor, self_mask: torch.Tensor,
             target_kv: tuple[torch.Tensor, torch.Tensor], past_kv) -> tuple[torch.Tensor, tuple]:
        """The draft over ``tokens`` [1, n] at sequence indices ``q_idx`` [1, n]: (logits [n, V], their K/V)."""
        model = self.model
        t_idx = torch.arange(target_kv[0].shape[2], device=tokens.device)[None]
        cross_mask = attention_mask(q_idx, t_idx, min_gap=1)
        embeds = model.target.get_input_embeddings()(tokens)
        rope = model.rotary(embeds, q_idx)
        hidden, kv = model.draft_model(embeds, rope, target_kv, self_mask, cross_mask, past_kv=past_kv)
        return model_logits(model.target.config, model.target.get_output_embeddings()(hidden[0])), kv

    def _feed(self, tokens: torch.Tensor, target_kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Run the draft over ``tokens`` (indices seen..seen+n), extend the cache, return the last logits [V]."""
        device = tokens.device
        q_idx = torch.arange(self.seen, self.seen + tokens.shape[1], device=device)[None]
        k_idx = torch.arange(0, self.seen + tokens.shape[1], device=device)[None]
        self_mask = attention_mask(q_idx, k_idx, window=self.model.draft_model.window)
        logits, (k, v) = self._run(tokens, q_idx, self_mask, target_kv, self.kv)
        self.kv = (k, v) if self.kv is None else (torch.cat((self.kv[0], k), 2), torch.cat((self.kv[1], v), 2))
        self.seen += tokens.shape[1]
        return logits[-1]

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

    def propose_tree(self, context_ids: torch.Tensor, state: TargetState, branching: tuple[int, ...],
                     sampler: Sampler) -> Proposal:
        """A static tree: nodes attend to the cached context and their ancestors (kept apart from the cache), at
        index context + depth - 1, so each path sees exactly what a chain along it would."""
        root = self._feed(context_ids[:, self.seen:], state.kv)
        length, window = self.seen, self.model.draft_model.window
        node_kv: list[tuple] = []  # K/V of the fed nodes, in index order

        def expand(new: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            depths = node_depths(parents)
            index = torch.tensor([length - 1 + d for d in depths])
            q_idx = index[new][None]
            past_mask = attention_mask(q_idx, torch.arange(length)[None], window=window)
            fed = list(range(new[0])) + new
            mask = ancestor_mask(parents)[new][:, fed][None, None]
            if window:
                mask &= (q_idx[0, :, None] - index[fed][None]) < window
            past = (torch.cat([self.kv[0], *(k for k, _ in node_kv)], 2),
                    torch.cat([self.kv[1], *(v for _, v in node_kv)], 2))
            logits, kv = self._run(context_ids.new_tensor([[tokens[i] for i in new]]), q_idx,
                                   torch.cat([past_mask, mask], -1), state.kv, past)
            node_kv.append(kv)
            return logits

        tokens, parents, q, unscored = grow_tree(root, branching, expand, sampler)
        return Proposal(tokens, q, parents, unscored)

    def accept(self, n_context: int) -> None:
        # The newest accepted token (the bonus) differs from the draft at that index, so
        # at most n_context - 1 cached entries still describe the accepted sequence.
        keep = min(self.seen, n_context - 1)
        if self.kv is not None:
            self.kv = (self.kv[0][:, :, :keep], self.kv[1][:, :, :keep])
        self.seen = keep
