"""An EAGLE-3 draft as a ``Drafter`` for the speculative decoding loop (chains and trees, greedy or sampled).

The draft keeps the K/V of its step-0 rows: row j holds the target's feature of token j
and the embedding of token j + 1, for every j the target has processed. Those depend
only on accepted tokens and the target's own features, so they never need cutting back.
A proposal runs the new step-0 rows, then the chain: each link feeds the previous link's
output as its feature, its own guess as its token, at the next position, attending to
the step-0 rows and the links before it; the links are thrown away afterwards. This is
the training-time-test unroll of drafts/eagle3/model.py, row by row. A tree is the same
unroll per path: a node is fed its parent's output as feature (the last step-0 row's
for a child of the bonus) and its own token, at position last + depth, attending to
the step-0 rows, its ancestors and itself.
"""

from __future__ import annotations

import torch

from treadle.drafts.eagle3.model import Eagle3Model
from treadle.speculative.decode import Proposal, TargetState
from treadle.speculative.sampling import Sampler
from treadle.speculative.tree import ancestor_mask, grow_tree, node_depths


class Eagle3Drafter:
    name = "eagle3"

    def __init__(self, model: Eagle3Model):
        self.model = model.eval()
        self.feature_layers = model.draft_model.feature_layers  # the decode loop hands over these layers' outputs
        draft = model.draft_model
        # Draft-vocabulary index -> target id: where a sampled q row's entries go in the target's vocabulary.
        self._target_ids = draft.to_target_ids(torch.arange(draft.vocab_size, device=draft.lm_head.weight.device))
        self.reset(None)

    def reset(self, prompt_ids) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rows = 0  # step-0 rows in self.kv

    def _step(self, tokens: torch.Tensor, feature: torch.Tensor, first: int, past) -> tuple[torch.Tensor, tuple]:
        """Rows at positions first.. with these tokens and features; each sees ``past`` and the rows before it."""
        n, seen = tokens.shape[1], 0 if past is None else past[0].shape[2]
        q = torch.arange(n, device=tokens.device)
        mask = torch.arange(seen + n, device=tokens.device)[None] <= seen + q[:, None]
        return self._rows(tokens, feature, first + q, mask, past)

    def _rows(self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              past) -> tuple[torch.Tensor, tuple]:
        """Draft rows for ``tokens`` [1, n] (target ids) at ``positions`` [n]; ``mask`` [n, past + n] (True: may
        attend). Returns the rows' outputs [1, n, d] and their K/V."""
        model = self.model
        embeds = model.target.get_input_embeddings()(tokens)
        rope = model.rotary(embeds, positions[None])
        return model.draft_model(embeds, feature, rope, mask[None, None], past_kv=past)

    def _draw(self, x: torch.Tensor, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
        """A target token id from the draft's head on ``x`` [1, 1, d], and the distribution it came from over the
        target's vocabulary (a reduced head's rows scattered to their target ids; None when greedy)."""
        draft = self.model.draft_model
        token, q = sampler.draw(draft.logits(x)[0, -1].float())
        target_id = int(self._target_ids[token])
        if q is None:
            return target_id, None
        full = q.new_zeros(draft.target_vocab_size)
        return target_id, full.index_copy_(0, self._target_ids.to(q.device), q)

    def _absorb(self, context_ids: torch.Tensor, state: TargetState) -> tuple[torch.Tensor, int]:
        """Turn the target's new features into step-0 rows: (the last row's output [1, 1, d], its position)."""
        features = getattr(state, "hidden", None)
        if features is None:
            raise ValueError("an EAGLE-3 draft needs the target's hidden states (state.hidden)")
        draft = self.model.draft_model
        last = context_ids.shape[1] - 2  # the newest token the target processed
        if self.rows + features.shape[1] != last + 1:
            raise RuntimeError(f"eagle3 drafter: features for {self.rows + features.shape[1]} tokens, "
                               f"expected {last + 1}")
        tokens = context_ids[:, self.rows + 1 : last + 2]  # row j reads token j + 1
        x, (k, v) = self._step(tokens, draft.fc(features.to(draft.fc.weight.dtype)), self.rows, self.kv)
        self.kv = (k, v) if self.kv is None else (torch.cat((self.kv[0], k), 2), torch.cat((self.kv[1], v), 2))
        self.rows = last + 1
        return x[:, -1:], last

    @torch.inference_mode()
    def propose(self, context_ids: torch.Tensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        x, last = self._absorb(context_ids, state)
        past = self.kv
        token, q = self._draw(x, sampler)
        tokens, qs = [token], [q]
        for link in range(1, gamma):
            x, (k, v) = self._step(context_ids.new_tensor([[tokens[-1]]]), x, last + link, past)
            past = (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
            token, q = self._draw(x, sampler)
            tokens.append(token)
            qs.append(q)
        return Proposal(tokens, None if sampler.greedy else torch.stack(qs))

    @torch.inference_mode()
    def propose_tree(self, context_ids: torch.Tensor, state: TargetState, branching: tuple[int, ...],
                     sampler: Sampler) -> Proposal:
        """A static tree: each path is exactly the chain ``propose`` would run along it (the TTT unroll per path)."""
        root, last = self._absorb(context_ids, state)
        draft, device = self.model.draft_model, root.device
        outputs = [root[0, 0]]  # layer outputs: the root's, then each fed node's (index node + 1)
        node_kv: list[tuple] = []  # K/V of the fed nodes, in index order

        def expand(new: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            depths = node_depths(parents)
            fed = list(range(new[0])) + new
            mask = torch.cat([torch.ones(len(new), self.rows, dtype=torch.bool), ancestor_mask(parents)[new][:, fed]],
                             1).to(device)
            past = (torch.cat([self.kv[0], *(k for k, _ in node_kv)], 2),
                    torch.cat([self.kv[1], *(v for _, v in node_kv)], 2))
            ids = self._target_ids[torch.tensor([tokens[i] for i in new], device=device)][None]
            feature = torch.stack([outputs[parents[i] + 1] for i in new])[None]
            x, kv = self._rows(ids, feature, torch.tensor([last + depths[i] for i in new], device=device), mask, past)
            node_kv.append(kv)
            outputs.extend(x[0])
            return draft.logits(x)[0].float()

        tokens, parents, q, unscored = grow_tree(draft.logits(root)[0, -1].float(), branching, expand, sampler)
        ids = self._target_ids[torch.tensor(tokens, device=device)].tolist()
        if q is not None:  # rows over the draft vocabulary -> over the target's
            q = q.new_zeros(len(tokens), draft.target_vocab_size).index_copy_(1, self._target_ids.to(q.device), q)
        return Proposal(ids, q, parents, unscored)

    def accept(self, n_context: int) -> None:
        pass  # step-0 rows cover accepted tokens only; the next state brings the newly processed tokens' features
