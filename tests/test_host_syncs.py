"""Host syncs of a training forward: what bench/step_profile.py counts, held where a change removed one."""

import torch

from treadle.config import ModelConfig
from treadle.models import attention
from treadle.models.hf import build_model


def _forward(model, position_ids):
    ids = torch.arange(position_ids.numel()).remainder(200).view_as(position_ids)
    return model(input_ids=ids, position_ids=position_ids, use_cache=False).logits


def test_varlen_finds_a_rows_documents_once_per_forward_and_attends_as_the_dense_mask_does(monkeypatch):
    """Every layer is handed the same position ids: Documents.of (a .nonzero().tolist(), a host sync on a GPU) runs
    once per forward, not once per layer; a tensor written in place is read again; the logits are the dense
    path's (float64)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), 256).double().eval()  # the tiny preset: 4 layers
    positions = torch.cat([torch.arange(40), torch.arange(24)])[None]  # two documents in one row
    dense = _forward(model, positions)
    attention.use(model, "varlen")
    calls = []
    found = attention.Documents.of
    monkeypatch.setattr(attention.Documents, "of", classmethod(lambda cls, p: calls.append(p) or found(p)))
    varlen = _forward(model, positions)
    assert len(calls) == 1  # 4 before: a fresh .expand() view per layer never matched the cache
    torch.testing.assert_close(varlen, dense, rtol=1e-10, atol=1e-10)

    positions[0, 40:] = torch.arange(40, 64)  # the same tensor, now one document: found again, not reused
    one = _forward(model, positions)
    assert len(calls) == 2 and attention._documents.value.spans == (((0, 64),),)
    model.set_attn_implementation("sdpa")  # dense: transformers' mask (attention.use leaves "dense" as it is)
    torch.testing.assert_close(one, _forward(model, positions), rtol=1e-10, atol=1e-10)
