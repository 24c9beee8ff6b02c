"""model.dtype = "fp8": refused in one line where it cannot run (without torchao, as CI runs), never chosen by auto,
torchao's layer rule; and, where torchao is installed, the conversion and a real run through treadle's loop.

torchao is no dependency of treadle: the last two tests skip without it (run them with torchao on PYTHONPATH).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import args, records
from treadle.cli import main
from treadle.config import load_config
from treadle.errors import UserError
from treadle.metrics.flops import device_peak
from treadle.models import fp8
from treadle.train import auto
from treadle.train.auto import check_dtype, dtype_candidates

ACCEPTED = "auto, fp32, bf16, bf16-weights"
# Llama-3.2-1B's and Llama-3-8B's linear layers, (out_features, in_features): q, k/v, o, gate/up, down.
LLAMA_1B = {"q": (2048, 2048), "kv": (512, 2048), "o": (2048, 2048), "gate_up": (8192, 2048), "down": (2048, 8192)}
LLAMA_8B = {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}


def test_fp8_on_a_cpu_is_refused_in_one_line_naming_the_key_the_device_and_what_is_accepted(shards, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(shards, out, "--model.dtype=fp8", "--train.max_steps=2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("treadle: error: model.dtype = 'fp8' needs float8 tensor cores (CUDA capability >= 8.9")
    assert "this run's device is cpu; accepted here: model.dtype = auto, fp32, bf16, bf16-weights" in err
    assert not out.exists()  # refused before the run directory is written


def test_fp8_on_a_pre_hopper_gpu_or_without_torchao_is_refused_with_the_install_line():
    a100 = fp8.hardware_refusal("cuda:0 (NVIDIA A100-SXM4-80GB)", (8, 0), "0.18.0", "2.11.0+cu130", ACCEPTED)
    assert a100 == ("model.dtype = 'fp8' needs float8 tensor cores (CUDA capability >= 8.9: H100, H200, Ada), but "
                    "this run's device is cuda:0 (NVIDIA A100-SXM4-80GB), CUDA capability 8.0; accepted here: "
                    f"model.dtype = {ACCEPTED}")
    missing = fp8.hardware_refusal("cuda:0 (NVIDIA H100 80GB HBM3)", (9, 0), None, "2.11.0+cu130", ACCEPTED)
    assert missing == ("model.dtype = 'fp8' trains through torchao, which is not installed or does not import: "
                       "pip install 'torchao>=0.17' (the torchao releases for torch 2.11.0+cu130); accepted without "
                       f"it: model.dtype = {ACCEPTED}")
    assert fp8.hardware_refusal("cuda:0 (NVIDIA H200)", (9, 0), "0.18.0", "2.11.0", ACCEPTED) is None
    assert fp8.hardware_refusal("cuda:0 (NVIDIA L40S)", (8, 9), "0.18.0", "2.11.0", ACCEPTED) is None
    # Each torch with the torchao releases built for it (torchao/__init__.py of 0.13 ... 0.18).
    assert [fp8.torchao_requirement(v) for v in ("2.7.1", "2.8.0", "2.9.1", "2.10.0+cu128", "2.11.0", "2.15.0")] == [
        None, "torchao==0.13.*", "torchao>=0.14.1,<0.16", "torchao==0.16.*", "torchao>=0.17", "torchao>=0.17"]


@pytest.mark.parametrize("overrides, engine, says", [
    ([], "deepspeed", "is not available to distributed.engine 'deepspeed'"),
    ([], "pipeline", "is not available to distributed.engine 'pipeline'"),
    (["--distributed.tensor_parallel=2"], "fsdp2", "is not available with distributed.tensor_parallel = 2"),
    (["--draft.kind=glide", "--draft.target=x"], "local", "is not available to a draft run"),
])
def test_fp8_is_refused_by_the_engines_and_runs_it_does_not_support(overrides, engine, says):
    cfg = load_config(None, ["--model.dtype=fp8", *overrides])
    with pytest.raises(UserError, match=rf"^model.dtype = 'fp8' {says} .*; accepted: .*model.dtype = auto, fp32"):
        check_dtype(cfg, engine)
    for supported in fp8.ENGINES:  # the engine alone (no device given) lets them through
        check_dtype(load_config(None, ["--model.dtype=fp8"]), supported)


def test_auto_never_picks_fp8():
    for engine in ("local", "ddp", "fsdp2", "deepspeed", "pipeline"):
        for extra in ([], ["--draft.kind=glide", "--draft.target=x"]):
            assert "fp8" not in dtype_candidates(load_config(None, extra), engine)


def test_torchaos_layer_rule_on_llama_shapes():
    def kept(shapes, recipe):
        return {name for name, (n, k) in shapes.items() if fp8.converts(n, k, recipe)}

    # tensorwise leaves out only what is small on both sides (k/v of a GQA model); rowwise, whose scales cost
    # more, keeps at 1.1B only the MLP's wide outputs and at 8B all but k/v.
    assert kept(LLAMA_1B, "tensorwise") == {"q", "o", "gate_up", "down"}
    assert kept(LLAMA_1B, "rowwise") == {"gate_up"}
    assert kept(LLAMA_8B, "tensorwise") == {"q", "o", "gate_up", "down"}
    assert kept(LLAMA_8B, "rowwise") == {"q", "o", "gate_up", "down"}
    assert not fp8.converts(8200, 4104, "tensorwise") and fp8.converts(8208, 4112, "tensorwise")  # 16 divides both
    # The LM head is never converted, however large.
    model = nn.Module()
    model.proj, model.head = nn.Linear(64, 2048), nn.Linear(64, 8192)
    model.get_output_embeddings = lambda: model.head
    keep = fp8.layer_filter(model, "tensorwise")
    assert keep(model.proj, "proj") and not keep(model.head, "head")


def test_the_peak_of_an_fp8_run_is_twice_bf16s():
    assert device_peak("NVIDIA H100 80GB HBM3", "fp8") == 2 * device_peak("NVIDIA H100 80GB HBM3", "bf16") == 1978.0
    assert device_peak("NVIDIA H200", "fp32") == 67.0 and device_peak("NVIDIA H200", "bf16-weights") == 989.0


# A Llama whose MLP is just wide enough for torchao's rule (gate/up 1040 x 64 converts under tensorwise; down,
# attention and the 2048-wide LM head would, but the head never does): small enough for a CPU.
WIDE_MLP = "{hidden_size=64,intermediate_size=1040,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2}"


def test_conversion_swaps_the_kept_layers_and_keeps_names():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from treadle.models.hf import build_model

    model = build_model(load_config(None, [f"--model.overrides={WIDE_MLP}"]).model, vocab_size=2048)
    names = list(model.state_dict())
    line = fp8.apply_fp8(model, "tensorwise")
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")]
    assert type(model.lm_head) is nn.Linear and list(model.state_dict()) == names  # checkpoints unchanged
    assert "4 of 15 linear layers in float8" in line
    model = build_model(load_config(None, [f"--model.overrides={WIDE_MLP}"]).model, vocab_size=2048)
    fp8.apply_fp8(model, "rowwise")  # 1040 x 64 is too small for rowwise's rule
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_an_fp8_run_trains_through_treadles_loop_where_the_hardware_check_is_lifted(shards, tmp_path, monkeypatch,
                                                                                 capsys):
    """The CPU has no float8 tensor cores, but torch's CPU kernels run torchao's float8 matmuls: with the hardware
    check lifted (the one part a CPU cannot pass) the run converts, trains under bf16 autocast, and tracks bf16."""
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(auto, "check_fp8", lambda *a, **k: None)
    common = ["--train.max_steps=3", f"--model.overrides={WIDE_MLP}", "--train.grad_accum_steps=1",
              "--model.compile=false"]
    assert main(args(shards, tmp_path / "fp8", "--model.dtype=fp8", *common)) == 0
    out = capsys.readouterr().out
    assert "treadle: model.dtype = fp8 (tensorwise, torchao" in out and "4 of 15 linear layers in float8" in out
    assert main(args(shards, tmp_path / "bf16", "--model.dtype=bf16", *common)) == 0
    got, ref = records(tmp_path / "fp8"), records(tmp_path / "bf16")
    assert got != ref and all(abs(got[s] - ref[s]) <= 0.02 * ref[s] for s in (1, 2, 3)), (got, ref)


def test_fp8_compiles_at_compile_auto(monkeypatch):
    monkeypatch.setattr(auto, "check_fp8", lambda *a, **k: None)  # the CPU would be refused first
    cfg, lines, check = auto.resolve_auto(load_config(None, ["--model.dtype=fp8"]), nn.Linear(2, 2), "local",
                                          torch.device("cpu"))
    assert cfg.model.compile is True and check is None
    assert lines == ["treadle: model.compile = auto -> true: torchao's float8 pays only compiled (its speed-ups are "
                     "measured with torch.compile fusing its casts and scales; torchao/float8/README.md)"]
