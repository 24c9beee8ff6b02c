"""Draft trees: a static shape given as branching per depth, grown greedily or sampled, and the masks that score one.

A tree is a list of nodes in topological order, each a token and the index of its
parent node (-1: a child of the newest accepted token, the bonus). ``branching``
``(4, 2, 2, 1)`` gives the bonus its 4 most likely children, each of those its 2 most
likely, and so on: 4 + 8 + 16 + 16 = 44 nodes, a depth of 4. A chain of gamma is
``(1,) * gamma``. Sampled, a node's children are drawn without replacement from the
draft's distribution (``draw_children``), so a node may get fewer when fewer tokens
have mass (top-p).

``DynamicTree(top_k, depth, nodes)`` is EAGLE-2's shape instead: per depth the ``top_k``
likeliest frontier nodes (by cumulative draft log-probability) are expanded into ``top_k``
children each (greedy: the most likely; sampled: drawn without replacement), and after
``depth`` levels the ``nodes`` likeliest of all are kept (a node never outranks its
ancestors, so the kept ones form a tree).

Sampled, keeping the likeliest drawn nodes selects on the drawn values: a kept child is no
longer a draw from its q row, and recursive rejection sampling over the kept nodes alone is
not exact (tests/test_spec_sampling.py shows it failing). So the drawn children of the kept
nodes that were not kept stay in the proposal as *unscored* nodes: the target is not fed
them, but each is tried in its place among its siblings against its parent's distribution,
exactly as over the whole drawn tree, and when one is accepted the round ends with it as
the newest token (the target's distribution after it is what the next round verifies
against). The verification is then the one over every drawn candidate, whose shape depends
only on the draft, stopped early at an unscored node: exact, and free for the target.

A model scores a whole tree in one forward when each node attends to the cached
prefix, its ancestors and itself (``ancestor_mask``), at position prefix + depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from treadle.speculative.sampling import Sampler

GREEDY = Sampler()


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree (module docstring): ``spec-eval --tree dynamic:K,D,N``."""

    top_k: int
    depth: int
    nodes: int

    def __str__(self) -> str:
        return f"dynamic:{self.top_k},{self.depth},{self.nodes}"


def tree_depth(shape: "tuple[int, ...] | DynamicTree") -> int:
    return shape.depth if isinstance(shape, DynamicTree) else len(shape)


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
    branching: tuple[int, ...] | DynamicTree,
    expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
    sampler: Sampler,
) -> tuple[list[int], list[int], torch.Tensor | None, list[bool] | None]:
    """A static tree: (tokens, parents, q, unscored). Each node's children come from ``draw_children`` (greedy: its
    ``branching[depth]`` most likely tokens). A ``DynamicTree`` ``branching`` grows that instead (``grow_dynamic``).

    ``root_logits`` [V]: the draft's logits after the bonus. ``expand(new, tokens, parents)``
    feeds the nodes ``new`` (indices into the growing ``tokens``/``parents``; their
    ancestors were fed earlier) and returns their logits [len(new), V]. The deepest
    level is never fed. ``q`` [len(tokens), V]: each node's q row, None when greedy.
    ``unscored``: None, or per node whether the target is not to score it (a sampled
    dynamic tree's drawn but unkept children, module docstring).
    """
    if isinstance(branching, DynamicTree):
        return grow_dynamic(root_logits, branching, expand, sampler)
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
    return tokens, parents, (torch.stack(rows) if rows else None), None


def grow_dynamic(
    root_logits: torch.Tensor, shape: DynamicTree, expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
    sampler: Sampler = GREEDY,
) -> tuple[list[int], list[int], torch.Tensor | None, list[bool] | None]:
    """EAGLE-2's dynamic tree: (tokens, parents, q, unscored), ``expand`` as in ``grow_tree``.

    Candidates are scored by cumulative draft log-probability (sampled: of the distribution
    they are drawn from). Only expanded candidates are fed, in their own index order
    (``expand`` sees that fed tree, so its contract holds); the kept ``nodes`` are then
    renumbered in candidate order, parents first. Greedy: those alone (q and unscored None).
    Sampled: each candidate is drawn by ``draw_children`` and carries its q row, and the
    unkept children of kept nodes (and of the bonus) follow as unscored nodes (module
    docstring); whether a node is expanded depends only on its own level's scores, never on
    the values of its children.
    """
    k = shape.top_k
    tokens: list[int] = []
    parents: list[int] = []  # candidate index of the parent, -1: a child of the bonus
    scores: list[float] = []
    rows: list[torch.Tensor] = []  # sampled: each candidate's q row
    fed_tokens: list[int] = []
    fed_parents: list[int] = []
    fed_of: dict[int, int] = {}  # candidate index -> fed index

    def add_children(parent: int, logits: torch.Tensor) -> list[int]:
        base = scores[parent] if parent >= 0 else 0.0
        if sampler.greedy:
            top = logits.float().log_softmax(-1).topk(k)
            children, logq = top.indices.tolist(), top.values.tolist()
        else:
            children, q = draw_children(logits, k, sampler)
            rows.extend(q)
            logq = q[0][children].log().tolist()  # q[0]: the node's whole distribution, before any removal
        new = list(range(len(tokens), len(tokens) + len(children)))
        tokens.extend(children)
        parents.extend([parent] * len(children))
        scores.extend(base + s for s in logq)
        return new

    def rank(candidates: list[int]) -> list[int]:
        # Ties go to the lower index: a parent (scored >= its children) always ranks before them.
        return sorted(candidates, key=lambda c: (-scores[c], c))

    level = add_children(-1, root_logits)
    for _ in range(shape.depth - 1):
        chosen = rank(level)[:k]
        new = []
        for c in chosen:
            fed_of[c] = len(fed_tokens)
            new.append(len(fed_tokens))
            fed_tokens.append(tokens[c])
            fed_parents.append(fed_of[parents[c]] if parents[c] >= 0 else -1)
        logits = expand(new, fed_tokens, fed_parents)
        level = [child for c, row in zip(chosen, logits) for child in add_children(c, row)]
    kept = set(rank(list(range(len(tokens))))[: shape.nodes])
    if sampler.greedy:
        keep = sorted(kept)
    else:  # and the unkept drawn children of the bonus and of kept nodes, unscored, in draw order
        keep = [c for c in range(len(tokens)) if c in kept or parents[c] < 0 or parents[c] in kept]
    index = {c: i for i, c in enumerate(keep)}
    return ([tokens[c] for c in keep], [index[parents[c]] if parents[c] >= 0 else -1 for c in keep],
            None if sampler.greedy else torch.stack([rows[c] for c in keep]),
            None if sampler.greedy else [c not in kept for c in keep])
