"""GLIDE against what target families change: how the target's attention reads a 4-D mask (eager adds it), the
target's logit transform (Granite's scale, Gemma's soft-cap) on the teacher and the draft's head, and the K/V the
draft captures from each family's last layer (its own cache's entries). float64 throughout: equalities are exact up
to rounding, and a wrong mask or a skipped transform is far outside it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET
from treadle.drafts.glide.model import GlideDraft, GlideModel

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


def family_target(name: str, layers: int = 4, seed: int = 0):
    """A tiny random ``name`` target of tests/families.py (4 layers, as the family matrix's draft targets), fp64."""
    import transformers

    from tests.families import COMMON, FAMILIES

    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**{**COMMON, **extra, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    # eager experts: the grouped-matmul kernels of MoE families take no fp64
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().eval()


def transform(config, raw):
    """The families' logit transforms written out: Granite divides, Gemma soft-caps."""
    if getattr(config, "logits_scaling", None):
        return raw / config.logits_scaling
    return torch.tanh(raw / config.final_logit_softcapping) * config.final_logit_softcapping


@pytest.mark.parametrize("family", ["granite", "gemma2"])
def test_glide_teacher_is_the_targets_distribution_and_the_draft_is_scored_as_its_head(family):
    """GLIDE shares the target's head: the teacher is the target's own forward (its scaled / soft-capped logits), and
    the draft's hidden states go through the head as the target's do, transform included (plain, unrolled, decode)."""
    from treadle.drafts.glide.drafter import GlideDrafter

    target = family_target(family)
    model = GlideModel(target, GlideDraft(target.config).double()).eval()
    ids, positions = packed_rows()
    with torch.no_grad():
        out = model(ids, positions, lag=2)
        own = target(ids[1:]).logits[0]
        torch.testing.assert_close(out.target_logits[1], own, **F64)
        torch.testing.assert_close(out.target_logits[1].softmax(-1), own.softmax(-1), **F64)
        _, kv = model._target_forward(ids, positions)
        raw = target.lm_head(model._draft_hidden(ids, positions, kv, 2))
        torch.testing.assert_close(out.logits, transform(target.config, raw), **F64)
        assert not torch.allclose(out.logits, raw)  # the transform is not the identity here
        steps = model._unroll_logits(ids, positions, kv, 2, steps=2)
        torch.testing.assert_close(steps[0], out.logits, **F64)
        # The decode drafter over row 1's first 4 tokens (one document), reading the target K/V of those 4.
        few = (kv[0][1:, :, :4], kv[1][1:, :, :4])
        decoded, _ = GlideDrafter(model)._run(ids[1:, :4], torch.arange(4)[None], torch.ones(1, 1, 4, 4).tril().bool(),
                                              few, None)
        torch.testing.assert_close(decoded, model.draft_logits(ids[1:, :4], positions[1:, :4], few, lag=1)[0], **F64)


@pytest.mark.parametrize("family", ["granite", "gemma2", "gpt_oss", "olmo2", "phi3"])
def test_glide_chunked_scores_equal_the_plain_ones(family):
    """The chunked scores apply the target's logit transform inside each chunk (Granite, Gemma 2): per-token CE, KL
    and the target's CE, and the draft's gradients, equal the plain loss's (fp64), for the families GLIDE gained."""
    import torch.nn.functional as F

    target = family_target(family)
    model = GlideModel(target, GlideDraft(target.config).double()).eval()
    ids, positions = packed_rows()
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)
    labels[0, 4] = -100  # the first document's last token guesses nothing
    scores, grads = {}, {}
    for chunk in (0, 5):  # 5 divides neither the 24 tokens nor the vocabulary
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        out = model(ids, positions, lag=1, labels=labels)
        if chunk:
            got = (out.token_ce, out.token_kl, out.target_token_ce)
        else:
            logp, teacher = F.log_softmax(out.logits, -1), F.log_softmax(out.target_logits, -1)
            valid = labels != -100
            got = (F.nll_loss(logp.transpose(1, 2), labels, reduction="none"),
                   F.kl_div(logp, teacher, log_target=True, reduction="none").sum(-1) * valid,
                   F.nll_loss(teacher.transpose(1, 2), labels, reduction="none"))
        (got[0] + got[1]).sum().backward()
        scores[chunk] = [g.detach() for g in got]
        grads[chunk] = {n: p.grad.clone() for n, p in model.draft_model.named_parameters()}
    for plain, chunked in zip(scores[0], scores[5]):
        torch.testing.assert_close(chunked, plain, **F64)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[5][name], grad, **F64, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "granite", "gemma2", "olmo2", "phi3", "gpt_oss"])
def test_captured_kv_are_the_targets_own_cache_entries(family):
    """What GLIDE's capture hooks rebuild from the last layer (its projections, norms and rotary) is what the target's
    own KV cache holds there, per family (fp64); the draft embeds tokens as the target's first layer sees them
    (Gemma's sqrt(d) scale included) and its MLP uses the target's activation."""
    from transformers import DynamicCache

    from treadle.drafts.glide.model import capture_last_kv
    from treadle.models.hf import cache_kwargs

    target = family_target(family)
    ids = torch.randint(0, 512, (2, 20))  # longer than Gemma 2's 16-token window (its last layer is a full one)
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids, use_cache=True, output_hidden_states=True, **cache_kwargs(target, cache))
        with capture_last_kv(target) as kv:
            target(input_ids=ids, position_ids=torch.arange(20).expand(2, 20), use_cache=False)
        embeds = target.get_input_embeddings()(ids)
    torch.testing.assert_close(kv["k"], cache.layers[-1].keys, **F64)
    torch.testing.assert_close(kv["v"], cache.layers[-1].values, **F64)
    assert kv["k"].shape[2] == 20
    if family == "gemma2":  # its embedding module scales by sqrt(d); Granite's multiplier sits in its forward, and
        # every reader of the draft's residual stream is an RMSNorm, blind to a constant scale
        torch.testing.assert_close(embeds, out.hidden_states[0], **F64)
    acts = [getattr(m, a) for m in target.model.layers[-1].modules() for a in ("act_fn", "activation_fn")
            if hasattr(m, a)]
    x = torch.linspace(-4, 4, 50, dtype=torch.float64)
    if family != "gpt_oss":  # its experts' clamped SwiGLU is no activation module; the draft's MLP takes hidden_act
        torch.testing.assert_close(GlideDraft(target.config).act(x), acts[0](x), **F64)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gpt_oss"])
def test_the_draft_runs_target_keeps_its_sliding_layers_windows(family):
    """The 4-D mask a draft run hands its target is used by every layer as it is: the sliding layers (16 tokens here)
    get their own windowed mask, so over 30 tokens the teacher (and EAGLE-3's features) are the target's own."""
    from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model

    target = family_target(family)
    ids = torch.randint(0, 512, (1, 30))
    models = [Eagle3Model(target, Eagle3Draft(target.config, (1, 2, 3)).double())]
    if family == "gemma2":  # the others' last layers refuse GLIDE
        models.append(GlideModel(target, GlideDraft(target.config).double()))
    with torch.no_grad():
        own = target(ids).logits
        for model in models:
            torch.testing.assert_close(model.eval()(ids, torch.arange(30)[None]).target_logits, own, **F64)


def test_a_gemma3_target_ending_on_a_full_layer_is_refused_for_its_per_layer_type_rotary():
    """6 Gemma 3 layers end on a full-attention one (its 5-of-6 pattern): the config passes, the module check names
    the rotary kept per layer type (called without one it would raise), not a traceback."""
    from treadle.drafts.targets import glide_module_obstacle, glide_obstacle

    target = family_target("gemma3_text", layers=6)
    assert target.config.layer_types[-1] == "full_attention" and glide_obstacle(target.config) is None
    assert "per layer type" in glide_module_obstacle(target)
