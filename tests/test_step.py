"""The loss-normalization rule: GA=4 x mb 2 gives the gradients of GA=1 x mb 8."""

import math

import pytest
import torch

from treadle.config import ModelConfig
from treadle.engine import LocalEngine
from treadle.models.hf import build_model
from treadle.train.step import IGNORE_INDEX, loss_sum, optimizer_step

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


class GradRecordingEngine(LocalEngine):
    """The real local engine; it only keeps a copy of the gradients it is about to apply."""

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        super().step()


def make_batch(n=8, t=24, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    for i in range(n):  # very different numbers of valid label tokens per sequence
        labels[i, : 3 * i] = IGNORE_INDEX
    pos = torch.arange(t).repeat(n, 1)
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": pos}


def split(batch, mb):
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + mb] for k, v in batch.items()} for i in range(0, n, mb)]


def run(micro_batches, loss_fn=loss_sum):
    torch.manual_seed(0)
    model = build_model(ModelConfig(overrides=TINY), vocab_size=97)
    engine = GradRecordingEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.device("cpu"))
    result = optimizer_step(engine, micro_batches, grad_clip=0.0, loss_fn=loss_fn)
    return result, engine.grads


def max_rel_diff(a, b):
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


def test_grad_accumulation_matches_one_big_batch():
    batch = make_batch()
    counts = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in split(batch, 2)]
    assert len(set(counts)) == 4  # the micro-batches really differ in valid tokens
    big, g_big = run(split(batch, 8))
    acc, g_acc = run(split(batch, 2))
    assert acc.label_tokens == big.label_tokens == sum(counts)
    assert acc.loss == pytest.approx(big.loss, rel=1e-6)
    assert max_rel_diff(g_acc, g_big) <= 1e-6
    # The same split with a mean of micro-batch means is measurably wrong: the check above can fail.
    def mean_of_means(model, mb):
        return loss_sum(model, mb).sum() / int((mb["labels"] != IGNORE_INDEX).sum()) * acc.label_tokens / len(counts)
    _, g_naive = run(split(batch, 2), loss_fn=mean_of_means)
    assert max_rel_diff(g_naive, g_big) > 1e-3


def test_step_loss_is_token_weighted_mean_and_clip_reports_the_unclipped_norm():
    batch = make_batch(seed=1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(overrides=TINY), vocab_size=97)
    with torch.no_grad():
        expected = loss_sum(model, batch).sum().item() / int((batch["labels"] != IGNORE_INDEX).sum())
    engine = GradRecordingEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.device("cpu"))
    result = optimizer_step(engine, split(batch, 4), grad_clip=1e-3)
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.grad_norm > 1e-3  # reported before clipping
    clipped = math.sqrt(sum(g.pow(2).sum().item() for g in engine.grads.values()))
    assert clipped == pytest.approx(1e-3, rel=1e-4)  # what the optimizer saw was clipped
    assert result.applied


def test_non_finite_loss_skips_the_update():
    batch = make_batch(seed=2)
    torch.manual_seed(0)
    model = build_model(ModelConfig(overrides=TINY), vocab_size=97)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = LocalEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.device("cpu"))
    result = optimizer_step(engine, [batch], grad_clip=1.0, loss_fn=lambda m, b: loss_sum(m, b) * float("nan"))
    assert not result.applied
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
