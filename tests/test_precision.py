"""model.dtype: bf16-weights keeps fp32 masters (exact fp32 update); auto is measured once, cached, recorded."""

import json

import pytest
import torch
from safetensors.torch import load_file

from treadle.cli import main
from treadle.config import load_config
from treadle.engine import build_engine
from treadle.engine.bf16_weights import Bf16WeightsEngine
from treadle.errors import UserError
from treadle.models import autotune
from treadle.models.hf import build_model
from treadle.train.auto import check_dtype
from treadle.train.step import loss_sum
from tests.helpers import SMALL_MODEL, args, records

CPU = torch.device("cpu")


def _batch(gen, rows=2, seq=16, vocab=100):
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq).expand(rows, seq)}


def test_bf16_weights_compute_in_bf16_accumulate_in_fp32_and_update_the_fp32_master_exactly():
    cfg = load_config(None, [f"--model.overrides={SMALL_MODEL}", "--model.dtype=bf16-weights", "--optim.weight_decay=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=100)
    torch.manual_seed(0)
    ref = build_model(cfg.model, vocab_size=100)  # the same init, its parameters (not its buffers) in bf16, no masters
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    engine = build_engine("local", model, cfg, CPU)
    assert isinstance(engine, Bf16WeightsEngine) and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    micro = [_batch(gen), _batch(gen)]

    def fn(m, mb):
        loss = loss_sum(m, mb).sum()
        return loss, loss.detach()[None].double()

    engine.forward_backward(micro, fn)
    engine.clip_grad_norm(0.0)  # the masters are back in the parameters, their .grad the step's fp32 sum
    names = [n for n, _ in model.named_parameters()]
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert {t.dtype for t in [*master.values(), *grads.values()]} == {torch.float32}
    # Each micro-batch's bf16 gradient, summed in fp32 (not rounded to bf16 between micro-batches).
    summed = {n: torch.zeros_like(master[n]) for n in names}
    for mb in micro:
        ref.zero_grad()
        loss_sum(ref, mb).sum().backward()
        for n, p in ref.named_parameters():
            summed[n] += p.grad.float()
    assert all(torch.equal(grads[n], summed[n]) for n in names)
    # The update is fp32 AdamW on the fp32 master, bit for bit.
    clones = [master[n].clone().requires_grad_() for n in names]
    for c, n in zip(clones, names):
        c.grad = grads[n].clone()
    o = cfg.optim
    reference = torch.optim.AdamW(clones, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=0.0, fused=True)
    engine.step()
    reference.step()
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), clones))
    assert all(torch.equal(v, c) for v, c in zip(engine.export_state_dict().values(), clones))  # fp32 export
    engine.zero_grad()
    engine.forward_only([], fn)  # the next forward computes with the rounded copies
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, c.to(torch.bfloat16)) for p, c in zip(model.parameters(), clones))


def test_bf16_weights_run_resumes_bit_for_bit_in_checkpoints_an_fp32_run_can_read(shards, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    bf16w = ("--model.dtype=bf16-weights", "--train.max_steps=4", "--checkpoint.keep_last=3")
    assert main(args(shards, a, *bf16w, "--checkpoint.every=2")) == 0
    assert main(args(shards, b, *bf16w, f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    loss_a, loss_b = records(a), records(b)
    assert loss_a[4] < loss_a[1] and [loss_a[s] for s in (3, 4)] == [loss_b[s] for s in (3, 4)]
    wa, wb = load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors")
    assert all(v.dtype == torch.float32 and torch.equal(v, wb[k]) for k, v in wa.items())  # the masters, exported
    # The checkpoint holds fp32 masters and fp32 optimizer state, as an fp32 run's does: fp32 continues from it.
    assert main(args(shards, c, "--train.max_steps=4", f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert abs(records(c)[3] - loss_a[3]) < 0.05


def test_bf16_weights_is_refused_where_no_engine_keeps_fp32_masters():
    with pytest.raises(UserError, match=r"model.dtype = 'bf16-weights' is not available to distributed.engine 'fsdp2' "
                                        r".*accepted: auto, fp32, bf16$"):
        check_dtype(load_config(None, ["--model.dtype=bf16-weights"]), "fsdp2")
    with pytest.raises(UserError, match="not available to a draft run"):
        check_dtype(load_config(None, ["--model.dtype=bf16-weights", "--draft.kind=glide", "--draft.target=x"]), "local")
    check_dtype(load_config(None, ["--model.dtype=bf16-weights"]), "local")


def test_auto_picks_the_fastest_candidate_only_past_the_bf16_margin(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    cfg = load_config(None, [f"--model.overrides={SMALL_MODEL}"])
    model = build_model(cfg.model, vocab_size=100)
    candidates = ("fp32", "bf16", "bf16-weights")
    key = autotune._shape_key(model, 4, 32, CPU, candidates)
    cached = tmp_path / "autotune" / f"{key}.json"
    cached.parent.mkdir()
    for seconds, expected in (({"fp32": 1.0, "bf16": 0.95, "bf16-weights": 0.97}, "fp32"),  # within the margin
                              ({"fp32": 1.0, "bf16": 0.8, "bf16-weights": 0.6}, "bf16-weights"),
                              ({"fp32": 0.5, "bf16": 0.8, "bf16-weights": 0.6}, "fp32")):
        cached.write_text(json.dumps({"seconds": seconds}))
        choice, layer_s, steady = autotune.choose_dtype(model, 4, 32, CPU, candidates)
        assert choice.value == expected and layer_s == seconds[expected] and steady and str(cached) in choice.why
    # A measurement whose passes disagree (a busy machine) decides this run only: nothing is cached.
    monkeypatch.setattr(autotune, "STEADY", 0.5)  # no two passes are ever this close
    choice, layer_s, steady = autotune.choose_dtype(model, 2, 8, CPU, candidates)
    assert "not cached: passes varied" in choice.why and [p.name for p in cached.parent.iterdir()] == [cached.name]
    assert autotune.choose_compile(10 * layer_s, layers=4, micro_steps=10**9, device=CPU, steady=steady).value is False
    assert autotune.choose_compile(1.0, layers=4, micro_steps=100, device=CPU).value is False  # 400 s
    assert autotune.choose_compile(1.0, layers=4, micro_steps=200, device=CPU).value is True  # 800 s


def test_auto_is_measured_once_recorded_in_config_toml_and_leaves_the_runs_randomness_alone(shards, tmp_path, monkeypatch,
                                                                                             capsys):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "STEADY", float("inf"))  # cached however busy the machine is
    auto = ("--model.dtype=auto", "--model.compile=auto", "--train.max_steps=2")
    assert main(args(shards, tmp_path / "a", *auto)) == 0
    first = capsys.readouterr().out
    assert main(args(shards, tmp_path / "b", *auto)) == 0
    second = capsys.readouterr().out
    assert "model.dtype = auto -> " in first and "measured now in" in first and "cached in" in second
    assert "model.compile = auto -> false: estimated eager time" in first
    saved = (tmp_path / "a" / "config.toml").read_text()
    assert 'compile = false' in saved and any(f'dtype = "{d}"' in saved for d in ("fp32", "bf16", "bf16-weights"))
    # The probe leaves torch's RNG as it was: the measured run trains, and ends in the RNG state, as the cached one.
    assert records(tmp_path / "a") == records(tmp_path / "b")
    rng = [(tmp_path / r / "checkpoints" / "step_2" / "rng" / "rank_0.json").read_text() for r in ("a", "b")]
    assert rng[0] == rng[1]
