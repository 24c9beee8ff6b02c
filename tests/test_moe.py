"""MoE: router losses (load balancing, z-loss) in the step's loss, their normalization, and expert-load metrics."""

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import draft_args, moe_args, records
from tests.test_step import GradRecordingEngine, make_batch, max_rel_diff, split
from treadle.cli import main
from treadle.config import ModelConfig
from treadle.models.hf import build_model
from treadle.models.moe import router_losses, router_spec
from treadle.errors import UserError
from treadle.train.moe import RouterObjective, router_objective
from treadle.train.step import IGNORE_INDEX, loss_sum, optimizer_step

SMALL = {"hidden_size": 32, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8}


def tiny_moe(preset="tiny-moe", overrides=SMALL):
    torch.manual_seed(0)
    return build_model(ModelConfig(preset=preset, overrides=overrides), vocab_size=97)


def mixtral():
    torch.manual_seed(0)
    fields = dict(model_type="mixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    from transformers import AutoConfig
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), vocab_size=97, **fields))


def step(micro_batches, loss_fn, model=None):
    model = model or tiny_moe()
    engine = GradRecordingEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), torch.device("cpu"))
    return optimizer_step(engine, micro_batches, grad_clip=0.0, loss_fn=loss_fn), engine.grads


@pytest.mark.parametrize("build", [tiny_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_router_losses_equal_transformers_and_an_independent_computation(build):
    model = build()
    spec = router_spec(model)
    assert spec is not None and spec.top_k == 2
    batch = make_batch(n=4, t=16)
    mask = batch["labels"] != IGNORE_INDEX
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                output_router_logits=True)
    got = router_losses(out.router_logits, mask, spec)
    # The model's own load_balancing_loss_func with the label mask as its attention mask (its padding path).
    hf_aux = sys.modules[type(model).__module__].load_balancing_loss_func(out.router_logits, spec.num_experts,
                                                                        spec.top_k, mask)
    assert torch.allclose(got.aux, hf_aux, rtol=1e-6)
    # With every position labelled it is the aux_loss the model computes itself in forward.
    everything = router_losses(out.router_logits, torch.ones_like(mask), spec)
    assert torch.allclose(everything.aux, out.aux_loss, rtol=1e-6)
    assert not torch.allclose(everything.aux, got.aux, rtol=1e-4)  # the mask matters
    # z: mean over layers of logsumexp^2, summed per row over labelled positions; counts: top-k picks per expert.
    lse = torch.stack([torch.logsumexp(r, -1).view(mask.shape) for r in out.router_logits])
    assert torch.allclose(got.z_rows, (lse.square() * mask).sum(-1).mean(0), rtol=1e-6)
    picks = torch.stack([torch.nn.functional.one_hot(r.topk(2).indices, spec.num_experts).sum(1)[mask.flatten()].sum(0)
                         for r in out.router_logits])
    assert torch.equal(got.counts, picks.float())
    assert router_losses(out.router_logits, torch.zeros_like(mask), spec).aux.item() == 0.0  # not NaN


def test_zero_coefficients_give_exactly_the_plain_cross_entropy():
    micro = split(make_batch(), 4)
    plain, g_plain = step(micro, loss_sum)
    objective = RouterObjective(router_spec(tiny_moe()), 0.0, 0.0)
    moe, g_moe = step(micro, objective)
    assert moe.loss == plain.loss
    assert all(torch.equal(g_moe[k], g_plain[k]) for k in g_plain)
    assert moe.metrics["router_aux_loss"] > 0 and moe.metrics["router_z_loss"] > 0  # measured, not trained
    assert objective.take_counts().sum() == plain.label_tokens * 2 * 2  # top-2, 2 layers


def test_router_objective_uses_the_chunked_head_and_equals_the_full_logits():
    """With model.loss_chunk_tokens the MoE objective's CE goes through the chunked head (the logits never exist
    whole) and the step equals the unchunked one: loss, router metrics and gradients."""
    from treadle.models.chunked_ce import chunked_head, use_chunked_loss

    micro = split(make_batch(), 4)
    objective = RouterObjective(router_spec(tiny_moe()), 0.01, 0.001)
    full, g_full = step(micro, objective)
    chunked_model = tiny_moe()
    assert use_chunked_loss(chunked_model, 8) and chunked_head(chunked_model) is not None
    seen = []
    chunked_head(chunked_model).register_forward_hook(lambda m, i, o: seen.append(o.shape))
    chunked, g_chunked = step(micro, objective, chunked_model)
    assert seen and all(len(shape) == 2 for shape in seen)  # per-token CE [B, T], never [B, T, V] logits
    assert chunked.loss == pytest.approx(full.loss, rel=1e-6)
    for key in ("router_aux_loss", "router_z_loss"):
        assert chunked.metrics[key] == pytest.approx(full.metrics[key], rel=1e-6)
    assert max_rel_diff(g_chunked, g_full) <= 1e-6


def test_z_loss_is_exact_under_accumulation_and_aux_is_the_token_weighted_mean_of_micro_batches():
    batch = make_batch()
    spec = router_spec(tiny_moe())
    z_only = RouterObjective(spec, 0.0, 0.1)
    big, g_big = step(split(batch, 8), z_only)
    acc, g_acc = step(split(batch, 2), z_only)
    assert acc.loss == pytest.approx(big.loss, rel=1e-6)
    assert acc.metrics["router_z_loss"] == pytest.approx(big.metrics["router_z_loss"], rel=1e-6)
    assert max_rel_diff(g_acc, g_big) <= 1e-6

    # Both on: the step equals the objective written out by hand, in one graph, with transformers' aux per
    # micro-batch weighted by its label tokens, all over the step's N.
    coef_aux, coef_z = 0.5, 0.1
    micro = split(batch, 2)
    got, g_got = step(micro, RouterObjective(spec, coef_aux, coef_z))
    model = tiny_moe()
    n = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    total, aux_mean = 0.0, 0.0
    for mb in micro:
        mask = mb["labels"] != IGNORE_INDEX
        out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False,
                    output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")
        aux = sys.modules[type(model).__module__].load_balancing_loss_func(out.router_logits, 8, 2, mask)
        z = sum((torch.logsumexp(r, -1).square() * mask.flatten()).sum() for r in out.router_logits) / 2
        total = total + ce + coef_aux * aux * mask.sum() + coef_z * z
        aux_mean += aux.item() * mask.sum().item() / n
    (total / n).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    assert got.loss == pytest.approx(total.item() / n, rel=1e-6)
    assert got.metrics["router_aux_loss"] == pytest.approx(aux_mean, rel=1e-6)
    assert max_rel_diff(g_got, want) <= 1e-6
    # Not a step-wide aux: one micro-batch of all 8 rows gives another value (HF's definition is per batch).
    whole, _ = step(split(batch, 8), RouterObjective(spec, coef_aux, coef_z))
    assert abs(whole.metrics["router_aux_loss"] - got.metrics["router_aux_loss"]) > 1e-4


def test_moe_preset_trains_with_both_losses_and_logs_them(shards, tmp_path):
    out = tmp_path / "moe"
    argv = moe_args(shards, out, "--train.max_steps=2")
    assert main(argv) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["router_aux_loss"] >= 2.0 - 1e-4  # top-2: 2 when perfectly balanced, more otherwise
        assert r["router_z_loss"] > 0 and 1.0 <= r["expert_load_max_mean"] <= 8 / 2
        assert len(r["expert_tokens"]) == 8 and sum(r["expert_tokens"]) % (2 * 2) == 0  # top-2 x 2 layers
    evals = [r for r in lines if "eval_loss" in r]
    assert evals and all("eval_router_aux_loss" in r and "eval_router_z_loss" in r for r in evals)
    model = AutoModelForCausalLM.from_pretrained(out / "hf")  # the export loads as the same MoE
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 8
    assert records(out, "router_z_loss").keys() == {1, 2}


def test_router_coefficients_on_a_model_without_experts_are_refused(shards, tmp_path, capsys):
    out = tmp_path / "dense"
    argv = ["train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", "--data.val=[]",
            "--model.overrides={hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4}",
            "--data.seq_len=32", "--train.max_steps=1", "--model.router_z_loss_coef=0.001"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.router_z_loss_coef = 0.001" in err[0] and "no experts" in err[0]
    assert not out.exists()
    # 0 means off: accepted on any model.
    assert main(argv[:-1] + ["--model.router_z_loss_coef=0", "--model.router_aux_loss_coef=0"]) == 0


def test_unset_aux_coefficient_is_the_model_configs_own_and_keys_are_refused_where_nothing_routes(
        shards, target_dir, tmp_path, capsys):
    moe = tiny_moe(overrides=SMALL | {"router_aux_loss_coef": 0.02})
    assert router_objective(moe, ModelConfig()).aux_coef == 0.02  # HF config field (model.overrides may set it)
    both = router_objective(moe, ModelConfig(router_aux_loss_coef=0.0, router_z_loss_coef=0.1))
    assert (both.aux_coef, both.z_coef) == (0.0, 0.1)
    dense = build_model(ModelConfig(overrides={"hidden_size": 32, "num_hidden_layers": 1}), vocab_size=97)
    assert router_objective(dense, ModelConfig(router_aux_loss_coef=0)) is None
    with pytest.raises(UserError, match=r"model.router_aux_loss_coef = 0.1 but the model \(llama\) has no experts"):
        router_objective(dense, ModelConfig(router_aux_loss_coef=0.1))
    # A draft run trains a draft without a router: refused before anything is written.
    out = tmp_path / "draft"
    assert main(draft_args(shards, target_dir, out, "--train.max_steps=2", "--model.router_z_loss_coef=0.01")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.router_z_loss_coef = 0.01 but a draft run trains a glide draft" in err[0]
    assert not out.exists()
