"""Gemma 4's assistant as a ``Drafter`` for spec-eval's decoding loop (chains, greedy or sampled).

Each proposal is what serving computes (drafts/frozen_kv/model.py): the assistant's own forward (its own masks) at the
bonus token's position t + 1, reading the target's stored K/V (the last full and the last sliding layer's, handed over
by the loop as ``TargetState.layer_kv``) over the accepted tokens 0..t and the target's final hidden state of token
t, then its own output hidden state and guess for the next link. Nothing is cached: the K/V are the target's, and a
round's links depend on that round's inputs only.

Where transformers' generate differs (tests/test_frozen_kv.py measures it): after a rejection it hands the assistant
the target's K/V up to the bonus position, so the row of the rejected candidate at that position is read too; and once
past the sliding window its sliding K/V are the target cache's last window, rejected candidates included. Here, as in
training, the assistant reads the accepted tokens' K/V only.
"""

from __future__ import annotations

import torch

from treadle.drafts.frozen_kv.model import FrozenKvModel, store_layers
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler


class FrozenKvDrafter:
    name = "frozen_kv"

    def __init__(self, model: FrozenKvModel):
        self.model = model.eval()
        config = model.target.config
        # output_hidden_states index N: the target's final normed hidden state (generate's hidden_states[-1])
        self.feature_layers = (config.num_hidden_layers,)
        self.stores = store_layers(config)  # layer type -> the target layer whose K/V it reads
        self.kv_layers = tuple(sorted(self.stores.values()))

    def reset(self, prompt_ids) -> None:
        pass

    @torch.inference_mode()
    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        if state.hidden is None or state.layer_kv is None:
            raise ValueError("a frozen_kv drafter needs the target's hidden states and stored K/V (state.hidden, "
                             "state.layer_kv)")
        assistant, embed = self.model.draft_model.assistant, self.model.target.get_input_embeddings()
        dtype = assistant.pre_projection.weight.dtype
        kv = {t: tuple(x.to(dtype) for x in state.layer_kv[i]) for t, i in self.stores.items()}
        position = torch.tensor([[context_ids.shape[1] - 1]], device=context_ids.device)  # the bonus token's
        hidden, token = state.hidden[:, -1:], context_ids[:, -1:]  # h_t (t: the newest processed token), token t + 1
        tokens, qs = [], []
        for _ in range(gamma):
            out = assistant(inputs_embeds=torch.cat((embed(token), hidden), dim=-1).to(dtype), position_ids=position,
                            shared_kv_states=kv)
            drawn, q = sampler.draw(out.logits[0, -1].float())
            tokens.append(int(drawn))
            qs.append(q)
            hidden, token = out.last_hidden_state, context_ids.new_tensor([[int(drawn)]])
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))

    def accept(self, n_context: int) -> None:
        pass  # nothing kept between rounds
