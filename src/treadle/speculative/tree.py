"""Draft trees: a static shape given as branching per depth, grown greedily or sampled, and the masks that score one.

A tree is a list of nodes in topological order, each a token and the index of its
parent node (-1: a child of the newest accepted token, the bonus). ``branching``
``(4, 2, 2, 1)`` gives the bonus its 4 most likely children, each of those its 2 most
likely, and so on: 4 + 8 + 16 + 16 = 44 nodes, a depth of 4. A chain of gamma is
``(1,) * gamma``. Sampled, a node's children are drawn without replacement from the
draft's distribution (``draw_children``), so a node may get fewer when fewer tokens
have mass (top-p).

A model scores a whole tree in one forward when each node attends to the cached
prefix, its ancestors and itself (``ancestor_mask``), at position prefix + depth.
"""

from __future__ import annotations

from typing import Callable

import torch

from treadle.speculative.sampling import Sampler


def tree_size(branching: tuple[int, ...]) -> int:
    """Nodes in a static tree: sum over depths of the product of branchings so far."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for a child of the bonus."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come before their children")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Boolean [N, N]: node i may attend to node j iff j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]  # parents come first, so row p is complete
    return mask


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the float one HF models add to attention scores (0 where allowed)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def draw_children(logits: torch.Tensor, width: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor]]:
    """A node's children from the draft's ``logits`` [V]: (tokens, the q row each was drawn from).

    Greedy: the ``width`` most likely tokens, no rows. Sampled: ``width`` sequential draws
    without replacement: after each, its token is removed from q and q renormalized for
    the next sibling, whose row that is. Recursive rejection sampling
    (``sampling.verify_sampled``) needs exactly these rows to keep the output exact.
    Stops early when q has no mass left (top-p kept fewer than ``width`` tokens).
    """
    if sampler.greedy:
        return logits.topk(width).indices.tolist(), []
    q = sampler.probs(logits)
    tokens, rows = [], []
    for _ in range(width):
        token = sampler.sample(q)
        tokens.append(token)
        rows.append(q)
        q = q.clone()
        q[token] = 0.0
        total = float(q.sum())
        if total <= 0:
            break
        q = q / total
    return tokens, rows


def grow_tree(
    root_logits: torch.Tensor,
    branching: tuple[int, ...],
    expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
    sampler: Sampler,
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """A static tree: (tokens, parents, q). Each node's children come from ``draw_children`` (greedy: its
    ``branching[depth]`` most likely tokens).

    ``root_logits`` [V]: the draft's logits after the bonus. ``expand(new, tokens, parents)``
    feeds the nodes ``new`` (indices into the growing ``tokens``/``parents``; their
    ancestors were fed earlier) and returns their logits [len(new), V]. The deepest
    level is never fed. ``q`` [len(tokens), V]: each node's q row, None when greedy.
    """
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    frontier, frontier_logits = [-1], root_logits[None]
    for depth, width in enumerate(branching):
        new = []
        for parent, logits in zip(frontier, frontier_logits):
            children, q = draw_children(logits, width, sampler)
            rows += q
            for token in children:
                new.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
        if depth + 1 < len(branching):
            frontier, frontier_logits = new, expand(new, tokens, parents)
    return tokens, parents, (torch.stack(rows) if rows else None)
