"""An MTP head as a ``Drafter`` for spec-eval's decoding loop (chains, greedy or sampled).

The module keeps the K/V of its step-1 rows: row j holds the target's final hidden state of token j and the
embedding of token j + 1, for every j the target has processed; they depend on accepted tokens only and are never
cut. A proposal runs the new step-1 rows, then replays the module along the chain (each link reads what the previous
link hands on, ``MtpDraft.carry``, and its own guess, at the next position, attending to the step-1 rows and the links
before it), as vLLM's proposer does; the links' K/V are dropped afterwards. The training unroll (drafts/mtp/model.py),
row by row. A tree falls back to a chain of its depth.
"""

from __future__ import annotations

import torch

from treadle.drafts.glide.model import as_mask
from treadle.drafts.mtp.model import MtpModel
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler


class MtpDrafter:
    name = "mtp"

    def __init__(self, model: MtpModel):
        self.model = model.eval()
        # output_hidden_states index N: the target's final normed hidden state, what its head and the module read
        self.feature_layers = (model.target.config.num_hidden_layers,)
        self.reset(None)

    def reset(self, prompt_ids) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.draft_model.config)
        self.rows = 0  # step-1 rows in the cache

    def _rows(self, tokens: torch.Tensor, hidden: torch.Tensor, first: int) -> torch.Tensor:
        """Block outputs [1, n, d] of rows at positions first.. (tokens [1, n], hidden [1, n, d]), each seeing the
        cache and the rows before it; their K/V are appended to the cache."""
        model, draft = self.model, self.model.draft_model
        n, seen = tokens.shape[1], self.cache.get_seq_length()
        embeds = model.target.get_input_embeddings()(tokens)
        pos = torch.arange(first, first + n, device=tokens.device)[None]
        if draft.zero_first_embedding:
            embeds = embeds.masked_fill((pos == 0)[..., None], 0.0)
        q = torch.arange(n, device=tokens.device)
        mask = (torch.arange(seen + n, device=tokens.device)[None] <= seen + q[:, None])[None, None]
        return draft(embeds, hidden, model.rotary(embeds, pos), as_mask(mask, model.target.config, embeds.dtype), pos,
                     self.cache)

    @torch.inference_mode()
    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        hidden = getattr(state, "hidden", None)
        if hidden is None:
            raise ValueError("an MTP draft needs the target's hidden states (state.hidden)")
        last = context_ids.shape[1] - 2  # the newest token the target processed
        if self.rows + hidden.shape[1] != last + 1:
            raise RuntimeError(f"mtp drafter: hidden states for {self.rows + hidden.shape[1]} tokens, expected "
                               f"{last + 1}")
        x = self._rows(context_ids[:, self.rows + 1: last + 2], hidden, self.rows)[:, -1:]
        self.rows = last + 1
        tokens, qs = [], []
        for link in range(gamma):
            if link:
                x = self._rows(context_ids.new_tensor([[tokens[-1]]]), self.model.draft_model.carry(x), last + link)
            token, q = sampler.draw(self.model.draft_logits(x)[0, -1].float())
            tokens.append(int(token))
            qs.append(q)
        extra = self.cache.get_seq_length() - self.rows
        if extra:
            self.cache.crop(-extra)  # the chain's links are not context
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))

    def accept(self, n_context: int) -> None:
        pass  # step-1 rows cover accepted tokens only; the next state brings the newly processed tokens' states
