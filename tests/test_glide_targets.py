"""GLIDE against what target families change: how the target's attention reads a 4-D mask (eager adds it), the
target's logit transform (Granite's scale, Gemma's soft-cap) on the teacher and the draft's head, and the K/V the
draft captures from each family's last layer (its own cache's entries). float64 throughout: equalities are exact up
to rounding, and a wrong mask or a skipped transform is far outside it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET
from treadle.models.glide import GlideDraft, GlideModel

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = dict(rtol=1e-12, atol=1e-12)
# transformers' eager attention takes its softmax in fp32 whatever the model's dtype: eager against sdpa agrees to fp32
EAGER = dict(rtol=1e-5, atol=1e-6)


def packed_rows():
    """Two rows, the first packing two documents (the mask must keep them apart as well as causal)."""
    torch.manual_seed(3)
    ids = torch.randint(0, TARGET["vocab_size"], (2, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    return ids, positions


def test_glide_with_an_eager_target_equals_glide_with_an_sdpa_target():
    """transformers' eager attention adds a 4-D mask to the scores: a boolean one (1 / 0) would hide nothing, so the
    target's logits, its captured K/V and the draft's logits would see the future and other documents."""
    outputs, losses = {}, {}
    ids, positions = packed_rows()
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(LlamaConfig(**TARGET), attn_implementation=attn).double()
        assert target.config._attn_implementation == attn
        model = GlideModel(target, GlideDraft(target.config).double()).eval()
        out = model(ids, positions, lag=1)
        losses[attn] = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        outputs[attn] = out
    # Both equal the target's own logits where a row is one document (its forward builds its own mask then).
    with torch.no_grad():
        own = model.target(ids[1:]).logits[0]
    for attn in ("sdpa", "eager"):
        torch.testing.assert_close(outputs[attn].target_logits[1], own, **EAGER)
    torch.testing.assert_close(outputs["eager"].target_logits, outputs["sdpa"].target_logits, **EAGER)
    torch.testing.assert_close(outputs["eager"].logits, outputs["sdpa"].logits, **EAGER)
    torch.testing.assert_close(losses["eager"], losses["sdpa"], **EAGER)
