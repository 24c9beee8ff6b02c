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
from treadle import machine_load
from treadle.machine_load import Given, Readings
from treadle.models import autotune
from treadle.models.hf import build_model
from treadle.train.auto import check_dtype
from treadle.train.step import loss_sum
from tests.helpers import SMALL_MODEL, args, records

CPU = torch.device("cpu")
# The machine's load as the probe's watch reads it, given: a test never depends on how busy its machine is.
QUIET = Readings(load=0.5, cpus=2, steal=0.0)
LOADED = Readings(load=3.9, cpus=2, steal=0.0)


def quiet():
    return Given(QUIET)


def loaded():
    return Given(LOADED)


@pytest.fixture
def quiet_machine(monkeypatch):
    """Runs through the CLI read a quiet machine (the probe's figures may be cached)."""
    monkeypatch.setattr(machine_load, "watch", quiet)


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
    monkeypatch.setattr(autotune, "STALE", float("inf"))  # the made-up figures below pass the check against the real
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
        choice, layer_s, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates)
        assert choice.value == expected and layer_s == seconds[expected] and busy is None and str(cached) in choice.why
    # A measurement whose passes disagree (a busy machine) decides this run only: nothing is cached.
    monkeypatch.setattr(autotune, "STEADY", 0.5)  # no two passes are ever this close
    choice, layer_s, busy = autotune.choose_dtype(model, 2, 8, CPU, candidates, watch=quiet)
    assert "with passes that varied by more than " in choice.why and "this run only, not cached" in choice.why
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]
    assert autotune.choose_compile(10 * layer_s, layers=4, micro_steps=10**9, device=CPU, busy=busy).value is False
    assert autotune.choose_compile(1.0, layers=4, micro_steps=100, device=CPU).value is False  # 400 s
    assert autotune.choose_compile(1.0, layers=4, micro_steps=200, device=CPU).value is True  # 800 s


def test_auto_is_measured_once_recorded_in_config_toml_and_leaves_the_runs_randomness_alone(shards, tmp_path, monkeypatch,
                                                                                             capsys, quiet_machine):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "STEADY", float("inf"))  # cached however busy the machine is
    monkeypatch.setattr(autotune, "STALE", float("inf"))  # and kept however the load changes between the runs
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


GEMMA3 = ('{model_type="gemma3_text",hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,'
          'num_key_value_heads=2,head_dim=8,sliding_window=16}')


def test_auto_probes_a_gemma3_run_whose_layers_take_a_rotary_embedding_per_layer_type(shards, tmp_path, monkeypatch,
                                                                                         capsys, quiet_machine):
    """Gemma 3's rotary embedding takes the layer type: the probe runs the layer with the inputs its model makes."""
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "STEADY", float("inf"))  # a steady figure, so the compile line gives the estimate
    assert main(args(shards, tmp_path / "g", f"--model.overrides={GEMMA3}", "--model.dtype=auto",
                     "--model.compile=auto", "--train.max_steps=2")) == 0
    out = capsys.readouterr().out
    assert "model.dtype = auto -> " in out and "one decoder layer's forward+backward at 4 x 32" in out, out
    assert "model.compile = auto -> false: estimated eager time" in out and "could not be probed" not in out
    # The estimate says what it is made of.
    assert (" x 2 layers x 4 micro-batches (the probe's figure; the embedding, head, optimizer and evals not counted)"
            in out)


def test_a_family_the_probe_cannot_run_falls_back_in_one_line_per_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    model = build_model(load_config(None, [f"--model.overrides={SMALL_MODEL}"]).model, vocab_size=100)

    def unrunnable(*a, **k):
        raise TypeError("FancyRotary.forward() missing 1 required positional argument: 'layer_type'")

    monkeypatch.setattr(autotune, "_layer_inputs", unrunnable)
    choice, layer_s, busy = autotune.choose_dtype(model, 4, 32, CPU, ("fp32", "bf16"), watch=quiet)
    assert choice.value == "fp32" and layer_s is None and busy.startswith("one llama decoder layer could not be probed")
    assert choice.why == ("one llama decoder layer could not be probed (TypeError: FancyRotary.forward() missing 1 "
                          "required positional argument: 'layer_type'); fp32, which needs no measurement")
    compiled = autotune.choose_compile(layer_s, 2, 100, CPU, busy)
    assert compiled.value is False and compiled.why.startswith("no step-time estimate (the probe could not run)")
    assert not (tmp_path / "autotune").exists()


def test_a_cached_figure_taken_under_load_is_measured_again_and_the_line_says_so(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "STEADY", float("inf"))  # the new figure is cached however busy the machine is
    model = build_model(load_config(None, [f"--model.overrides={SMALL_MODEL}"]).model, vocab_size=100)
    candidates = ("fp32", "bf16")
    cached = tmp_path / "autotune" / f"{autotune._shape_key(model, 4, 32, CPU, candidates)}.json"
    cached.parent.mkdir(parents=True)
    # As a run on a busy machine cached it (x10, so that a check on a loaded test machine is still far from it):
    # seconds per pass of a layer that takes about a millisecond.
    cached.write_text(json.dumps({"seconds": {"fp32": 34.24, "bf16": 50.0}}))
    choice, layer_s, _ = autotune.choose_dtype(model, 4, 32, CPU, candidates, watch=quiet)
    assert "; the cached fp32 34240 ms was " in choice.why and "slower than a check now" in choice.why, choice.why
    assert "taken under load: measured again" in choice.why and "measured now in" in choice.why
    fresh = json.loads(cached.read_text())["seconds"]
    assert fresh[choice.value] == layer_s < 34.24 / autotune.STALE and fresh["bf16"] < 50.0 / autotune.STALE
    # Measured again on a machine too busy for a steady figure: the stale one is dropped, the next run measures.
    cached.write_text(json.dumps({"seconds": {"fp32": 34.24, "bf16": 50.0}}))
    monkeypatch.setattr(autotune, "STEADY", 0.5)  # no two passes are ever this close
    choice, _, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates, watch=quiet)
    assert "not cached" in choice.why and "measured again" in choice.why and not cached.exists()
    assert busy.startswith("with passes that varied")
    monkeypatch.setattr(autotune, "STEADY", float("inf"))
    # Issue 48: measured again under a steady load, whose passes agree: not cached again either.
    cached.write_text(json.dumps({"seconds": {"fp32": 34.24, "bf16": 50.0}}))
    choice, _, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates, watch=loaded)
    assert ("on a loaded machine (load 3.9 on 2 CPUs): this choice holds for this run only, not cached; the cached "
            "fp32 34240 ms was ") in choice.why and "measured again" in choice.why and not cached.exists()
    # The other way round, a figure far faster than the check: this machine is busy now, the calmer figure is kept.
    cached.write_text(json.dumps({"seconds": {"fp32": 1e-7, "bf16": 2e-7}}))
    choice, layer_s, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates)
    assert choice.value == "fp32" and layer_s == 1e-7 and busy is None
    assert f"cached in {cached}; a check now ran " in choice.why
    assert "a busy machine, the cached figure kept" in choice.why


def test_a_figure_measured_on_a_loaded_machine_is_not_cached_and_decides_no_compile(tmp_path, monkeypatch, one_thread):
    """Issue 48: under a steady load the passes agree, so steadiness alone cached a figure 10x too slow."""
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "STEADY", float("inf"))  # passes that agree, as under a steady load
    model = build_model(load_config(None, [f"--model.overrides={SMALL_MODEL}"]).model, vocab_size=100)
    candidates = ("fp32", "bf16")
    choice, layer_s, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates, watch=loaded)
    assert busy == "on a loaded machine (load 3.9 on 2 CPUs)" and layer_s > 0
    assert choice.why.endswith("on a loaded machine (load 3.9 on 2 CPUs): this choice holds for this run only, "
                               "not cached)"), choice.why
    assert not (tmp_path / "autotune").exists()
    # The compile estimate does not inherit the figure.
    compiled = autotune.choose_compile(layer_s, 4, 10**9, CPU, busy)
    assert compiled.value is False and compiled.estimate_s is None
    assert compiled.why == ("no step-time estimate from a figure measured on a loaded machine (load 3.9 on 2 CPUs); "
                            "model.compile = true compiles anyway")
    # Quiet, the same measurement is cached.
    choice, _, busy = autotune.choose_dtype(model, 4, 32, CPU, candidates, watch=quiet)
    assert busy is None and "measured now in" in choice.why and "not cached" not in choice.why
    assert autotune.probe_path(model, 4, 32, CPU, candidates).is_file()


def test_the_load_verdict_reads_the_load_average_steal_and_a_reference_kernel(tmp_path, monkeypatch):
    judge = machine_load.judge
    assert judge(Readings(load=3.9, cpus=2)).loaded and judge(Readings(load=3.9, cpus=2)).why == "load 3.9 on 2 CPUs"
    quiet_verdict = judge(Readings(load=2.4, cpus=2, steal=0.02, reference_s=1.2, quiet_s=1.0))
    assert not quiet_verdict.loaded  # this process' own thread and 1.4 others' on 2 CPUs
    assert judge(Readings(load=7.5, cpus=8)).loaded and not judge(Readings(load=7.5, cpus=8, own=8)).loaded  # 8 ranks
    assert quiet_verdict.why == ("load 2.4 on 2 CPUs, 2% of CPU time stolen by the hypervisor, a reference kernel "
                                 "1.2x slower than on this machine when quiet")
    stolen = judge(Readings(load=0.1, cpus=16, steal=0.3))
    assert stolen.loaded and stolen.why == "30% of CPU time stolen by the hypervisor"
    slow = judge(Readings(load=None, cpus=2, reference_s=3.0, quiet_s=1.0))
    assert slow.loaded and slow.why == "a reference kernel 3.0x slower than on this machine when quiet"
    assert not judge(Readings(cpus=2)).loaded and judge(Readings(cpus=2)).why == "no load readings on this system"
    assert machine_load.steal_share((1000, 10), (1200, 50)) == 0.2
    assert machine_load.steal_share((1000, 10), (1010, 12)) is None  # too few ticks to say
    ticks = machine_load.cpu_ticks()
    assert ticks is None or ticks[0] >= ticks[1] >= 0
    # The real reference kernel: against a quiet figure no machine reaches, loaded, and the figure is kept.
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"seconds": 1e-12}))
    verdict = machine_load.Watch(path).verdict()
    assert verdict.loaded and "x slower than on this machine when quiet" in verdict.why
    assert json.loads(path.read_text()) == {"seconds": 1e-12}
    # No figure yet and nothing else loaded: the quiet figure is recorded (the fastest pass, before or after).
    monkeypatch.setattr(machine_load, "load_average", lambda: 0.0)
    monkeypatch.setattr(machine_load, "cpu_ticks", lambda: None)
    path.unlink()
    watch = machine_load.Watch(path)
    assert not watch.verdict().loaded and json.loads(path.read_text())["seconds"] == min(watch.reference) > 0


def test_a_resumed_runs_compile_estimate_counts_the_steps_left(tmp_path, monkeypatch):
    from treadle.train.auto import resolve_auto

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "STALE", float("inf"))  # the made-up figure below passes the check
    cfg = load_config(None, [f"--model.overrides={SMALL_MODEL}", "--model.dtype=fp32", "--model.compile=auto",
                             "--train.max_steps=100", "--train.grad_accum_steps=2"])
    model = build_model(cfg.model, vocab_size=100)
    entry = autotune.probe_path(model, cfg.train.micro_batch_size, cfg.data.seq_len, CPU, ("fp32",))
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps({"seconds": {"fp32": 0.5}}))
    layers = len(autotune.decoder_layers(model))
    _, lines, check = resolve_auto(cfg, model, "local", CPU, start_step=40)
    assert (f"estimated eager time {0.5 * layers * 120:.0f} s = one decoder layer's 500 ms x {layers} layers x 120 "
            "micro-batches left after step 40 (the probe's figure") in lines[0], lines
    assert check.estimate_s == 0.5 * layers * 120
    _, lines, _ = resolve_auto(cfg, model, "local", CPU)
    assert f"x {layers} layers x 200 micro-batches (the probe's figure" in lines[0]


def test_the_first_steps_check_the_probes_figure_and_the_compile_estimate(shards, tmp_path, monkeypatch, capsys):
    from treadle.train.auto import StepTimeCheck

    # A figure by which the layers alone take 100x the run's fastest step: its cache entry goes, and a line says so.
    cache = tmp_path / "entry.json"
    cache.write_text("{}")
    check = StepTimeCheck(1.0, 10.0, str(cache), compile_auto=True, compiled=False, estimate_s=40.0)
    line, = check.floor_lines(fastest=0.1)
    assert line == (f"treadle: auto: the run's steps take 100 ms, but by the probe's figure (1000 ms per layer and "
                    f"micro-batch) their decoder layers alone take at least 10000 ms: the figure was taken under load; "
                    f"{cache} is dropped, the next run measures again") and not cache.exists()
    assert StepTimeCheck(1.0, 10.0, None, True, True, None).floor_lines(0.1) == []  # compiled: no floor
    # The steps project an eager time past the threshold that the estimate had below it.
    check = StepTimeCheck(1e-3, 1e-3, None, True, False, 29.0)
    assert check.compile_line([(4, 1.6), (64, 1.5)], 600, 4.0) == (
        "treadle: auto: the run's steps (1.60 s each to step 4 and 1.50 s each to step 64) project its eager time at "
        "904 s, not the 29 s estimated from the probe: past 600 s a compile may pay back (model.compile = true); "
        "model.compile stays false for this run")
    assert check.compile_line([(4, 0.01)], 600, 4.0) is None
    # Issue 39: first steps slowed by a neighbour (1.6 s) and the pace measured again later (10 ms): the faster
    # decides, and nothing is said.
    assert check.compile_line([(4, 1.6), (64, 0.01)], 540, 100.0) is None

    # Through a run: a cached figure far faster than the machine is now (kept: a busy machine), so the estimate is
    # ~0 s; against a threshold of 0.01 s the run's steps project past it. The line comes only once the pace was
    # measured a second time (steps 2-4, then 8-10), and a run resumed from a checkpoint does not say it again.
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "COMPILE_PAYS_AFTER_S", 0.01)
    cfg = load_config(None, [f"--model.overrides={SMALL_MODEL}"])
    probe_model = build_model(cfg.model, vocab_size=512)
    entry = autotune.probe_path(probe_model, 4, 32, CPU, ("fp32", "bf16", "bf16-weights"))
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps({"seconds": {"fp32": 1e-9, "bf16": 1e-9, "bf16-weights": 1e-9}}))
    auto = ("--model.dtype=auto", "--model.compile=auto", "--train.max_steps=10", "--train.eval_every=0",
            "--checkpoint.every=2", "--checkpoint.keep_last=5")
    assert main(args(shards, tmp_path / "run", *auto)) == 0
    out = capsys.readouterr().out
    assert "a busy machine, the cached figure kept" in out
    assert "model.compile = auto -> false: estimated eager time 0 s" in out
    advice = "treadle: auto: the run's steps ("
    assert out.count(advice) == 1 and "each to step 4 and " in out and "each to step 10) project" in out, out
    assert out.index("step 10:") < out.index(advice)
    resumed = tmp_path / "resumed"
    assert main(args(shards, resumed, *auto, f"--checkpoint.resume={tmp_path / 'run' / 'checkpoints' / 'step_2'}")) == 0
    out = capsys.readouterr().out
    assert "step 10:" in out and advice not in out and "the first steps" not in out
