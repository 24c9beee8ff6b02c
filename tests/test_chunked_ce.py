"""Chunked cross-entropy (model.loss_chunk_tokens) equals the plain LM head + cross-entropy.

fp32, tiny Llama with tied and untied embeddings, several rows with ignored labels, a chunk size that divides
nothing: per-row loss sums, the step's loss, per-source losses and every gradient agree to 1e-6 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                          LlamaForCausalLM)

from treadle.data.packed import IGNORE_INDEX
from treadle.engine.local import LocalEngine
from treadle.errors import UserError
from treadle.models.chunked_ce import AUTO_CHUNK_TOKENS, ChunkedLMHead, resolve_chunk_tokens, scoring, use_chunked_loss
from treadle.train.step import loss_sum, optimizer_step

VOCAB, ROWS, SEQ, CHUNK = 300, 3, 16, 7  # 48 tokens in chunks of 7: the last chunk is partial
RTOL = 1e-6
RTOL64 = 1e-10  # the same comparisons run in float64


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                        tie_word_embeddings=tied))


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, 9] = IGNORE_INDEX  # a document boundary
    labels[2, :] = IGNORE_INDEX  # a row with no loss at all
    pos = torch.arange(SEQ).repeat(ROWS, 1)
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": pos, "source": torch.tensor([0, 1, 1])}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_and_gradients_equal_the_plain_head(tied):
    plain = tiny_llama(tied)
    chunked = copy.deepcopy(plain)
    assert use_chunked_loss(chunked, CHUNK, IGNORE_INDEX)
    head = chunked.get_output_embeddings()
    assert isinstance(head, ChunkedLMHead) and head.weight is chunked.lm_head.weight
    assert (head.weight is chunked.model.embed_tokens.weight) == tied  # the tie survives the replacement
    assert sorted(chunked.state_dict()) == sorted(plain.state_dict())  # same keys: checkpoints and export unchanged

    b = batch()
    want, got = loss_sum(plain, b), loss_sum(chunked, b)
    assert got.shape == (ROWS,) and got.dtype == torch.float32
    assert got[2].item() == 0.0  # a row without labels contributes nothing
    assert rel(got, want) <= RTOL, (got, want)
    (want.sum() / 7).backward()
    (got.sum() / 7).backward()
    g_want, g_got = grads(plain), grads(chunked)
    for name in g_want:
        assert rel(g_got[name], g_want[name]) <= RTOL, name

    # Without labels the head is the plain linear layer: generation and export see the same logits.
    with torch.no_grad():
        ids = b["input_ids"]
        assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_step_with_chunked_loss_equals_the_plain_step():
    """The step's exact normalization, grad norm and per-source losses through optimizer_step, GA=2."""
    plain = tiny_llama(False)
    chunked = copy.deepcopy(plain)
    use_chunked_loss(chunked, CHUNK, IGNORE_INDEX)
    results = []
    for model in (plain, chunked):
        engine = LocalEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.device("cpu"))
        results.append([optimizer_step(engine, [batch(s), batch(s + 10)], grad_clip=1.0, sources=("a", "b"))
                        for s in range(2)])
    for want, got in zip(*results):
        assert got.label_tokens == want.label_tokens
        assert got.loss == pytest.approx(want.loss, rel=RTOL)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert got.by_source.keys() == want.by_source.keys() == {"a", "b"}
        for name, (loss, tokens) in want.by_source.items():
            assert got.by_source[name][1] == tokens
            assert got.by_source[name][0] == pytest.approx(loss, rel=RTOL)


def test_bf16_autocast_keeps_the_loss_in_fp32():
    plain = tiny_llama(False)
    chunked = copy.deepcopy(plain)
    use_chunked_loss(chunked, CHUNK, IGNORE_INDEX)
    b = batch()
    want = loss_sum(plain, b)  # fp32 reference
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_sum(chunked, b)
    assert got.dtype == torch.float32
    # The decoder ran in bf16 (so not equal), but no bf16 rounding of the loss itself (8 bits: ~4e-3 relative).
    assert rel(got, want) < 2e-2
    # Under bf16 parameters (FSDP2 / DeepSpeed bf16 compute) the head still returns an fp32 loss.
    bf16 = copy.deepcopy(chunked).to(torch.bfloat16)
    assert loss_sum(bf16, b).dtype == torch.float32


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_under_bf16_autocast_the_head_multiplies_in_bf16_and_scores_in_fp32(softcap):
    """The chunked head's matmuls run in autocast's dtype, as the plain head's do (in fp32 they cost a third of an
    H200's 1.1B step), its softmax and losses in fp32: the loss and every gradient equal a formula that multiplies
    bf16 operands and scores in fp32, and not the one that multiplies in fp32."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(ROWS * SEQ, 64, generator=g, requires_grad=True)
    lin = torch.nn.Linear(64, VOCAB, bias=True)
    labels = batch()["labels"].flatten()
    weights = torch.linspace(0.5, 2.0, labels.numel())

    def run(path):
        for t in (hidden, lin.weight, lin.bias):
            t.grad = None
        loss = path()
        (loss * weights).sum().backward()
        return [loss.detach().clone(), hidden.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]

    def formula(dtype):
        def path():
            logits = F.linear(hidden.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype)).float()
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
        return path

    head = ChunkedLMHead(lin, CHUNK, IGNORE_INDEX, softcap=softcap)
    with scoring(head, labels), torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(lambda: head(hidden))
    assert all(t.dtype == torch.float32 for t in got)
    low, full = run(formula(torch.bfloat16)), run(formula(torch.float32))
    # The loss and the hidden states' gradient: bf16 operands, fp32 accumulation, one bf16 rounding of the hidden
    # gradient either way: equal but for the order of fp32 sums (1e-5: far below the gap to fp32 operands, which
    # the last assert shows is there to be caught). The weight and bias gradients: the formula rounds its whole
    # product to bf16 once, the head sums each chunk's in fp32: equal to bf16's precision.
    for name, a, want, tol in zip(("loss", "hidden grad", "weight grad", "bias grad"), got, low, (1e-5, 1e-5, 1e-2, 1e-2)):
        assert rel(a, want) < tol, name
    assert rel(full[0], low[0]) > 1e-4


def tiny_gemma2(softcap: float | None = 5.0) -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          final_logit_softcapping=softcap, use_cache=False))


def tiny_granite() -> GraniteForCausalLM:
    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, logits_scaling=4.0,
                                            embedding_multiplier=12.0, residual_multiplier=0.5, use_cache=False))


def transformed_mismatches(build) -> list[str]:
    """What differs, beyond float64's bound, between the chunked loss of a model whose forward soft-caps or scales
    its logits and the model's own loss (its logits, transform included, then a cross-entropy): per-row sums, HF's
    own mean loss, every gradient. Empty when equal."""
    plain = build().double()
    with torch.no_grad():  # logits of a few tens, so that a soft-cap of 5 bends them (random init gives ~0.1)
        plain.get_output_embeddings().weight.mul_(300.0)
    chunked = copy.deepcopy(plain)
    assert use_chunked_loss(chunked, CHUNK, IGNORE_INDEX, explicit=True)
    b = batch()
    want, got = loss_sum(plain, b), loss_sum(chunked, b)
    assert got.dtype == torch.float64
    bad = ["loss"] if rel(got, want) > RTOL64 else []
    (want.sum() / 7).backward()
    (got.sum() / 7).backward()
    g_want, g_got = grads(plain), grads(chunked)
    bad += [f"grad {n}" for n in g_want if rel(g_got[n], g_want[n]) > RTOL64]
    with torch.no_grad():  # without labels: the model's own logits, its transform applied by itself again
        ids = b["input_ids"]
        if not torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits):
            bad.append("logits without labels")
    return bad


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_granite], ids=["gemma2-softcap", "granite-scale"])
def test_chunked_loss_of_softcapped_and_scaled_logits_equals_the_models_own(build):
    assert transformed_mismatches(build) == []


def test_the_transformed_comparison_catches_a_forgotten_cap_or_scale(monkeypatch):
    """The float64 bound is tight, not blind: a head that drops Gemma 2's soft-cap, or Granite's scale, fails it."""
    from treadle.models import chunked_ce

    transform = chunked_ce._logit_transform
    for build, kind in ((tiny_gemma2, "softcap"), (tiny_granite, "scale")):
        monkeypatch.setattr(chunked_ce, "_logit_transform",  # the model's own transform still off, none applied
                            lambda config: {k: v for k, v in transform(config).items() if k != kind})
        assert "loss" in transformed_mismatches(build), kind


def test_the_models_own_transform_is_off_only_while_scoring():
    """The head applies the cap; the model's forward must not cap again while the head scores, and everything else
    (generation, export, a probe after an exception) sees the model's config untouched."""
    model = tiny_gemma2(30.0)
    assert use_chunked_loss(model, CHUNK, IGNORE_INDEX)
    head = model.get_output_embeddings()
    assert head.softcap == 30.0 and model.config.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match="inside"):
        with scoring(head, batch()["labels"]):
            assert model.config.final_logit_softcapping is None
            raise ValueError("inside")
    assert model.config.final_logit_softcapping == 30.0 and head.labels is None
    assert use_chunked_loss(tiny_gemma2(None), CHUNK, IGNORE_INDEX)  # Gemma 2 without a cap: the fused path
    assert tiny_gemma2(None).config.final_logit_softcapping is None


def test_a_logit_transform_the_head_does_not_know_is_refused_or_left_unchunked(monkeypatch):
    """A forward that changes the head's output in a way not applied in the head (here Gemma 2's cap with Gemma 2
    taken off the known families) is refused: the chunked loss would be another loss."""
    from treadle.models import chunked_ce

    monkeypatch.setattr(chunked_ce, "_LOGIT_TRANSFORMS_HANDLED", {})
    model = tiny_gemma2(30.0)
    with pytest.raises(UserError, match=r"model\.loss_chunk_tokens: .*soft-cap.*final_logit_softcapping = 30"):
        use_chunked_loss(model, CHUNK, IGNORE_INDEX, explicit=True)
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    assert not use_chunked_loss(model, CHUNK, IGNORE_INDEX, explicit=False)
    assert type(model.get_output_embeddings()) is torch.nn.Linear


def test_models_without_weights_yet_are_checked_on_a_meta_twin():
    """A model built empty for sharded loading (meta device) has no weights to run: the check runs a meta-device
    twin (shapes only); one whose ops cannot run on meta (MoE's grouped matmuls) is judged by its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def empty(model_type, **fields):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(
                model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_cache=False, **fields))

    llama = empty("llama")
    assert use_chunked_loss(llama, CHUNK, IGNORE_INDEX, explicit=True)
    assert type(llama.get_output_embeddings()) is ChunkedLMHead and llama.lm_head.weight.is_meta
    gemma = empty("gemma2", final_logit_softcapping=30.0)  # the head caps: the twin's forward returns its output
    assert use_chunked_loss(gemma, CHUNK, IGNORE_INDEX, explicit=True)
    assert gemma.get_output_embeddings().softcap == 30.0
    granite = empty("granite", logits_scaling=8.0)  # the twin's forward divides by the neutral 1.0: a new tensor
    assert use_chunked_loss(granite, CHUNK, IGNORE_INDEX, explicit=True)
    assert granite.get_output_embeddings().scale == 8.0
    moe = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    assert use_chunked_loss(empty("qwen3_moe", **moe), CHUNK, IGNORE_INDEX, explicit=False)
    assert not use_chunked_loss(empty("qwen3_moe", logit_scale=0.5, **moe), CHUNK, IGNORE_INDEX, explicit=False)


def test_auto_turns_chunking_on_from_32k_vocabularies():
    assert resolve_chunk_tokens("auto", 8192) == 0
    assert resolve_chunk_tokens("auto", 32_000) == AUTO_CHUNK_TOKENS
    assert resolve_chunk_tokens("auto", 128_256) == AUTO_CHUNK_TOKENS
    assert resolve_chunk_tokens(0, 128_256) == 0
    assert resolve_chunk_tokens(256, 8192) == 256


def glide_mismatches(objective: str) -> list[str]:
    """What differs, beyond float64's bound, between a draft run's objective computed chunk by chunk and from
    full logits: the draft's CE and KL(target || draft) and the target's CE (per-row losses, side sums, draft
    gradients, evaluation), at a lag and with an offset. Empty when the two are equal."""
    from treadle.config import DraftConfig
    from treadle.drafts.glide.model import GlideDraft, GlideModel
    from treadle.drafts.glide.objective import GlideObjective

    # float64: the KL (~1e-3) is a difference of near-equal log-sum-exps, so fp32's rounding, which differs
    # between CPUs' kernels, would leave ~1e-6 of it; float64 leaves ~1e-12 and a tight bound proves equality.
    target = tiny_llama(False).double()
    plain = GlideModel(target, GlideDraft(target.config).double()).train()
    chunked = copy.deepcopy(plain)
    chunked.loss_chunk_tokens = CHUNK
    cfg = DraftConfig(kind="glide", loss=objective, kl_weight=0.3, max_position_offset=8)
    objective_fn = GlideObjective(cfg, max_positions=64, seq_len=SEQ)
    b = batch()
    want, want_side = objective_fn.losses(plain, b, lag=2, offset=3, train=True)
    got, got_side = objective_fn.losses(chunked, b, lag=2, offset=3, train=True)
    assert got.dtype == torch.float64 and got_side.keys() == want_side.keys()
    bad = ["loss"] if rel(got, want) > RTOL64 else []
    bad += [name for name in want_side if got_side[name].item() != pytest.approx(want_side[name].item(), rel=RTOL64)]
    want.sum().backward()
    got.sum().backward()
    g_want = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    g_got = {n: p.grad for n, p in chunked.named_parameters() if p.requires_grad}
    assert g_want.keys() == g_got.keys() and all(n.startswith("draft_model.") for n in g_want)
    bad += [f"grad {name}" for name in g_want if rel(g_got[name], g_want[name]) > RTOL64]
    # Evaluation (no grad) takes the same chunked path.
    with torch.no_grad():
        ev_want, ev_side = objective_fn.evaluate(plain, b)
        ev_got, ev_got_side = objective_fn.evaluate(chunked, b)
    bad += ["eval loss"] if rel(ev_got, ev_want) > RTOL64 else []
    bad += ["eval target_loss"] if ev_got_side["target_loss"].item() != pytest.approx(
        ev_side["target_loss"].item(), rel=RTOL64) else []
    # Issue 48: the draft's top-1 agreement with the target (eval_acc_1's counts), the same whole or chunked.
    assert ev_side["ttt_rows_1"] == (b["labels"] != -100).sum() and ev_side["ttt_hits_1"] > 0
    bad += ["eval agreement"] if [ev_got_side[k].item() for k in ("ttt_hits_1", "ttt_rows_1")] != [
        ev_side[k].item() for k in ("ttt_hits_1", "ttt_rows_1")] else []
    return bad


@pytest.mark.parametrize("objective", ["ce", "kl", "mix"])
def test_chunked_glide_objective_equals_the_plain_one(objective):
    assert glide_mismatches(objective) == []


def test_the_glide_comparison_catches_a_chunk_boundary_off_by_one(monkeypatch):
    """The float64 bound is tight, not blind: pairing each chunk's draft rows with the teacher's rows one
    position off (what a slicing bug at a chunk boundary does) fails it, in the KL and the target's CE."""
    from treadle.models import chunked_ce

    scores = chunked_ce._chunk_scores

    def off_by_one(hidden, teacher_hidden, *rest):
        return scores(hidden, torch.cat((teacher_hidden[1:], teacher_hidden[-1:])), *rest)

    monkeypatch.setattr(chunked_ce, "_chunk_scores", off_by_one)
    bad = glide_mismatches("kl")
    assert {"loss", "draft_kl", "target_loss"} <= set(bad), bad


def test_the_capped_head_with_a_bias_and_a_scale_equals_its_formula():
    """The hand-written backward of the soft-capped chunks, every input at once (a bias, a scale before the cap,
    ignored rows, a partial last chunk), against autograd through the formula, float64."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(2, 9, 16, generator=g, dtype=torch.float64) * 3).requires_grad_()
    linear = torch.nn.Linear(16, 40, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[0, :3] = IGNORE_INDEX
    head = ChunkedLMHead(linear, 4, IGNORE_INDEX, softcap=2.5, scale=1.5)
    with scoring(head, labels):
        got = head(hidden)
    logits = torch.tanh(linear(hidden) / 1.5 / 2.5) * 2.5
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(labels.shape)
    assert rel(got, want) <= RTOL64
    weights = torch.rand(2, 9, generator=g, dtype=torch.float64)  # an upstream gradient that differs per token
    params = (hidden, linear.weight, linear.bias)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), params), torch.autograd.grad((want * weights).sum(), params)):
        assert rel(a, b) <= RTOL64


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in seen:
            seen.add(type(node).__name__)
            todo += [n for n, _ in node.next_functions]
    return seen


def test_the_installed_torch_picks_its_path_and_every_path_gives_the_same_numbers():
    """torch >= 2.13 runs its fused F.linear_cross_entropy, an older torch treadle's own chunked op (this test runs
    on both ends in CI: make test and make test-oldest); either equals a plain head + cross-entropy in float64."""
    from torch.torch_version import TorchVersion

    from treadle import compat
    from treadle.models.chunked_ce import _ChunkedCrossEntropy

    assert compat.HAS_LINEAR_CROSS_ENTROPY == (TorchVersion(torch.__version__) >= (2, 13))
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, SEQ, 16, generator=g, dtype=torch.float64, requires_grad=True)
    lin = torch.nn.Linear(16, VOCAB, bias=True).double()
    labels = batch()["labels"]

    def scores(path):
        for t in (hidden, lin.weight, lin.bias):
            t.grad = None
        loss = path()
        (loss * torch.linspace(0.5, 2.0, loss.numel(), dtype=torch.float64).view(loss.shape)).sum().backward()
        return loss.detach(), hidden.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone(), loss

    head = ChunkedLMHead(lin, CHUNK, IGNORE_INDEX)
    with scoring(head, labels):
        *through_head, loss = scores(lambda: head(hidden))
    own = "_ChunkedCrossEntropyBackward" in _autograd_nodes(loss)
    assert own == (not compat.HAS_LINEAR_CROSS_ENTROPY), _autograd_nodes(loss)
    *plain, _ = scores(lambda: F.cross_entropy(lin(hidden).transpose(1, 2), labels, ignore_index=IGNORE_INDEX,
                                               reduction="none"))
    *by_hand, _ = scores(lambda: _ChunkedCrossEntropy.apply(hidden.flatten(0, 1), lin.weight, lin.bias,
                                                            labels.flatten(), CHUNK, IGNORE_INDEX, None, None
                                                            ).view(labels.shape))
    for got, hand, want in zip(through_head, by_hand, plain):
        assert rel(got, want) < RTOL64 and rel(hand, want) < RTOL64
