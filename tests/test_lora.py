"""LoRA adapters through PEFT (``[lora]``, models/lora.py): the math, every family, a run's checkpoints, resume and
exports, and the one-line refusals. The multi-process engines are in tests/test_run_dist.py."""

from __future__ import annotations

import json
import math
import re
import sys
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.families import COMMON, FAMILIES, build_family
from tests.helpers import args, records, write_pairs
from treadle.cli import main
from treadle.config import LoraConfig, load_config
from treadle.errors import UserError
from treadle.models.lora import (apply_lora, decoder_linear_names, load_adapter, merged_model, module_names,
                                 read_identity)

pytestmark = pytest.mark.usefixtures("one_thread")


def _family_model(name: str, dtype=torch.float64) -> torch.nn.Module:
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    # eager experts: torch._grouped_mm has no float64 kernel
    return AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra}), dtype=dtype,
                                            experts_implementation="eager").eval()


def _batch(seed: int = 0, rows: int = 2, length: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (rows, length), generator=g)
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(rows, length)}


def _logits(model, batch) -> torch.Tensor:
    return model(**batch, use_cache=False).logits


def _randomize_b(model, seed: int = 1) -> None:
    """PEFT starts B at zero (the adapted model is the base); a nonzero B makes the adapters visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def test_peft_forward_and_backward_equal_w_x_plus_scaled_b_a_x_in_float64():
    model = _family_model("llama")
    adapters = apply_lora(model, LoraConfig(rank=4, alpha=12.0), {"fingerprint": "test"})
    _randomize_b(model)
    q = model.model.layers[0].self_attn.q_proj  # PEFT's lora.Linear around the frozen nn.Linear
    W = q.base_layer.weight.detach()
    A = q.lora_A["default"].weight.detach().clone().requires_grad_()
    B = q.lora_B["default"].weight.detach().clone().requires_grad_()
    x = torch.randn(3, 5, W.shape[1], dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    upstream = torch.randn(3, 5, W.shape[0], dtype=torch.float64)
    got = q(x)
    want = x_ref @ W.T + (12.0 / 4) * (x_ref @ A.T @ B.T)  # W x + (alpha / r) B A x
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert torch.allclose(q.lora_A["default"].weight.grad, A.grad, rtol=1e-12, atol=1e-14)
    assert torch.allclose(q.lora_B["default"].weight.grad, B.grad, rtol=1e-12, atol=1e-14)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-12, atol=1e-14)
    assert q.base_layer.weight.grad is None and not q.base_layer.weight.requires_grad  # the base stays frozen
    assert adapters.peft_config.r == 4 and adapters.peft_config.lora_alpha == 12.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_adapts_its_linears_starts_as_the_base_trains_only_adapters_and_merges(family):
    model = _family_model(family)
    batch = _batch()
    base_logits = _logits(model, batch).detach()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    targets = decoder_linear_names(model)
    adapters = apply_lora(model, LoraConfig(rank=4, alpha=8.0), {"fingerprint": "test"})
    config = adapters.peft_config
    # Every decoder linear is targeted; PEFT moves an MoE's expert projections (fused 3-D parameters in transformers
    # 5) to target_parameters (DeepSeek-V3: gate_up_proj, down_proj), the rest stay modules.
    fused = set(config.target_parameters or ())
    adapted = set(config.target_modules) | fused | ({"gate_proj", "up_proj"} if "gate_up_proj" in fused else set())
    assert adapters.model is model and targets and set(targets) <= adapted
    # PEFT's init (B = 0): the adapted model is the base, exactly.
    assert torch.equal(_logits(model, batch), base_logits)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    _randomize_b(model)
    logits = _logits(model, batch)
    assert not torch.allclose(logits, base_logits)
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    adapted = _logits(model, batch).detach()
    # The frozen base is bit-identical after a step (its tensors live on as PEFT's base_layer).
    now = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert now.keys() == base.keys() and all(torch.equal(now[k], base[k]) for k in base)
    merged = merged_model(adapters)  # W + alpha/r B A, PEFT's layers gone
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged, batch), adapted, rtol=1e-9, atol=1e-11)


def test_all_linear_on_a_dspark_draft_leaves_its_heads_out():
    """A DSpark draft's confidence head (1 output) and Markov head (markov_w2) get no adapters from all-linear; its
    backbone's linears (fc, attention, MLP) do; named explicitly, a head is adapted."""
    from transformers import LlamaConfig

    from tests.helpers import TARGET
    from treadle.drafts.dspark.model import DSparkDraft

    draft = DSparkDraft(LlamaConfig(**TARGET), (1,), 1, 3, 3, 4)
    names = decoder_linear_names(draft)
    assert "confidence" not in names and "markov_w2" not in names
    assert {"fc", "q_proj", "o_proj", "down_proj"} <= set(names)
    adapters = apply_lora(draft, LoraConfig(rank=2), {"fingerprint": "x"})
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in adapters.model.named_parameters() if ".lora_" in n}
    assert adapted == set(names)
    other = DSparkDraft(LlamaConfig(**TARGET), (1,), 1, 3, 3, 4)
    apply_lora(other, LoraConfig(rank=2, target_modules=["confidence"]), {"fingerprint": "x"})
    assert hasattr(other.confidence, "lora_A")


def test_unknown_target_modules_and_a_rank_of_zero_are_one_line_each():
    model = _family_model("qwen3", torch.float32)
    with pytest.raises(UserError) as err:
        apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "qkv"]), {"fingerprint": "x"})
    message = str(err.value)
    assert "lora.target_modules: 'qkv' is not a module of this qwen3 model" in message and "\n" not in message
    assert all(name in message for name in ("q_proj", "k_proj", "down_proj", "lm_head", "embed_tokens"))
    with pytest.raises(UserError, match=r"lora.modules_to_save: 'embed' not a module .* embed_tokens"):
        apply_lora(model, LoraConfig(rank=4, modules_to_save=["embed"]), {"fingerprint": "x"})
    with pytest.raises(UserError, match=r"^config error .*lora.rank = 0 is invalid.*1"):
        load_config(None, ["--lora.rank=0"])
    for flags, why in ((["--distributed.tensor_parallel=2"], "tensor parallelism splits nn.Linear"),
                       (["--distributed.pipeline_parallel=2", "--train.grad_accum_steps=2"], "stages are cut"),
                       (["--model.dtype=fp8"], "float8 layers"),
                       (["--lora.quantize=4bit", "--distributed.engine=ddp"], "4-bit weights are not sharded")):
        with pytest.raises(UserError, match=why) as err:
            load_config(None, ["--lora.rank=4", *flags])
        assert "\n" not in str(err.value)


def _run_args(shards, base, out, *extra):
    return args(shards, out, f"--model.path={base}", "--lora.rank=4", "--lora.alpha=8", *extra)


def _vllm_contract(adapter_dir, model) -> None:
    """What vLLM's LoRA loader (vllm-project/vllm: vllm/lora/peft_helper.py, lora_model.py, utils.py) asks of an
    adapter directory: adapter_config.json with r, lora_alpha and target_modules, no modules_to_save, no DoRA, no
    adapter bias, r within --max-lora-rank (16 unless raised); every tensor of adapter_model.safetensors named
    base_model.model.<module>.lora_A.weight / lora_B.weight, the module's last name one of the model's linear
    layers; A is [r, in], B [out, r]."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert {"r", "lora_alpha", "target_modules"} <= config.keys()
    assert not config.get("modules_to_save") and not config.get("use_dora") and config.get("bias", "none") == "none"
    assert 1 <= config["r"] <= 16
    linears = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert tensors
    for name, t in tensors.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight", name)
        assert m, name
        module = model.get_submodule(m[1])
        assert m[1].rsplit(".", 1)[-1] in linears and m[1].rsplit(".", 1)[-1] in config["target_modules"]
        want = (config["r"], module.in_features) if m[2] == "lora_A" else (module.out_features, config["r"])
        assert tuple(t.shape) == want, name


def test_lora_run_starts_at_the_base_loss_resumes_exactly_and_exports_what_peft_and_vllm_load(shards, tmp_path):
    from treadle.train.run import build_trainer, close_trainer

    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    # The same run without adapters: a LoRA run's first loss (before any update) and its eval at step 0 are the
    # base model's, B being zero.
    full = tmp_path / "full"
    assert main(args(shards, full, f"--model.path={base}", "--train.max_steps=2")) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    trainer = build_trainer(load_config(None, _run_args(shards, base, a, "--train.max_steps=4",
                                                       "--checkpoint.every=2")[1:]))
    try:
        trainer.fit()
        live = trainer.engine.module  # the trained Hugging Face model, the adapters in it
    finally:
        close_trainer(trainer)
    assert records(a)[1] == records(full)[1] and records(a, "eval_loss")[0] == records(full, "eval_loss")[0]
    assert records(a)[4] < records(a)[1]
    # The frozen base is bit-identical to its files after training.
    files = load_file(base / "model.safetensors")
    kept = {k.replace(".base_layer", ""): v for k, v in live.state_dict().items() if "lora_" not in k}
    assert kept.keys() == files.keys() and all(torch.equal(kept[k], files[k]) for k in files)
    # A checkpoint holds the adapters and their optimizer state, never the frozen base.
    from treadle.checkpoint.safety import read_metadata

    names = list(read_metadata(a / "checkpoints" / "step_2" / "state").state_dict_metadata)
    weights = [n for n in names if n.startswith("model.")]
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights)
    assert any(n.startswith("optim.") and ".lora_B." in n for n in names)
    meta = json.loads((a / "checkpoints" / "step_2" / "train_state.json").read_text())["meta"]
    assert meta["base"]["fingerprint"] == meta["base_fingerprint"] and "weights_fingerprint" in meta["base"]

    # Resume from step 2 in another run directory: steps 3 and 4 again, bit for bit, and the same adapter.
    assert main(_run_args(shards, base, b, "--train.max_steps=4", f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert sorted(records(b)) == [3, 4] and all(records(a)[s] == records(b)[s] for s in (3, 4))
    wa, wb = load_file(a / "adapter" / "adapter_model.safetensors"), load_file(b / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # treadle export of the checkpoint: the run's own adapter again; --merge: one Hugging Face model.
    assert main(["export", str(a), str(tmp_path / "adapter")]) == 0
    again = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert again.keys() == wa.keys() and all(torch.equal(again[k], wa[k]) for k in wa)
    assert main(["export", str(a), str(tmp_path / "merged"), "--merge"]) == 0
    assert read_identity(a / "adapter")["fingerprint"] == meta["base_fingerprint"]
    _vllm_contract(a / "adapter", AutoModelForCausalLM.from_pretrained(base))

    # Both score text like the trained run: PEFT's own loader on the base, and the merged model.
    batch = _batch(3, rows=2, length=16)
    with torch.no_grad():
        want = _logits(live.eval(), batch)
        peft_model = load_adapter(AutoModelForCausalLM.from_pretrained(base), a / "adapter").eval()
        from peft import PeftModel

        assert isinstance(peft_model, PeftModel)
        got = peft_model(**batch, use_cache=False).logits
        merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), batch)
    assert torch.allclose(got, want, rtol=0, atol=1e-5) and torch.allclose(merged, want, rtol=0, atol=1e-5)
    assert not torch.allclose(want, _logits(AutoModelForCausalLM.from_pretrained(base).eval(), batch), atol=1e-4)

    # Another base where the run's was: resume and export refuse it in one line; so does loading the adapter.
    build_family("llama", base, shards / "tok", seed=1)
    assert main(_run_args(shards, base, a, "--train.max_steps=6", "--checkpoint.allow_schedule_change=true")) == 2
    assert main(["export", str(a), str(tmp_path / "merged2"), "--merge"]) == 2
    from treadle.models.lora import base_identity
    from treadle.config import ModelConfig

    other = AutoModelForCausalLM.from_pretrained(base)
    with pytest.raises(UserError, match=r"adapter .* was trained on another base model \(llama: weights_fingerprint \w+ then, \w+ now\); accepted"):
        load_adapter(other, a / "adapter", base_identity(ModelConfig(path=str(base)), other.config, 0))


def test_refusals_name_the_cause(shards, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # QLoRA without a backend: bitsandbytes absent
    base = tmp_path / "base"
    build_family("qwen2", base, shards / "tok")
    capsys.readouterr()  # transformers' progress bar of the save
    checks = [
        (_run_args(shards, base, tmp_path / "t", '--lora.target_modules=["q_proj","c_attn"]'),
         "lora.target_modules: 'c_attn' is not a module of this qwen2 model; accepted: 'all-linear' or names among"),
        (_run_args(shards, base, tmp_path / "q", "--lora.quantize=4bit"),
         "lora.quantize = '4bit' cannot hold the base in 4-bit: bitsandbytes is not installed"),
    ]
    for argv, want in checks:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "t").exists()
    assert main(args(shards, tmp_path / "full", "--train.max_steps=1", "--schedule.warmup_steps=0")) == 0
    assert main(["export", str(tmp_path / "full"), str(tmp_path / "m"), "--merge"]) == 2
    assert "without LoRA adapters to merge" in capsys.readouterr().err


def test_an_sft_run_trains_adapters_and_modules_to_save(shards, tmp_path, monkeypatch, capsys):
    """... and its adapter, trained on a base named by a relative path, records the base's absolute path: PEFT's
    AutoPeftModelForCausalLM loads it from another directory; ``treadle export --base-name`` records a hub id."""
    from peft import AutoPeftModelForCausalLM

    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "sft"
    argv = [a for a in _run_args(shards, "base", out, "--train.max_steps=2", "--lora.modules_to_save=[\"lm_head\"]",
                                 "--lora.target_modules=[\"q_proj\",\"v_proj\"]") if not a.startswith("--data.train=")]
    monkeypatch.chdir(tmp_path)  # --model.path=base: relative to the run's directory
    assert main(argv + [f"--data.train={pairs}"]) == 0
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing (5.23+)
        warnings.simplefilter("ignore", FutureWarning)
        auto = AutoPeftModelForCausalLM.from_pretrained(out / "adapter")
    assert torch.equal(auto.base_model.model.model.embed_tokens.weight,
                       load_file(base / "model.safetensors")["model.embed_tokens.weight"])
    monkeypatch.chdir(tmp_path)  # treadle export rebuilds the base from the run's model.path, relative to here
    assert main(["export", str(out), str(tmp_path / "hub"), "--base-name", "my-org/base"]) == 0
    hub = json.loads((tmp_path / "hub" / "adapter_config.json").read_text())
    assert hub["base_model_name_or_path"] == "my-org/base"
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "m"), "--merge", "--base-name", "my-org/base"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--base-name" in err and "--merge" in err and len(err.splitlines()) == 1 and not (tmp_path / "m").exists()
    from treadle.checkpoint.compat import _architecture

    # a resume may rename the base (lora.base_name), as it may change the dropout; not the rank
    lora = {"rank": 4, "alpha": 8.0}
    assert _architecture({"lora": lora}) == _architecture({"lora": {**lora, "base_name": "my-org/base"}})
    assert _architecture({"lora": lora}) != _architecture({"lora": {**lora, "rank": 8}})
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["modules_to_save"] == ["lm_head"]
    tensors = load_file(out / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in tensors  # the head trained in full travels with the adapter
    head = load_file(base / "model.safetensors")["lm_head.weight"]
    assert not torch.equal(tensors["base_model.model.lm_head.weight"], head)
    assert math.isfinite(records(out)[2])
    model = load_adapter(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
    assert torch.equal(model.base_model.model.lm_head.modules_to_save["default"].weight,
                       tensors["base_model.model.lm_head.weight"])
