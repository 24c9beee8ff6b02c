"""Speculative decoding (batch size 1), greedy or sampled, and the plain target-alone baseline.

One round: the drafter proposes ``gamma`` tokens after the accepted sequence;
the target scores ``[bonus, d1..d_gamma]`` in one forward. Greedy: the leading
drafts that equal the target's argmax are kept, followed by the target's own token
at the first mismatch (or after the last draft), so the output is exactly the
target's greedy output whatever the drafter proposes. Sampled (temperature > 0):
speculative sampling (``sampling.verify_sampled``), so the output has exactly the
target's own sampling distribution. A tree (``tree=``) is verified the same ways, in
one forward, keeping the longest accepted path.

Cache invariant (target and ``ModelDrafter`` alike): the KV cache covers the
accepted sequence minus its last token, the newest "bonus" token, which no
model has processed yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from treadle.models.hf import cache_kwargs
from treadle.speculative.sampling import Sampler, verify_sampled
from treadle.speculative.tree import DynamicTree, additive, ancestor_mask, node_depths

GREEDY = Sampler()


@dataclass
class TargetState:
    """What the target computed that a drafter may read, handed to every ``propose``.

    With ``L`` the accepted sequence's length (``context_ids.shape[1]``):

    - ``kv``: the target's last decoder layer's post-RoPE keys and values for
      positions 0..L-2, ``[1, H_kv, L-1, D]`` each (the bonus token at L-1 has not
      been through the target yet). Always present.
    - ``hidden``: only for a drafter whose ``feature_layers`` is non-empty, else None.
      ``[1, n, len(feature_layers) * d]``: the hidden states of those target layers,
      concatenated on the last dim in the order the drafter listed them, for the
      positions L-1-n .. L-2, i.e. the ones the target's latest forward added to
      its cache: on the first ``propose`` of a sequence the whole prompt (n = P),
      afterwards the verified tokens cut to the accepted ones (the previous bonus
      and the accepted drafts, n = accepted + 1). Together over a sequence's calls
      they cover every position exactly once. A layer index counts as HF's
      ``output_hidden_states`` tuple does: 0 is the embedding output, i the output of
      decoder layer i (1..num_hidden_layers), recorded where it is made, as training
      reads it (``drafts.targets.capture_features``: the last layer's own output, not
      the final norm's that some models put last in that tuple).
    - ``layer_kv``: only for a drafter whose ``kv_layers`` is non-empty, else None. Decoder
      layer index -> that layer's keys and values for positions 0..L-2, as ``kv`` (Gemma 4's
      assistant reads the last full and the last sliding layer's).
    """

    kv: tuple[torch.Tensor, torch.Tensor]
    hidden: torch.Tensor | None = None
    layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def start(self) -> int:
        """Position of ``hidden``'s first row."""
        return self.kv[0].shape[-2] - (self.hidden.shape[1] if self.hidden is not None else 0)


@dataclass
class Proposal:
    """A drafter's proposal: ``tokens`` and the distributions they were drawn from.

    ``q``: ``[len(tokens), V_target]`` fp32, row i the distribution ``tokens[i]`` was
    drawn from, over the *target's* vocabulary (a reduced-vocabulary draft maps
    back); None means each row is one-hot at its token (a deterministic drafter,
    or any drafter under a greedy ``Sampler``). Only sampled verification reads it.
    ``parents``: None for a chain; for a tree (``propose_tree``) the parent index of
    each token (-1: a child of the bonus), parents before children (``tree.py``).
    ``unscored``: None, or per tree node whether the target is not to score it (a sampled
    dynamic tree's drawn but unkept children: always leaves, their parents scored):
    tried against the parent's distribution in their place among their siblings, one
    that is accepted ends the round as the newest token, in place of the target's own.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    parents: list[int] | None = None
    unscored: list[bool] | None = None


class Drafter(Protocol):
    """Proposes tokens for the target to verify. One instance serves one sequence at a time.

    Optional attribute ``feature_layers: tuple[int, ...]`` (absent or empty: none):
    target layers whose hidden states the drafter reads; the decode loop then records
    them during the target's forwards and fills ``TargetState.hidden``.

    Optional attribute ``kv_layers: tuple[int, ...]`` (absent or empty: none): decoder
    layers whose K/V the drafter reads besides the last one (``TargetState.layer_kv``).

    Optional method ``propose_tree(context_ids, state, branching, sampler) -> Proposal``:
    a tree (``Proposal.parents`` set) of the shape ``branching`` (``tree.py``: static or a
    ``DynamicTree``, sampled children drawn without replacement). Under ``tree=...`` a
    drafter without it proposes a chain of the tree's depth.
    """

    name: str

    def reset(self, prompt_ids: torch.LongTensor) -> None:
        """Start a new sequence; ``prompt_ids`` is [1, P]."""

    def propose(self, context_ids: torch.LongTensor, state: TargetState, gamma: int, sampler: Sampler) -> Proposal:
        """Exactly ``gamma`` tokens to follow ``context_ids`` ([1, L], the accepted sequence).

        Under a greedy ``sampler`` (``sampler.greedy``) any deterministic choice is
        correct (argmax gives the best acceptance). Otherwise a drafter either
        draws each token with ``sampler.draw(logits)`` and returns the q rows it got,
        or proposes deterministically with ``q=None``; both keep the output exact.
        """

    def accept(self, n_context: int) -> None:
        """The accepted sequence is now ``n_context`` tokens long; drop state beyond that prefix."""



def feature_layers(drafter: Drafter) -> tuple[int, ...]:
    return tuple(getattr(drafter, "feature_layers", ()) or ())


def kv_layers(drafter: Drafter) -> tuple[int, ...]:
    return tuple(getattr(drafter, "kv_layers", ()) or ())


@dataclass
class SpecResult:
    """One speculatively decoded sequence."""

    tokens: list[int]  # generated tokens, prompt excluded
    verify_calls: int
    # Accepted drafts per verification call, each in 0..gamma; a call that ends on an accepted unscored tree
    # node (Proposal.unscored) counts that node as its +1 token, in place of the target's own.
    accepted_per_call: list[int]
    gamma: int
    seconds: float  # wall time, prefill included

    @property
    def tau(self) -> float | None:
        """Tokens per verification call, bonus token included (each call adds the target's own token); None without calls."""
        if not self.verify_calls:
            return None
        return sum(n + 1 for n in self.accepted_per_call) / self.verify_calls

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer.

    transformers 5.x's ``DynamicCache.crop`` takes minus the number of tokens
    to remove (a positive argument, the old "final length", raises).
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra:
        cache.crop(-extra)


def forward_logits(model: torch.nn.Module, input_ids: torch.LongTensor, cache: DynamicCache) -> torch.Tensor:
    """Logits [T, V] for ``input_ids`` [1, T], appending their K/V to ``cache``.

    Models are built with ``config.use_cache=False`` (packed training needs
    it), so the cache must be asked for explicitly.
    """
    return model(input_ids=input_ids, use_cache=True, **cache_kwargs(model, cache)).logits[0]


def forward_tree(model: torch.nn.Module, tokens: list[int], parents: list[int], past: int, cache: DynamicCache,
                 feed: list[int] | None = None):
    """Run ``model`` over tree nodes ``feed`` (default: all of ``tokens``) after ``past`` cached positions.

    Node i sits at position ``past + depth`` (a root, parent -1, at depth 0) and
    attends to the cached prefix, to itself and to its ancestors. ``feed`` is a run of
    consecutive indices; the nodes before it must already be in the cache, in index
    order (``tree.grow_tree`` feeds level by level).
    """
    feed = list(range(len(tokens))) if feed is None else feed
    depths = [d - 1 for d in node_depths(parents)]
    cached = [i for i in range(len(tokens)) if i < feed[0]]
    allowed = torch.cat([torch.ones(len(feed), past, dtype=torch.bool), ancestor_mask(parents)[feed][:, cached + feed]],
                        dim=1)
    dtype = next(model.parameters()).dtype
    return model(input_ids=torch.tensor([[tokens[i] for i in feed]]),
                 position_ids=torch.tensor([[past + depths[i] for i in feed]]),
                 attention_mask=additive(allowed, dtype)[None, None], use_cache=True, **cache_kwargs(model, cache))


def _target_forward(
    target: torch.nn.Module, input_ids: torch.LongTensor, cache: DynamicCache, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward_logits`` plus, when ``layers`` is non-empty, those layers' hidden states concatenated [1, T, len*d]:
    recorded where they are made (``capture_features``, as training reads them), not from ``output_hidden_states``,
    whose last entry some models (DeepSeek-V4) replace with the final normed state."""
    if not layers:
        return forward_logits(target, input_ids, cache), None
    from treadle.drafts.targets import capture_features

    with capture_features(target, layers) as tap:
        return forward_logits(target, input_ids, cache), tap.take()


def _layer_kv(cache: DynamicCache, length: int, index: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s cached K/V (a bare DynamicCache's layer i is decoder layer i: a kv-shared layer, which
    writes none, comes after every layer that does)."""
    layer = cache.layers[index]
    if layer.keys.shape[-2] != length:
        raise RuntimeError(f"target cache holds {layer.keys.shape[-2]} positions, expected {length}")
    return layer.keys, layer.values


def _target_state(cache: DynamicCache, length: int, hidden, kv_layers: tuple[int, ...]) -> TargetState:
    layer_kv = {i: _layer_kv(cache, length, i) for i in kv_layers} or None
    return TargetState(_layer_kv(cache, length), hidden, layer_kv)


def _check_args(prompt_ids: torch.Tensor, max_new_tokens: int, gamma: int = 1) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [1, P] with P >= 1, got {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1 or gamma < 1:
        raise ValueError(f"max_new_tokens and gamma must be >= 1, got {max_new_tokens} and {gamma}")


def _finished(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    # eos may arrive among accepted drafts, not only as a round's last token.
    return len(tokens) >= max_new_tokens or (eos_id is not None and eos_id in tokens)


def _clip(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Cut at the first eos (kept) and at ``max_new_tokens``: a round may overshoot both."""
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens[:max_new_tokens]


def leading_matches(draft: list[int], target: list[int]) -> int:
    """How many draft tokens the target accepts: the length of their common prefix."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def _verify_chain(logits: torch.Tensor, proposal: Proposal, sampler: Sampler) -> tuple[int, int]:
    """(drafts accepted, the target's next token) for a chain scored by the target (``logits`` [gamma + 1, V])."""
    if sampler.greedy:
        # choice[i] is the target's greedy token after verify[:i+1].
        choice = logits.argmax(-1).tolist()
        n = leading_matches(proposal.tokens, choice)
        return n, choice[n]
    path, bonus = verify_sampled(sampler.probs(logits), proposal.tokens, proposal.q, sampler)
    return len(path), bonus


def _verify_tree(
    target: torch.nn.Module, cache: DynamicCache, bonus: int, proposal: Proposal, layers: tuple[int, ...],
    sampler: Sampler,
) -> tuple[list[int], int | None, torch.Tensor | None]:
    """Verification of a draft tree in one target forward: (accepted drafts, next token, hidden rows).

    The bonus and the tree's scored nodes go in together, each attending to the cache,
    its ancestors and itself at position prefix + depth. Greedy: the longest path whose
    every token is the target's argmax after its parent is kept; sampled: the path
    recursive rejection sampling accepts (``verify_sampled``). A path that ends on an
    unscored node (``Proposal.unscored``) has no next token (None): that node is the
    newest token. The cache is compacted to prefix + bonus + the path's scored nodes, as
    if they alone had been verified as a chain.
    """
    drafts = proposal.tokens
    unscored = proposal.unscored or [False] * len(drafts)
    scored = [i for i in range(len(drafts)) if not unscored[i]]
    row = {-1: 0, **{node: r for r, node in enumerate(scored, start=1)}}  # node -> its row in the forward
    if any(proposal.parents[i] not in row for i in range(len(drafts))):
        raise RuntimeError("a draft tree node's parent is unscored: only leaves may be")
    past = cache.get_seq_length()
    from treadle.drafts.targets import capture_features

    with capture_features(target, layers) as tap:  # the features as training reads them (as _target_forward does)
        out = forward_tree(target, [bonus, *(drafts[i] for i in scored)],
                           [-1] + [row[proposal.parents[i]] for i in scored], past, cache)
        features = tap.take() if layers else None
    logits = out.logits[0]
    if sampler.greedy:
        choice = logits.argmax(-1).tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(proposal.parents):
            children.setdefault(parent, []).append(node)
        accepted, node = [], -1
        while node < 0 or not unscored[node]:
            match = [c for c in children.get(node, []) if drafts[c] == choice[row[node]]]
            if not match:
                break
            node = match[0]
            accepted.append(node)
        next_token = choice[row[node]] if node < 0 or not unscored[node] else None
    else:
        p = sampler.probs(logits)
        p = p.new_zeros(len(drafts) + 1, p.shape[-1]).index_copy_(0, torch.tensor([0, *(i + 1 for i in scored)]), p)
        accepted, next_token = verify_sampled(p, drafts, proposal.q, sampler, proposal.parents, proposal.unscored)
    path = [0] + [row[node] for node in accepted if not unscored[node]]
    keep = torch.cat([torch.arange(past), torch.tensor(path) + past])
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(-2, keep), layer.values.index_select(-2, keep)
    hidden = features[:, path] if layers else None
    return [drafts[node] for node in accepted], next_token, hidden


def speculative_generate(
    target: torch.nn.Module,
    drafter: Drafter,
    prompt_ids: torch.LongTensor,
    gamma: int,
    max_new_tokens: int,
    eos_id: int | None = None,
    sampler: Sampler = GREEDY,
    tree: tuple[int, ...] | DynamicTree | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt: greedy, the tokens equal ``target_generate``'s; sampled, their
    distribution equals ``target_generate``'s with the same ``sampler`` settings.

    ``tree``: branching per depth, or a ``DynamicTree``; ``gamma`` must be its depth. A
    drafter with ``propose_tree`` proposes such a tree, one without it a chain of that depth.
    """
    _check_args(prompt_ids, max_new_tokens, gamma)
    if isinstance(tree, DynamicTree):
        if min(tree.top_k, tree.depth, tree.nodes) < 1 or tree.depth != gamma:
            raise ValueError(f"tree {tree}: needs K, D, N >= 1 and gamma == D ({gamma})")
    elif tree is not None and (len(tree) != gamma or min(tree) < 1):
        raise ValueError(f"tree {tree}: needs branchings >= 1 and gamma == its depth ({gamma})")
    grow = getattr(drafter, "propose_tree", None) if tree is not None else None
    target.eval()
    layers = feature_layers(drafter)
    prompt = prompt_ids[0].tolist()
    accepted: list[int] = []
    start = time.perf_counter()
    with torch.inference_mode():
        # A bare DynamicCache holds full (croppable) layers even for models with
        # sliding-window layers, so layers[-1] always covers the whole prefix.
        cache = DynamicCache()
        drafter.reset(prompt_ids)
        # The prefill's token is the first bonus; it is not a verification call.
        logits, hidden = _target_forward(target, prompt_ids, cache, layers)
        tokens = [sampler.draw(logits[-1])[0]]
        while not _finished(tokens, max_new_tokens, eos_id):
            context = prompt + tokens
            state = _target_state(cache, len(context) - 1, hidden, kv_layers(drafter))
            if grow is not None:
                proposal = grow(torch.tensor([context]), state, tree, sampler)
                path, bonus, hidden = _verify_tree(target, cache, tokens[-1], proposal, layers, sampler)
                # A path ending on an unscored node has no bonus: that node is the round's +1 token.
                n = len(path) if bonus is not None else len(path) - 1
                tokens += path + ([bonus] if bonus is not None else [])
            else:
                proposal = drafter.propose(torch.tensor([context]), state, gamma, sampler)
                # A drafter that cuts its proposal (DSpark's confidence early stop) may propose fewer, never more.
                if len(proposal.tokens) > gamma or (len(proposal.tokens) < gamma
                                                    and not getattr(drafter, "cuts_proposals", False)):
                    raise RuntimeError(
                        f"drafter {drafter.name!r} proposed {len(proposal.tokens)} tokens, expected {gamma}")
                verify = torch.tensor([[tokens[-1], *proposal.tokens]])
                logits, hidden = _target_forward(target, verify, cache, layers)
                n, bonus = _verify_chain(logits, proposal, sampler)
                tokens += proposal.tokens[:n] + [bonus]
                # The target has now processed the accepted sequence minus the new bonus.
                crop_cache(cache, len(context) + n)
                if hidden is not None:
                    hidden = hidden[:, : n + 1]
            accepted.append(n)
            drafter.accept(len(context) + n + 1)
    seconds = time.perf_counter() - start
    return SpecResult(_clip(tokens, max_new_tokens, eos_id), len(accepted), accepted, gamma, seconds)


def target_generate(
    target: torch.nn.Module,
    prompt_ids: torch.LongTensor,
    max_new_tokens: int,
    eos_id: int | None = None,
    sampler: Sampler = GREEDY,
) -> tuple[list[int], float]:
    """Plain decoding, one token per forward with a KV cache: (tokens, wall seconds). Greedy unless ``sampler``."""
    _check_args(prompt_ids, max_new_tokens)
    target.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        tokens = [sampler.draw(forward_logits(target, prompt_ids, cache)[-1])[0]]
        while not _finished(tokens, max_new_tokens, eos_id):
            tokens.append(sampler.draw(forward_logits(target, torch.tensor([[tokens[-1]]]), cache)[-1])[0])
    return tokens, time.perf_counter() - start


POSITION_BUCKET = 64  # tau_by_position: generated tokens per bucket


def tau_by_position(results: list[SpecResult], bucket: int = POSITION_BUCKET) -> list[float]:
    """tau of the verification calls that start in generated tokens [0, bucket), [bucket, 2 bucket), ...: how
    acceptance changes as the output grows (one call's start is 1 + the tokens the calls before it emitted, the
    first token being the prefill's). Pooled over sequences: calls of every prompt in a bucket count alike."""
    sums: dict[int, list[int]] = {}
    for r in results:
        start = 1
        for n in r.accepted_per_call:
            total = sums.setdefault(start // bucket, [0, 0])
            total[0] += n + 1
            total[1] += 1
            start += n + 1
    return [sums[b][0] / sums[b][1] for b in sorted(sums)]


def summarize(results: list[SpecResult], gamma: int) -> dict:
    """Acceptance statistics over all verification calls of ``results``.

    ``tau`` is tokens per verification call, bonus token included, so
    ``tau == 1 + sum(acceptance_unconditional)`` (E[n+1] = 1 + sum_k P(n >= k)).
    Rates that are undefined (no calls, or no call reached position k-1) are None. The rates come from counts
    pooled over every call of every sequence (never an average of per-sequence rates), so they do not depend on
    how the calls are batched or split into prompts: ``expected_accepted`` = sum_k prod_{i <= k}
    acceptance_conditional[i] is then exactly ``tau - 1``.
    """
    accepted = [n for r in results for n in r.accepted_per_call]
    calls = len(accepted)
    reached = [sum(n >= k for n in accepted) for k in range(gamma + 1)]  # reached[0] == calls
    conditional = [reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, gamma + 1)]
    survive, expected = 1.0, 0.0
    for rate in conditional:
        survive *= rate or 0.0
        expected += survive
    return {
        "gamma": gamma,
        "tau": sum(n + 1 for n in accepted) / calls if calls else None,
        "acceptance_conditional": conditional,
        "acceptance_unconditional": [reached[k] / calls if calls else None for k in range(1, gamma + 1)],
        "expected_accepted": expected if calls else None,
        "tau_by_position": tau_by_position(results),
        "verify_calls": calls,
        "generated_tokens": sum(len(r.tokens) for r in results),
    }
