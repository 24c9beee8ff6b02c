"""QLoRA (``lora.quantize = "4bit"``, models/lora.py quantize_base): the base's decoder linears held in NF4 by
bitsandbytes, PEFT's adapters trained on top, on the local engine. bitsandbytes is an optional extra (``pip install
treadle[qlora]``): without it these tests skip (the one-line refusal is tests/test_lora.py's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.families import build_family
from tests.helpers import args, records
from treadle.cli import main
from treadle.config import load_config

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_thread")


def _run_args(shards, base, out, *extra):
    return args(shards, out, f"--model.path={base}", "--lora.rank=4", "--lora.alpha=8", "--lora.quantize=4bit", *extra)


def test_qlora_holds_the_base_in_nf4_trains_adapters_checkpoints_them_alone_and_resumes_exactly(shards, tmp_path):
    from treadle.checkpoint.safety import read_metadata
    from treadle.train.run import build_trainer, close_trainer

    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    full = tmp_path / "full"  # the same adapters on the full-precision base
    assert main(args(shards, full, f"--model.path={base}", "--lora.rank=4", "--lora.alpha=8", "--train.max_steps=2")) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    trainer = build_trainer(load_config(None, _run_args(shards, base, a, "--train.max_steps=4",
                                                       "--checkpoint.every=2")[1:]))
    try:
        trainer.fit()
        live = trainer.engine.module
    finally:
        close_trainer(trainer)
    # Every decoder linear is a 4-bit bitsandbytes layer under PEFT's LoRA layer; the head is not quantized.
    q = live.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, bnb.nn.Linear4bit) and q.base_layer.weight.dtype == torch.uint8
    assert type(live.lm_head) is torch.nn.Linear
    # The first loss is the 4-bit base's: near the full-precision base's (NF4 rounding), not equal to it.
    first, want = records(a)[1], records(full)[1]
    assert first != want and abs(first - want) < 0.05 * want
    assert records(a)[4] < records(a)[1]
    # The checkpoint holds adapters (and their AdamW state) only: no packed weight, no quantization state.
    names = list(read_metadata(a / "checkpoints" / "step_2" / "state").state_dict_metadata)
    weights = [n for n in names if n.startswith("model.")]
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights), weights
    assert not any("absmax" in n or "quant_" in n for n in names)
    # Resume from step 2 elsewhere: steps 3 and 4 bit for bit (quantizing the same base gives the same NF4 base).
    assert main(_run_args(shards, base, b, "--train.max_steps=4", f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert sorted(records(b)) == [3, 4] and all(records(a)[s] == records(b)[s] for s in (3, 4))
    # The adapter is an ordinary PEFT adapter: it loads onto the full-precision base, and --merge folds it into that
    # base (QLoRA's usual merge: the served model is not the 4-bit one it trained against).
    from treadle.models.lora import load_adapter

    config = json.loads((a / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and load_file(a / "adapter" / "adapter_model.safetensors")
    load_adapter(AutoModelForCausalLM.from_pretrained(base), a / "adapter")
    assert main(["export", str(a), str(tmp_path / "merged"), "--merge"]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def test_qlora_is_refused_in_one_line_where_it_does_not_run(shards, tmp_path, capsys):
    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    capsys.readouterr()
    for extra, want in ((("--distributed.engine=ddp",), "lora.quantize = '4bit' with distributed.engine = 'ddp'"),
                        (("--model.dtype=bf16-weights",), "lora.quantize = '4bit' with model.dtype = 'bf16-weights'")):
        assert main(_run_args(shards, base, tmp_path / "r", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and len(err.splitlines()) == 1, err


def test_a_bf16_qlora_run_multiplies_its_4bit_layers_in_bf16(shards, tmp_path):
    """The 4-bit layers dequantize to the run's autocast dtype, as QLoRA computes (in fp32 they ran a 1.1B step at
    57 TFLOP/s on an H200 against LoRA's 101); an fp32 run keeps fp32."""
    from treadle.train.run import build_trainer, close_trainer

    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    for dtype, want in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        trainer = build_trainer(load_config(None, _run_args(shards, base, tmp_path / dtype, f"--model.dtype={dtype}",
                                                           "--train.max_steps=2")[1:]))
        try:
            layers = [m for m in trainer.engine.module.modules() if isinstance(m, bnb.nn.Linear4bit)]
            assert layers and {m.compute_dtype for m in layers} == {want}, dtype
            trainer.fit()  # and the step runs in that dtype
        finally:
            close_trainer(trainer)
