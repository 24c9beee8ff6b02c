"""Choosing tokens from logits (greedy, or temperature + top-p) and the speculative-sampling acceptance rule.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft token x drawn
from the draft's distribution q is accepted with probability min(1, p(x) / q(x)),
p being the target's distribution; at the first rejection the target's token is
drawn from the normalized residual max(0, p - q) instead. Whatever q is, every
emitted token is then distributed exactly as p, so the output has the target's own
sampling distribution. A deterministic drafter has a one-hot q (q(x) = 1).
"""

from __future__ import annotations

import torch


class Sampler:
    """How the decode loop and the drafters pick tokens: greedy (temperature 0) or sampled.

    Sampled: softmax(logits / temperature), restricted to the smallest set of most
    likely tokens whose mass reaches ``top_p`` (nucleus), renormalized. ``generator``
    makes runs reproducible; drafters that sample draw from the same one.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from, for each row of ``logits`` [..., V] (fp32; one-hot when greedy)."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        p = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_p, order = p.sort(dim=-1, descending=True)
            # Keep a token while the mass before it is below top_p: the most likely token always stays.
            keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < self.top_p
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            p = torch.where(keep, p, 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p

    def draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One token from ``logits`` [V] and the distribution it came from (None when greedy: one-hot)."""
        if self.greedy:
            return int(logits.argmax()), None
        q = self.probs(logits)
        return self.sample(q), q

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def accepts(self, p_x: float, q_x: float) -> bool:
        """The speculative-sampling test for a draft token with target probability p_x and draft probability q_x."""
        if q_x <= 0:
            return False  # cannot happen for a token drawn from q; a drafter that claims it gets rejected
        return float(torch.rand((), generator=self.generator)) < min(1.0, p_x / q_x)


def _widen(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Pad distributions with zero columns: a draft whose vocabulary is narrower than the target's never proposes
    the extra ids (and a wider one is cut: the target cannot emit ids outside its vocabulary)."""
    if rows.shape[-1] >= width:
        return rows[..., :width]
    return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]))


def residual(p: torch.Tensor, x: int, q_row: torch.Tensor | None) -> torch.Tensor:
    """The normalized max(0, p - q) that replaces ``p`` after draft token ``x`` (drawn from ``q_row``) was rejected;
    ``q_row`` None: one-hot at ``x``, so p without x."""
    if q_row is None:
        rest = p.clone()
        if x < rest.shape[0]:
            rest[x] = 0.0
    else:
        rest = (p - q_row).clamp_min(0.0)
    total = float(rest.sum())
    # A zero residual means p == q, where rejection has probability 0; rounding can still get here.
    return rest / total if total > 0 else p


def verify_sampled(
    p: torch.Tensor, draft: list[int], q: torch.Tensor | None, sampler: Sampler, parents: list[int] | None = None,
    unscored: list[bool] | None = None,
) -> tuple[list[int], int | None]:
    """Speculative sampling over a chain or a tree: (accepted draft indices, root to leaf, the target's next token).

    ``p`` [len(draft) + 1, V]: the target's distribution after the bonus (row 0) and
    after each draft node (row i + 1 follows draft[i] and its ancestors); ``q``
    [len(draft), V]: the distribution each draft token was drawn from (None: each
    one-hot at its token). ``parents`` as in ``tree.py``; None: a chain. ``unscored``:
    nodes the target did not score (their p rows are never read): tried like their
    siblings, but an accepted one ends the walk with no next token (None), that node
    being the newest token (``tree.grow_dynamic``).

    Recursive rejection sampling (SpecInfer; EAGLE's evaluation): at a node, its children
    are tried in the order they were drawn; child x with row q is accepted with
    probability min(1, p(x) / q(x)); a rejection replaces p with the normalized
    max(0, p - q) for the next sibling; the first acceptance descends into that child
    with the target's distribution there; when every child is rejected (or at a leaf)
    the next token is drawn from the current p. Siblings drawn without replacement
    (``tree.draw_children``) carry their renormalized rows, which keeps this exact.
    """
    parents = list(range(-1, len(draft) - 1)) if parents is None else parents
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    node, p_now = -1, p[0]
    while True:
        for child in children.get(node, []):
            x = draft[child]
            q_row = _widen(q[child], p.shape[-1]) if q is not None else None
            q_x = float(q_row[x]) if q_row is not None else 1.0
            p_x = float(p_now[x]) if x < p.shape[-1] else 0.0
            if sampler.accepts(p_x, q_x):
                path.append(child)
                if unscored is not None and unscored[child]:
                    return path, None
                node, p_now = child, p[child + 1]
                break
            p_now = residual(p_now, x, q_row)
        else:
            return path, sampler.sample(p_now)
