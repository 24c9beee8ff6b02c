import math

import pytest
import torch

from treadle.config import load_config
from treadle.models.hf import build_model
from treadle.engine.optim import build_optimizer, build_schedule, lr_multiplier, param_groups


def lrs(cfg):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    sched = build_schedule(opt, cfg)
    out = []
    for _ in range(cfg.train.max_steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_min():
    cfg = load_config(None, ["--train.max_steps=100", "--schedule.warmup_steps=10", "--optim.lr=1.0", "--schedule.min_lr_ratio=0.1"])
    lr = lrs(cfg)
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)  # linear warmup reaches the peak
    assert all(a < b for a, b in zip(lr[:10], lr[1:10]))
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))  # then never rises
    assert lr[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))


def test_warmup_proportion_linear_constant_wsd():
    cfg = load_config(None, ["--train.max_steps=100", "--schedule.warmup_proportion=0.2", "--optim.lr=1.0", "--schedule.decay=linear", "--schedule.min_lr_ratio=0"])
    lr = lrs(cfg)
    assert lr[19] == pytest.approx(1.0) and lr[60] == pytest.approx(1 - 40 / 80)
    assert lr[-1] == pytest.approx(1 / 80)
    assert set(lrs(load_config(None, ["--train.max_steps=20", "--schedule.decay=constant", "--optim.lr=1.0"]))) == {1.0}
    wsd = [lr_multiplier(s, 100, 10, "wsd", 0.0, 0.2) for s in range(100)]
    assert wsd[10:80] == [1.0] * 70 and wsd[90] == pytest.approx(0.5) and wsd[99] == pytest.approx(0.05)


def test_no_weight_decay_on_norms_biases_embeddings():
    cfg = load_config(None, ["--model.overrides={hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2}"])
    model = build_model(cfg.model, vocab_size=100)
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert "lm_head.weight" in decayed and "model.layers.0.self_attn.q_proj.weight" in decayed
    assert "model.embed_tokens.weight" in plain and "model.norm.weight" in plain
    assert decayed | plain == set(names.values())
    groups = param_groups(model, 0.1, decay_embeddings=True, decay_norms_and_biases=False)
    assert any(p is model.model.embed_tokens.weight for p in groups[0]["params"])


def test_the_fused_adamw_treadle_builds_equals_torchs_default_within_fp32_rounding():
    cfg = load_config(None, ["--model.overrides={hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2}"])
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(cfg.model, vocab_size=100))
    fast = build_optimizer(models[0], cfg)
    assert fast.defaults["fused"] is True  # the CPU has torch's fused kernel: it is the one used
    o = cfg.optim
    groups = param_groups(models[1], o.weight_decay, o.decay_embeddings, o.decay_norms_and_biases)
    plain = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=False)  # torch's for-loop reference
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        fast.step()
        plain.step()
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert worst < 1e-6  # another kernel (not always bit-identical), within fp32 rounding after 20 steps
