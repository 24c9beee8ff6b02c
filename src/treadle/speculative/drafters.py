"""Drafters that need no training: an independent draft LM, prompt lookup, and random (tests)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from treadle.speculative.decode import Proposal, TargetState, crop_cache, forward_logits, forward_tree
from treadle.speculative.sampling import Sampler
from treadle.speculative.tree import grow_tree


class ModelDrafter:
    """Any HF causal LM as an independent draft model, with its own KV cache. Ignores the target's state."""

    def __init__(self, model: torch.nn.Module, name: str = "lm"):
        self.model = model.eval()
        self.name = name
        self._cache = DynamicCache()
        self._cached = 0  # leading context tokens whose K/V are in the cache

    def reset(self, prompt_ids: torch.LongTensor) -> None:
        self._cache = DynamicCache()
        self._cached = 0

    @torch.inference_mode()
    def propose(self, context_ids: torch.LongTensor, state: TargetState | None, gamma: int,
                sampler: Sampler) -> Proposal:
        # Everything not seen yet goes in one forward: the prompt on the first
        # call, then the bonus token (plus the last draft when all were accepted).
        logits = forward_logits(self.model, context_ids[:, self._cached :], self._cache)[-1]
        draft, qs = [], []
        for step in range(gamma):
            if step:
                logits = forward_logits(self.model, torch.tensor([[draft[-1]]]), self._cache)[-1]
            token, q = sampler.draw(logits)
            draft.append(token)
            qs.append(q)
        # The last draft was never fed back, so the cache ends one token short.
        self._cached = context_ids.shape[1] + gamma - 1
        return Proposal(draft, None if sampler.greedy else torch.stack(qs))

    @torch.inference_mode()
    def propose_tree(self, context_ids: torch.LongTensor, state: TargetState | None, branching: tuple[int, ...],
                     sampler: Sampler) -> Proposal:
        length = context_ids.shape[1]
        root = forward_logits(self.model, context_ids[:, self._cached :], self._cache)[-1]

        def expand(new: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            return forward_tree(self.model, tokens, parents, length, self._cache, feed=new).logits[0]

        tokens, parents, q, unscored = grow_tree(root, branching, expand, sampler)
        # The tree's nodes follow the context in the cache in no sequence order: only the context stays.
        crop_cache(self._cache, length)
        self._cached = length
        return Proposal(tokens, q, parents, unscored)

    def accept(self, n_context: int) -> None:
        # The cached drafts that were accepted stay valid; the newest accepted
        # token (the target's bonus) is always fed on the next propose.
        self._cached = min(self._cached, n_context - 1)
        crop_cache(self._cache, self._cached)


def _continuation(seq: list[int], n: int, gamma: int) -> list[int] | None:
    """The ``gamma`` tokens after the most recent earlier match of ``seq``'s last ``n`` that has them all."""
    length = len(seq)
    suffix = seq[length - n :]
    # Only starts whose continuation ends inside the context; scanning from the
    # latest such start backwards finds the most recent usable match first.
    for start in range(length - n - gamma, -1, -1):
        if seq[start : start + n] == suffix:
            return seq[start + n : start + n + gamma]
    return None


class PromptLookupDrafter:
    """Proposes what followed the latest earlier occurrence of the context's last n-gram. Ignores the target's state.

    A match is only usable with a full ``gamma``-token continuation inside the
    context; inside repetitive stretches the most recent match of all is
    usually too close to the end and would give a short proposal.
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self, prompt_ids: torch.LongTensor) -> None:
        pass

    def propose(self, context_ids: torch.LongTensor, state: TargetState | None, gamma: int,
                sampler: Sampler) -> Proposal:
        return Proposal(self.lookup(context_ids[0].tolist(), gamma))  # deterministic: one-hot q

    def lookup(self, seq: list[int], gamma: int) -> list[int]:
        """``propose`` on a plain list of ids."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            found = _continuation(seq, n, gamma)
            if found is not None:
                return found
        # No match: repeating the last token is as good a guess as any, and deterministic.
        return [seq[-1]] * gamma

    def accept(self, n_context: int) -> None:
        pass


class RandomDrafter:
    """Uniformly random proposals (tests: almost nothing is accepted, the output must not change)."""

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)

    def reset(self, prompt_ids: torch.LongTensor) -> None:
        # Re-seeded per sequence, so each sequence's proposals are reproducible.
        self._generator.manual_seed(self.seed)

    def propose(self, context_ids: torch.LongTensor, state: TargetState | None, gamma: int,
                sampler: Sampler) -> Proposal:
        # Drawn from the uniform distribution, which is then the honest q.
        tokens = torch.randint(self.vocab_size, (gamma,), generator=self._generator).tolist()
        return Proposal(tokens, None if sampler.greedy else torch.full((gamma, self.vocab_size), 1 / self.vocab_size))

    def accept(self, n_context: int) -> None:
        pass
