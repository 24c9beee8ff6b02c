"""Mixtures of sources: proportions, temperature, phases, and the loader's one global order across ranks and resumes."""

import numpy as np
import pytest
import torch

from treadle.data.loader import StepLoader
from treadle.data.mixture import CHUNK, Mixture, Phase, probabilities
from treadle.data.packed import PackedDataset
from treadle.errors import UserError
from tests.test_packed import write_shard

SEQ = 4
SIZES = {"a": 37, "b": 11, "c": 23}  # samples per source
BASES = {"a": 0, "b": 10_000, "c": 20_000}  # first token of each source: a row's first id names source and sample


@pytest.fixture
def sources(tmp_path):
    return {n: PackedDataset([write_shard(tmp_path / n, [list(range(BASES[n], BASES[n] + SIZES[n] * SEQ + 1))])], SEQ)
            for n in SIZES}


def rows(batches):
    """(source, sample) of every row, read back from the token ids themselves."""
    out = []
    for b in batches:
        for first, src in zip(b["input_ids"][:, 0].tolist(), b["source"].tolist()):
            name = max((n for n in BASES if first >= BASES[n]), key=BASES.get)
            assert list(SIZES).index(name) == src  # the batch's source column says the same
            out.append((name, (first - BASES[name]) // SEQ))
    return out


def test_probabilities_follow_weight_to_the_one_over_temperature():
    assert probabilities([1, 4]) == pytest.approx([0.2, 0.8])
    assert probabilities([1, 4], temperature=2.0) == pytest.approx([1 / 3, 2 / 3])  # sqrt flattens
    assert probabilities([1, 4], temperature=0.5) == pytest.approx([1 / 17, 16 / 17])  # square sharpens
    assert probabilities([0, 1, 3], temperature=3.0)[0] == 0.0  # a weight of 0 stays off at any temperature
    with pytest.raises(UserError):
        probabilities([0, 0])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_drawn_proportions_match_the_probabilities(temperature):
    weights = [1.0, 2.0, 5.0]
    mix = Mixture(["a", "b", "c"], weights, temperature=temperature)
    n = 200_000
    counts = np.bincount(mix.sources(seed=3, start=0, count=n, step=0), minlength=3)
    p = probabilities(weights, temperature)
    # Binomial counts: within 4 standard deviations of n*p (fails by chance about once in 16,000 runs).
    assert np.all(np.abs(counts - n * p) <= 4 * np.sqrt(n * p * (1 - p))), (counts / n, p)


def test_source_draws_depend_only_on_seed_and_position():
    mix = Mixture(["a", "b"], [1.0, 1.0])
    whole = mix.sources(seed=5, start=0, count=3 * CHUNK, step=0)
    pieces = np.concatenate([Mixture(["a", "b"], [1.0, 1.0]).sources(5, s, 1000, 0) for s in range(0, 3 * CHUNK, 1000)])
    assert np.array_equal(whole, pieces[: 3 * CHUNK])  # any slicing of positions (ranks, steps) draws the same
    assert not np.array_equal(whole, mix.sources(seed=6, start=0, count=3 * CHUNK, step=0))


def test_phase_switches_weights_and_lr_scale_at_its_start_step():
    mix = Mixture(["a", "b"], [1.0, 1.0], [Phase(10, (0.0, 1.0), lr_scale=0.25)])
    assert mix.lr_scale(9) == 1.0 and mix.lr_scale(10) == 0.25 and mix.phase_index(1000) == 1
    before, after = mix.sources(0, 0, 5000, step=9), mix.sources(0, 0, 5000, step=10)
    assert 0.45 < before.mean() < 0.55 and after.min() == 1  # the same positions, another phase, only b


def test_loader_resumes_at_another_world_size_exactly(sources):
    mix = lambda: Mixture(list(SIZES), [3.0, 1.0, 1.0], [Phase(4, (0.0, 1.0, 2.0), 0.5)], temperature=2.0)  # noqa: E731
    one = StepLoader(sources, micro_batch_size=2, grad_accum_steps=4, seed=9, mixture=mix())
    want = [rows(one.next_step(s)) for s in range(8)]  # crosses the phase at step 4 and epochs of b
    flat = [r for step in want for r in step]
    assert {n for n, _ in flat[: 4 * 8]} >= {"a", "b", "c"} and "a" not in {n for n, _ in flat[4 * 8 :]}
    # Within a source, the samples follow its own permutation without gaps or repeats per epoch.
    b_samples = [i for n, i in flat if n == "b"]
    assert sorted(b_samples[: SIZES["b"]]) == list(range(SIZES["b"]))

    # A 1-process run checkpointed after step 3 resumes as 2 ranks (GA 2: same global batch) and as 4 ranks (GA 1).
    first = StepLoader(sources, micro_batch_size=2, grad_accum_steps=4, seed=9, mixture=mix())
    for s in range(3):
        first.next_step(s)
    state = first.state_dict()
    assert state["position"] == 24 and sum(v["cursor"] for v in state["sources"].values()) == 24
    for ws, ga in ((2, 2), (4, 1)):
        ranks = [StepLoader(sources, 2, ga, seed=9, rank=r, world_size=ws, mixture=mix()) for r in range(ws)]
        for r in ranks:
            r.load_state_dict(state)
        for s in range(3, 8):
            got = [rows(r.next_step(s)) for r in ranks]
            # Rank r's micro-batch m holds global rows (m*ws + r)*mb ...: interleave back to the global order.
            merged = [row for m in range(ga) for r in range(ws) for row in got[r][m * 2 : m * 2 + 2]]
            assert merged == want[s], (ws, s)
        assert ranks[0].tokens_by_source(SEQ) == one.tokens_by_source(SEQ)


def test_prefetch_gives_the_same_batches_and_survives_a_rewind(sources):
    mix = lambda: Mixture(list(SIZES), [1.0, 1.0, 1.0], [Phase(3, (1.0, 0.0, 1.0))])  # noqa: E731
    plain = StepLoader(sources, 3, 2, seed=1, mixture=mix())
    ahead = StepLoader(sources, 3, 2, seed=1, mixture=mix(), prefetch=True)
    want = [plain.next_step(s) for s in range(6)]
    for s in range(3):
        got = ahead.next_step(s)
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want[s]) for k in w)
    ahead.load_state_dict(StepLoader(sources, 3, 2, seed=1, mixture=mix()).state_dict())  # rewind: stale prefetch
    for s in range(6):
        got = ahead.next_step(s)
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want[s]) for k in w)
    ahead.close()  # fit() closes its loader; a later fit() on the same trainer must still get data
    assert all(torch.equal(g[k], w[k]) for g, w in zip(ahead.next_step(6), plain.next_step(6)) for k in w)
    ahead.close()


def test_loader_state_from_other_sources_is_refused(sources):
    two = StepLoader({n: sources[n] for n in ("a", "b")}, 2, 1, seed=0, mixture=Mixture(["a", "b"]))
    three = StepLoader(sources, 2, 1, seed=0, mixture=Mixture(list(SIZES)))
    with pytest.raises(UserError, match="sources"):
        three.load_state_dict(two.state_dict())
