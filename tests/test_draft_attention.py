"""model.attention in draft runs (issue 40): the frozen target on varlen is handed no [T, T] mask (the attention finds
the documents from the position ids), and every kind's training loss and draft gradients equal those with the target
on the dense mask; the drafts' own masks through FlexAttention (drafts/masks.py) give the dense masks' logits. float64 on CPU, on packed rows of many short documents (1 to 3 tokens among them) and documents
longer than the target's sliding window, with an anchor offset that makes positions jump forward inside a document."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.helpers import TARGET
from treadle import compat
from treadle.config import DraftConfig
from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.masks import Rule
from treadle.models import attention
from treadle.models.hf import decoder_layers

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6
# Row 0: many short documents, then two longer than the window; row 1: one long document and a 1-token one.
LENGTHS = [[1, 2, 3, 1, 3, 2, 12, 8], [21, 1, 10]]
T = 32


def packed_batch() -> dict:
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TARGET["vocab_size"], (2, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[positions.roll(-1, 1) == 0] = IGNORE_INDEX  # a document's last token predicts nothing across the cut
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": positions}


def windowed_target(layers: int):
    """A Qwen2 target whose layers but the last attend within WINDOW tokens (GLIDE reads a full last layer)."""
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    config = Qwen2Config(**{**TARGET, "num_hidden_layers": layers}, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=0, layer_types=types)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().eval()


def sharpen(model):
    for p in model.draft_model.parameters():  # sharp attention: a token read across a document's cut shows
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def glide():
    from treadle.drafts.glide.model import GlideDraft, GlideModel
    from treadle.drafts.glide.objective import GlideObjective

    target = windowed_target(2)
    cfg = DraftConfig(kind="glide", loss="mix", kl_weight=0.3)
    return GlideModel(target, GlideDraft(target.config, window=WINDOW - 1).double()), lambda m, b: GlideObjective(cfg, 512, T).losses(
        m, b, lag=2, offset=40, train=True)


def eagle3():
    from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model
    from treadle.drafts.eagle3.objective import Eagle3Objective

    target = windowed_target(3)
    cfg = DraftConfig(kind="eagle3", loss="mix", kl_weight=0.3, ttt_steps=3)
    return Eagle3Model(target, Eagle3Draft(target.config, (1, 2, 3)).double()), \
        lambda m, b: Eagle3Objective(cfg, 512, T).losses(m, b, lag=1, offset=40, train=True)


def dflash():
    from treadle.drafts.dflash.model import DFlashDraft, DFlashModel
    from treadle.drafts.dflash.objective import DFlashObjective

    target = windowed_target(3)
    cfg = DraftConfig(kind="dflash", loss="mix", kl_weight=0.3, block_size=4, anchors=5)
    return DFlashModel(target, DFlashDraft(target.config, (1, 3), 2, 4, 511).double()), \
        lambda m, b: DFlashObjective(cfg, T, 512).losses(m, b, 40, train=True)


def mtp():
    from tests.test_mtp import tiny_target
    from treadle.drafts.mtp.model import MtpDraft, MtpModel
    from treadle.drafts.recurrent import RecurrentObjective

    target = tiny_target(1, family="glm4_moe")  # no sliding window in an MTP family
    target.config._experts_implementation = "eager"  # torch._grouped_mm has no float64 kernel
    cfg = DraftConfig(kind="mtp", loss="mix", kl_weight=0.3, ttt_steps=3)
    return MtpModel(target, MtpDraft(target)).double(), \
        lambda m, b: RecurrentObjective(cfg, 512, T).losses(m, b, 0, 40, train=True)


def frozen_kv():
    from tests.test_frozen_kv import tiny_target
    from treadle.drafts.frozen_kv.model import FrozenKvDraft, FrozenKvModel, new_assistant
    from treadle.drafts.recurrent import RecurrentObjective

    target = tiny_target(1, sliding_window=WINDOW).double()  # Gemma 4: sliding and full layers
    cfg = DraftConfig(kind="frozen_kv", loss="mix", kl_weight=0.3, ttt_steps=3)
    return FrozenKvModel(target, FrozenKvDraft(new_assistant(target, 2))).double(), \
        lambda m, b: RecurrentObjective(cfg, 512, T).losses(m, b, 0, 40, train=True)


KINDS = {"glide": glide, "eagle3": eagle3, "dflash": dflash, "mtp": mtp, "frozen_kv": frozen_kv}


def build(kind: str):
    if kind == "frozen_kv" and not compat.gemma4_kv_sharing():
        pytest.skip("frozen_kv needs transformers >= 5.23")
    torch.manual_seed(1)
    model, loss = KINDS[kind]()
    return sharpen(model).train(), loss


def masks_seen(target) -> list:
    """Records the ``attention_mask`` each decoder layer of ``target`` is called with."""
    seen = []
    for layer in decoder_layers(target):
        layer.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    return seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_target_on_varlen_gets_no_mask_and_trains_the_draft_as_on_dense(kind):
    dense, objective = build(kind)
    varlen, _ = build(kind)  # built again, not copied: a copy's WHOLE would not be the module's (sequence slices)
    attention.use(varlen.target, "varlen")
    batch = packed_batch()
    results = []
    for model in (dense, varlen):
        seen = masks_seen(model.target)
        loss, side = objective(model, batch)
        loss.sum().backward()
        results.append((loss, side, {n: p.grad for n, p in model.draft_model.named_parameters()}))
        if model is varlen:  # no [T, T] mask built for the target: its layers find the documents themselves
            assert seen and all(m is None for m in seen), kind
        else:
            assert seen and all(m is not None for m in seen), kind
    (want, want_side, want_grads), (got, got_side, got_grads) = results
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for k in want_side:
        torch.testing.assert_close(got_side[k], want_side[k], rtol=1e-10, atol=1e-12, msg=k)
    assert any(g is not None and g.abs().sum() > 0 for g in want_grads.values())
    for name, g in want_grads.items():
        assert (g is None) == (got_grads[name] is None), name
        if g is not None:
            torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)


def draft_logits(kind: str, model, steps: int) -> list[torch.Tensor]:
    """The draft's logits on the packed batch (positions offset by 40 past the anchor, as training draws them)."""
    from treadle.drafts.glide.model import anchored_positions

    batch = packed_batch()
    ids, doc_positions = batch["input_ids"], batch["position_ids"]
    positions = anchored_positions(doc_positions, 4, 40)
    if kind == "glide":
        out = model(ids, positions, lag=2, doc_position_ids=doc_positions, steps=steps)
        return [out.logits, *(out.chain_logits or [])]
    if kind == "eagle3":
        return model(ids, positions, steps=steps, doc_position_ids=doc_positions).logits
    # DFlash: blocks anchored in 1-token documents (0, 6 of row 0; 21 of row 1), at a document's end and mid-document
    anchors = torch.tensor([[0, 1, 3, 6, 16, 24], [0, 5, 20, 21, 25, 30]])
    return [model(ids, positions, anchors, doc_position_ids=doc_positions).logits]


@pytest.mark.parametrize("kind, steps", [("glide", 1), ("glide", 3), ("eagle3", 3), ("dflash", 1)])
def test_the_drafts_masks_through_flex_give_the_dense_masks_logits(kind, steps, monkeypatch):
    """Each draft mask is one rule (drafts/masks.py): its BlockMask through FlexAttention (eager on CPU, forward
    only: torch has no CPU flex backward) gives the logits of its dense form through sdpa. GLIDE with a
    self-attention window and a lagged cross-attention, plain and unrolled; EAGLE-3's unroll (its dense-free step-0
    attention against every step's keys under the rule); DFlash's anchored blocks."""
    model, _ = build(kind)
    model.eval()
    attention.use(model.target, "varlen")  # as a run sets both: the target builds no mask either
    with torch.no_grad():
        want = draft_logits(kind, model, steps)
        model.flex_masks = True
        with monkeypatch.context() as m:  # the flex path builds no dense mask
            m.setattr(Rule, "dense", lambda self: pytest.fail("a dense draft mask on the flex path"))
            got = draft_logits(kind, model, steps)
    assert len(got) == len(want) == steps
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device, flex", [("cpu", False), ("cuda", True)])
def test_a_draft_run_attends_through_block_masks_where_its_target_runs_varlen_on_cuda(device, flex):
    """train/run.py's choose_attention: model.attention = varlen applied to the target; the draft's own masks
    follow as BlockMasks on CUDA only (torch has no FlexAttention backward on CPU). Nothing runs on the device."""
    from treadle.config.load import load_config
    from treadle.train.run import choose_attention

    model, _ = build("dflash")
    cfg = load_config(None, ["--draft.kind=dflash", "--draft.target=unread", "--model.attention=varlen",
                             f"--data.seq_len={T}"])
    assert choose_attention(cfg, model, torch.device(device), 1) == []
    assert model.target.config._attn_implementation == attention.NAMES["varlen"]
    assert model.flex_masks is flex
