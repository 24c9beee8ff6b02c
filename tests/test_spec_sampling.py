"""Sampled speculative decoding: the output has the target's own sampling distribution (a statistical test)."""

import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treadle.speculative.decode import Proposal, speculative_generate, target_generate
from treadle.speculative.drafters import ModelDrafter, PromptLookupDrafter
from treadle.speculative import sampling
from treadle.speculative.sampling import Sampler
from treadle.speculative.tree import DynamicTree

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 4
K = 3  # first-K generated tokens: the prefill's token, then a round's drafts (accepted, or resampled from the residual)
PROMPT = torch.tensor([[0, 1, 2, 3, 1]])


def tiny(seed, sharpen=20):
    """A 1-layer Llama over 4 tokens with a sharpened head: distributions far from uniform, different per seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def exact_distribution(target, sampler):
    """P(first K tokens = s) under the target's own sampling, for every s in VOCAB**K (product of its probs)."""
    dist = {}
    with torch.inference_mode():
        for seq in itertools.product(range(VOCAB), repeat=K):
            ids = torch.cat([PROMPT, torch.tensor([seq[:-1]])], 1)
            probs = sampler.probs(target(input_ids=ids).logits[0, -K:])
            dist[seq] = math.prod(float(probs[i, seq[i]]) for i in range(K))
    return dist


def chi_square(counts, dist, n):
    """Pearson's statistic, cells with expected count < 5 pooled; (statistic, degrees of freedom).
    A sample in a cell of probability 0 (outside top-p) is an impossible outcome: infinite."""
    if any(counts.get(s, 0) and p == 0 for s, p in dist.items()):
        return math.inf, 1
    big = [s for s, p in dist.items() if n * p >= 5]
    cells = [(counts.get(s, 0), n * dist[s]) for s in big]
    rest = n - sum(c for c, _ in cells), n * (1 - sum(dist[s] for s in big))
    if rest[1] > 0:
        cells.append(rest)
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def critical(dof, z=3.29):
    """Chi-square quantile at p = 0.9995 (z = 3.29) by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def speculative_counts(target, drafter, sampler, runs, gamma=2, tree=None):
    counts = {}
    for _ in range(runs):
        seq = tuple(speculative_generate(target, drafter, PROMPT, gamma, K, sampler=sampler, tree=tree).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


class AlwaysAccept(Sampler):
    """The broken rule the test must catch: every draft accepted, whatever p and q say."""

    def accepts(self, p_x, q_x):
        return True


def total_variation(counts, dist, n):
    return 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in dist.items())


def sampling_noise_tv(dist, n):
    """The total variation an exact sampler's histogram of n draws shows on average: 0.5 sum sqrt(2p(1-p)/(pi n))."""
    return 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in dist.values())


RUNS = 600


@pytest.mark.parametrize("temperature,top_p,drafter", [(1.0, 1.0, "lm"), (0.8, 0.9, "lookup")])
def test_speculative_sampling_has_the_targets_distribution(temperature, top_p, drafter):
    """Over 600 seeded runs, the first 3 tokens' histogram passes a chi-square goodness-of-fit test against the
    target's exact sampling distribution at p = 0.0005 (cells with expected count < 5 pooled, ~20 cells), and its
    total variation from it stays under twice what sampling noise alone gives (~0.08, so the bound is ~0.16).
    A sampled draft (q rows: ModelDrafter) and a deterministic one (one-hot q: prompt lookup), with top-p."""
    target = tiny(0)
    sampler = Sampler(temperature, top_p, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    draft = ModelDrafter(tiny(1)) if drafter == "lm" else PromptLookupDrafter()
    counts = speculative_counts(target, draft, sampler, RUNS)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)
    if top_p < 1:
        assert sum(p == 0 for p in dist.values()) > 0  # top-p removed some outcomes, and none was sampled


def test_a_broken_acceptance_rule_fails_the_same_test():
    target = tiny(0)
    dist = exact_distribution(target, Sampler(1.0))
    broken = AlwaysAccept(1.0, generator=torch.Generator().manual_seed(0))
    counts = speculative_counts(target, ModelDrafter(tiny(1)), broken, RUNS)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat > critical(dof)
    assert total_variation(counts, dist, RUNS) > 2 * sampling_noise_tv(dist, RUNS)


TREE = (2, 2)  # 2 + 4 nodes over a 4-token vocabulary: siblings are often rejected in turn


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampled_tree_verification_has_the_targets_distribution(temperature, top_p):
    """The same test for a sampled tree: an LM draft draws each node's children without replacement (renormalized
    q rows), recursive rejection sampling verifies; with top-p some nodes get a single child."""
    target = tiny(0)
    sampler = Sampler(temperature, top_p, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, ModelDrafter(tiny(1)), sampler, RUNS, gamma=len(TREE), tree=TREE)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def p_kept_after_a_rejection(p, x, q_row):
    """The broken rule: a rejected child leaves p as it was, instead of the normalized max(0, p - q)."""
    return p


def test_a_sampled_tree_that_keeps_p_after_a_rejected_sibling_fails_the_same_test(monkeypatch):
    target = tiny(0)
    sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    monkeypatch.setattr(sampling, "residual", p_kept_after_a_rejection)
    counts = speculative_counts(target, ModelDrafter(tiny(1)), sampler, RUNS, gamma=len(TREE), tree=TREE)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat > critical(dof)
    assert total_variation(counts, dist, RUNS) > 2 * sampling_noise_tv(dist, RUNS)


def test_target_alone_sampling_follows_the_same_distribution():
    """target_generate with a sampler (spec-eval's baseline at T > 0) samples the distribution the test uses."""
    target = tiny(0)
    sampler = Sampler(0.8, 0.9, torch.Generator().manual_seed(1))
    dist = exact_distribution(target, sampler)
    counts = {}
    for _ in range(RUNS):
        seq = tuple(target_generate(target, PROMPT, K, sampler=sampler)[0])
        counts[seq] = counts.get(seq, 0) + 1
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def test_top_p_keeps_the_smallest_set_reaching_p():
    sampler = Sampler(1.0, top_p=0.7)
    probs = sampler.probs(torch.tensor([0.5, 0.3, 0.15, 0.05]).log())
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    torch.testing.assert_close(Sampler(1.0, top_p=0.5).probs(torch.tensor([0.5, 0.5]).log()), torch.tensor([1.0, 0]))
    assert Sampler().probs(torch.tensor([0.1, 2.0, 0.3])).tolist() == [0, 1, 0]
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            Sampler(**bad)


DRAFT_SHARPEN = 2  # a flatter draft than the target: keeping the likeliest drawn nodes then biases much


@pytest.mark.parametrize("temperature,top_p,shape", [(1.0, 1.0, DynamicTree(2, 2, 1)),
                                                     (0.8, 0.9, DynamicTree(2, 2, 3))])
def test_sampled_dynamic_tree_has_the_targets_distribution(temperature, top_p, shape):
    """EAGLE-2's dynamic tree, sampled (tree.py): children drawn without replacement, the likeliest drawn nodes kept,
    the unkept drawn children of kept nodes tried unscored. dynamic:2,2,1 keeps 1 of 6 drawn nodes (every other
    reachable one is unscored); dynamic:2,2,3 keeps 3, at both depths, with top-p."""
    target = tiny(0)
    sampler = Sampler(temperature, top_p, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, ModelDrafter(tiny(1, DRAFT_SHARPEN)), sampler, RUNS, gamma=shape.depth,
                                tree=shape)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


class KeptOnly(ModelDrafter):
    """The broken variant: the kept nodes alone verified with their q rows (the unscored drawn siblings dropped).
    Keeping the likeliest drawn nodes selects on their values, so a kept node is no longer a draw from its row."""

    def propose_tree(self, context_ids, state, branching, sampler):
        proposal = super().propose_tree(context_ids, state, branching, sampler)
        kept = [i for i, unscored in enumerate(proposal.unscored) if not unscored]
        index = {node: i for i, node in enumerate(kept)}
        return Proposal([proposal.tokens[i] for i in kept], proposal.q[kept],
                        [index.get(proposal.parents[i], -1) for i in kept])


def test_a_sampled_dynamic_tree_verifying_only_its_kept_nodes_fails_the_same_test():
    """Twice the runs: the bias is smaller than the static tree's broken rule's (measured: chi-square ~180 against
    a bound of 55, total variation 0.17 against 0.12)."""
    target, runs, shape = tiny(0), 2 * RUNS, DynamicTree(2, 2, 1)
    sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, KeptOnly(tiny(1, DRAFT_SHARPEN)), sampler, runs, gamma=shape.depth, tree=shape)
    stat, dof = chi_square(counts, dist, runs)
    assert stat > critical(dof)
    assert total_variation(counts, dist, runs) > 2 * sampling_noise_tv(dist, runs)


def test_a_sampled_dynamic_tree_keeps_n_nodes_and_tries_their_drawn_siblings_unscored():
    """The shape the exactness rests on: N nodes scored (ancestor-closed), every other node an unscored leaf whose
    parent is scored; siblings in draw order, each q row its parent's distribution without the earlier siblings."""
    drafter, shape = ModelDrafter(tiny(1, DRAFT_SHARPEN)), DynamicTree(3, 3, 4)
    for seed in range(5):
        drafter.reset(PROMPT)
        p = drafter.propose_tree(PROMPT, None, shape, Sampler(1.0, generator=torch.Generator().manual_seed(seed)))
        scored = [i for i, u in enumerate(p.unscored) if not u]
        assert len(scored) == shape.nodes and all(p.parents[i] in [-1, *scored] for i in range(len(p.tokens)))
        assert not any(p.parents[i] == j for i in range(len(p.tokens)) for j in range(len(p.tokens)) if p.unscored[j])
        for parent in {-1, *scored}:
            siblings = [i for i in range(len(p.tokens)) if p.parents[i] == parent]
            assert len({p.tokens[i] for i in siblings}) == len(siblings)
            for before, after in zip(siblings, siblings[1:]):
                expected = p.q[before].clone()
                expected[p.tokens[before]] = 0
                torch.testing.assert_close(p.q[after], expected / expected.sum())
