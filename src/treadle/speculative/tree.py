"""Draft trees: a static shape given as branching per depth, grown greedily, and the masks that score one.

A tree is a list of nodes in topological order, each a token and the index of its
parent node (-1: a child of the newest accepted token, the bonus). ``branching``
``(4, 2, 2, 1)`` gives the bonus its 4 most likely children, each of those its 2 most
likely, and so on: 4 + 8 + 16 + 16 = 44 nodes, a depth of 4. A chain of gamma is
``(1,) * gamma``.

A model scores a whole tree in one forward when each node attends to the cached
prefix, its ancestors and itself (``ancestor_mask``), at position prefix + depth.
"""

from __future__ import annotations

from typing import Callable

import torch


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


def grow_tree(
    root_logits: torch.Tensor,
    branching: tuple[int, ...],
    expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
) -> tuple[list[int], list[int]]:
    """Greedy static tree: (tokens, parents). Each node's children are its ``branching[depth]`` most likely tokens.

    ``root_logits`` [V]: the draft's logits after the bonus. ``expand(new, tokens, parents)``
    feeds the nodes ``new`` (indices into the growing ``tokens``/``parents``; their
    ancestors were fed earlier) and returns their logits [len(new), V]. The deepest
    level is never fed.
    """
    tokens: list[int] = []
    parents: list[int] = []
    frontier, frontier_logits = [-1], root_logits[None]
    for depth, width in enumerate(branching):
        new = []
        for parent, logits in zip(frontier, frontier_logits):
            for token in logits.topk(width).indices.tolist():
                new.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
        if depth + 1 < len(branching):
            frontier, frontier_logits = new, expand(new, tokens, parents)
    return tokens, parents
