"""EAGLE-3 at real lengths: the unroll's attention without dense masks and its scores chunk by chunk equal the dense
reference (drafts/eagle3/attention.py, drafts/ttt_scores.py). Float64 unless a test says otherwise."""

import pytest
import torch

from tests.test_eagle3 import eagle3
from treadle.config import DraftConfig
from treadle.drafts.eagle3.attention import unroll_attention
from treadle.drafts.glide.model import document_ids, sdpa, ttt_mask
from treadle.drafts.eagle3.objective import Eagle3Objective

# Three packed documents, one of them a single token: rows whose keys start mid-chunk, a row that sees only itself.
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6],
                          [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1]])


def _grads(out, tensors):
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    return torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_unroll_attention_equals_the_dense_ttt_mask(step):
    """Outputs and gradients (queries, step 0's keys/values, every chain step's) of one step, grouped K/V heads,
    chunks of 4 rows that cut documents."""
    g = torch.Generator().manual_seed(step)
    B, H, Hkv, T, D = 2, 4, 2, POSITIONS.shape[1], 8
    doc = document_ids(POSITIONS)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()

    q = rand(B, H, T, D)
    keys = [(rand(B, Hkv, T, D), rand(B, Hkv, T, D)) for _ in range(step + 1)]  # steps 0..step
    tensors = [q, *(x for kv in keys for x in kv)]
    dense = sdpa(q, torch.cat([k for k, _ in keys], 2), torch.cat([v for _, v in keys], 2), ttt_mask(doc, step))
    got = unroll_attention(q, keys[0], tuple(keys[1:]), doc, chunk_rows=4)
    assert torch.allclose(got, dense, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(got, tensors), _grads(dense, tensors)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def _model(vocab, dense):
    model = eagle3(vocab=vocab).double().train()
    model.dense_attention = dense
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, POSITIONS.shape, generator=g)
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 4] = labels[1, 10] = -100  # document ends
    return {"input_ids": ids, "labels": labels, "position_ids": POSITIONS}


def _step(model, cfg, chunk):
    model.loss_chunk_tokens = chunk
    model.draft_model.zero_grad()
    loss, side = Eagle3Objective(cfg, 512, POSITIONS.shape[1])(model, _batch())
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.draft_model.named_parameters()}
    return float(loss.detach().sum()), {k: float(v) for k, v in side.items()}, grads


@pytest.mark.parametrize("vocab", [None, 64])
def test_masked_free_chunked_eagle3_equals_the_dense_unchunked_step(vocab):
    """Loss, side sums (target CE, draft CE / KL, acc_k hits and rows) and every draft gradient: the new attention
    and chunked scores (chunks of 5 rows, crossing documents and steps) against dense masks and whole logits."""
    cfg = DraftConfig(kind="eagle3", target="x", loss="mix", ttt_steps=4, ttt_decay=0.7)
    model = _model(vocab, dense=True)
    want = _step(model, cfg, 0)
    model.dense_attention = False
    for chunk in (0, 5):
        got = _step(model, cfg, chunk)
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        assert got[1].keys() == want[1].keys() and "ttt_rows_4" in got[1]
        for key, value in want[1].items():
            assert got[1][key] == pytest.approx(value, rel=1e-12, abs=1e-12), (chunk, key)
        for name, grad in want[2].items():
            assert torch.allclose(got[2][name], grad, rtol=1e-9, atol=1e-12), (chunk, name)
    assert sum(g.abs().sum() for g in want[2].values()) > 0 and want[1]["draft_ce"] > 0


def test_chunked_eagle3_in_fp32_is_within_1e5_of_whole_logits():
    cfg = DraftConfig(kind="eagle3", target="x", loss="kl", ttt_steps=3)
    model = eagle3(vocab=64).train()
    want, got = _step(model, cfg, 0), _step(model, cfg, 4)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[1]["ttt_hits_3"] == want[1]["ttt_hits_3"]
    for name, grad in want[2].items():
        assert (got[2][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-7, name
