"""The device mesh and tensor parallelism (``distributed.tensor_parallel``, HSDP's ``data_parallel_replicate``).

In this process: the mesh's arithmetic (which rank reads which rows, the one-line refusals of axes that do not fit
a launch), the config's refusals, and which families the tensor-parallel plan takes.

Two launches on gloo, each checking much against one process on the same global batch (fp32):

* 2 ranks: TP 2 on the FSDP2 engine (3 steps at GA 2: losses, grad norms, label tokens, exported weights), a tied
  embedding, one step of every family the plan accepts; then a whole run through ``run_training`` at TP 2 whose
  checkpoint of step 2 one process (TP 1) resumes (DCP reshards the vocabulary / column / row shards), and a run of
  a saved model (``model.path``) with activation checkpointing.
* 4 ranks: FSDP 2 x TP 2, HSDP (replicate 2 x shard 2), HSDP x CP (replicate 2 x context 2) and CP 2 x TP 2 (the
  context group's all-to-all splits the heads TP left each rank) on the engine (3 steps); then a whole run at FSDP 2 x
  TP 2 whose checkpoint of step 2 is resumed in the same launch as FSDP 4 (2-D DTensors read back as 1-D shards).

Tolerances (fp32): TP sums partial matmuls and norms in another order than one process, a few ulps per op:
losses and grad norms 1e-5 relative, weights after AdamW 1e-5 absolute (tests/test_engines_dist.py's bounds).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import args, records
from tests.test_engines_dist import (CPU, GA, GRAD_CLIP, ROWS, STEPS, WEIGHT_ATOL, assert_steps_match, global_batch,
                                     local_run, make_optimizer, max_abs_diff, rank_micro_batches, snapshot, tiny_llama)
from treadle.cli import main
from treadle.config import load_config
from treadle.distributed import DistInfo
from treadle.engine.local import LocalEngine
from treadle.engine.mesh import _sizes, build_mesh
from treadle.errors import UserError
from treadle.train.step import optimizer_step

RTOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# The families the plan takes (tests/families.py); the others are refused in one line (test below).
TP_FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "granite", "smollm3")
REFUSED = {"qwen3_moe": "mixture-of-experts", "mixtral": "mixture-of-experts", "gpt_oss": "mixture-of-experts",
           "deepseek_v3": "no separate q/k/v/o projections", "phi3": "no separate q/k/v/o projections",
           "olmo2": "q_norm (Olmo2RMSNorm) over more than one head", "glm4": "no separate gate/up/down"}


def _axes(tp=1, rep=1, shard=-1, cp=1, pp=1):
    return SimpleNamespace(pipeline_parallel=pp, data_parallel_replicate=rep, data_parallel_shard=shard,
                           context_parallel=cp, tensor_parallel=tp)


# ---------------------------------------------------------------- in this process

def test_the_mesh_gives_every_rank_its_data_share_and_refuses_axes_that_do_not_fit():
    # 8 ranks as replicate 2 x shard 2 x tp 2: a TP pair reads the same rows, the 4 data ranks different ones.
    sizes = _sizes(_axes(tp=2, rep=2), 8)
    assert sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    from treadle.engine.mesh import Mesh

    meshes = [Mesh(r, 8, sizes) for r in range(8)]
    assert [m.dp_rank for m in meshes] == [0, 0, 1, 1, 2, 2, 3, 3] and {m.dp_size for m in meshes} == {4}
    assert [m.coordinate("tp") for m in meshes] == [0, 1] * 4
    cp = [Mesh(r, 4, _sizes(_axes(cp=2), 4)).layout for r in range(4)]  # CP's old layout: neighbours share a row
    assert [(c.dp_rank, c.cp_rank) for c in cp] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(UserError) as e:
        _sizes(_axes(tp=2, rep=2, shard=2), 4)
    assert str(e.value).startswith("distributed: data_parallel_replicate 2 x data_parallel_shard 2 x tensor_parallel 2 "
                                   "= 8 ranks, but the launch has 4; accepted:")
    with pytest.raises(UserError, match=r"^distributed: data_parallel_replicate 3 x tensor_parallel 2 = 6 ranks per "):
        _sizes(_axes(tp=2, rep=3), 4)
    with pytest.raises(UserError, match=r"^distributed.tensor_parallel = 3 does not divide the world size 4"):
        _sizes(_axes(tp=3), 4)
    one = build_mesh(_axes(), DistInfo(0, 1, 0, CPU, None))  # one process: no group, everything size 1
    assert one.device_mesh is None and one.loss_group is None and (one.dp_rank, one.dp_size) == (0, 1)


def test_the_plan_takes_llama_shaped_families_and_refuses_the_others_in_one_line(tmp_path):
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.families import COMMON, FAMILIES
    from treadle.engine.tensor_parallel import check_model

    for name, (cls, extra) in FAMILIES.items():
        model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra}))
        if name in TP_FAMILIES:
            check_model(model, 2, 32)
            continue
        with pytest.raises(UserError) as e:
            check_model(model, 2, 32)
        assert REFUSED[name] in str(e.value) and "\n" not in str(e.value), name
    with pytest.raises(UserError, match=r"tensor_parallel = 4 does not divide the model's num_key_value_heads = 2"):
        check_model(tiny_llama(), 4, 32)


def test_context_parallel_splits_the_heads_tensor_parallel_left():
    from treadle.engine.context_parallel import check_model

    config = tiny_llama().config  # 4 heads: TP 2 leaves 2 per rank, which CP 2 splits again
    check_model(config, 2, 2)
    with pytest.raises(UserError, match=r"^distributed.context_parallel = 2 x tensor_parallel = 4 does not divide the "
                                        r"model's 4 attention heads"):
        check_model(config, 2, 4)


def test_layouts_and_settings_tensor_parallel_cannot_run_exit_2_with_one_line(shards, tmp_path, capsys):
    cases = [
        (["--distributed.tensor_parallel=2"], "distributed.tensor_parallel = 2 does not divide the world size 1"),
        (["--distributed.data_parallel_shard=2"], "distributed: data_parallel_shard 2 = 2 ranks, but the launch has 1"),
        (["--distributed.tensor_parallel=2", "--distributed.engine=ddp"], "not on the ddp engine"),
        (["--distributed.data_parallel_replicate=2", "--distributed.engine=deepspeed"], "not on the deepspeed engine"),
        (["--distributed.tensor_parallel=2", "--model.loss_chunk_tokens=64"], "loss_chunk_tokens = 0 or auto"),
        (["--distributed.tensor_parallel=3"], "data.seq_len = 32 cannot be split into distributed.tensor_parallel = 3"),
        (["--distributed.tensor_parallel=2", "--distributed.context_parallel=2", "--data.seq_len=34"],
         "data.seq_len = 34 cannot be split into distributed.context_parallel x tensor_parallel = 4 equal parts"),
        (["--distributed.tensor_parallel=2", "--distributed.pipeline_parallel=2"], "inside pipeline stages"),
    ]
    for extra, message in cases:
        out = tmp_path / "run"
        assert main(args(shards, out, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("treadle: error:") and message in err[0], (extra, err)
        assert not out.exists()


# ---------------------------------------------------------------- on each rank

def _engine(axes, seed=0, model=None):
    """The FSDP2 engine on the launch's mesh (``axes``), as build_engine makes it; the mesh too."""
    from treadle.distributed import init_distributed
    from treadle.engine.fsdp2 import FSDP2Engine

    mesh = build_mesh(axes, init_distributed("cpu"))
    model = model if model is not None else tiny_llama(seed)
    return FSDP2Engine(model, make_optimizer, CPU, mesh=mesh.fsdp_mesh, tp_mesh=mesh.tp_mesh,
                       loss_group=mesh.loss_group), mesh


def _train(engine, mesh, steps=range(STEPS)):
    out = []
    for s in steps:
        r = optimizer_step(engine, rank_micro_batches(s, mesh.dp_rank, mesh.dp_size), grad_clip=GRAD_CLIP)
        out.append((r.loss, r.grad_norm, r.label_tokens, r.applied))
    return out


def _family_model(name, seed=0):
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.families import COMMON, FAMILIES

    cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra}))


def _family_batch():
    b = global_batch(0)
    g = torch.Generator().manual_seed(7)
    return {**b, "input_ids": torch.randint(0, 512, b["input_ids"].shape, generator=g)}


def _family_step(engine):
    r = optimizer_step(engine, [_family_batch()], grad_clip=GRAD_CLIP)
    return r.loss, r.grad_norm


def _tp2_ranks(rank, world_size, shards, out, target_dir, path_out):
    from treadle.train.run import run_training

    got = {}
    engine, mesh = _engine(_axes(tp=2))
    assert (mesh.dp_rank, mesh.dp_size, mesh.coordinate("tp")) == (0, 1, rank)
    got["steps"] = _train(engine, mesh)
    got["export"] = snapshot(engine.export_state_dict())
    tied = tiny_llama(0)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    engine, mesh = _engine(_axes(tp=2), model=tied)
    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight  # still one Parameter
    got["tied"] = _train(engine, mesh, range(2))
    got["families"] = {name: _family_step(_engine(_axes(tp=2), model=_family_model(name))[0]) for name in TP_FAMILIES}
    # A whole run at TP 2: loader, eval, checkpoints at steps 2 and 4 (DCP), export.
    run_training(load_config(None, args(shards, out, "--train.max_steps=4", "--train.threads=1",
                                        "--distributed.tensor_parallel=2", "--checkpoint.every=2")[1:]))
    # A model read from model.path (whole on every rank, then split) with activation checkpointing (the blocks'
    # gathers and reduce-scatters run again in backward).
    run_training(load_config(None, _path_args(shards, path_out, target_dir, "--train.threads=1",
                                              "--distributed.tensor_parallel=2")[1:]))
    return got


def _path_args(shards, out, target_dir, *extra):
    """A 2-step run of the saved target (its own architecture: no overrides), activation checkpointing on."""
    return [a for a in args(shards, out) if not a.startswith("--model.overrides")] + [
        "--train.max_steps=2", f"--model.path={target_dir}", "--model.activation_checkpointing=selective", *extra]


@pytest.fixture(scope="module")
def tp2(shards, target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "tp2"
    return run_distributed(_tp2_ranks, world_size=2, timeout=400, shards=shards, out=out, target_dir=target_dir,
                           path_out=out.parent / "path"), out


def _assert_steps(got, want, what):
    assert_steps_match(got, want, what, loss_rtol=RTOL, norm_rtol=RTOL)


def test_tensor_parallel_2_matches_one_process(tp2):
    results, _ = tp2
    engine, want = local_run()
    for rank, res in enumerate(results):  # both ranks of the TP pair report the step's loss and norm
        _assert_steps(res["steps"], want, f"tp2 rank {rank}")
    assert all(norm > GRAD_CLIP for _, norm, _, _ in want)  # the norm is compared before clipping
    assert max_abs_diff(results[0]["export"], snapshot(engine.model.state_dict())) <= WEIGHT_ATOL
    assert results[1]["export"] == {}  # only rank 0 gets the full weights

    tied = tiny_llama(0)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    ref = LocalEngine(tied, make_optimizer(tied), CPU)
    _assert_steps(results[0]["tied"], [(r.loss, r.grad_norm, r.label_tokens, r.applied) for r in
                                       (optimizer_step(ref, rank_micro_batches(s, 0, 1), grad_clip=GRAD_CLIP)
                                        for s in range(2))], "tied")
    for name in TP_FAMILIES:
        model = _family_model(name)
        loss, norm = _family_step(LocalEngine(model, make_optimizer(model), CPU))
        got_loss, got_norm = results[0]["families"][name]
        assert got_loss == pytest.approx(loss, rel=RTOL) and got_norm == pytest.approx(norm, rel=RTOL), name


def _assert_records(got_dir, want_dir, steps, keys=("loss", "grad_norm", "eval_loss")):
    for key in keys:  # eval_loss: at the start (step 0) and at the end
        a, b = records(want_dir, key), records(got_dir, key)
        assert sorted(b) == ([0, steps[-1]] if key == "eval_loss" else list(steps)), (key, b)
        assert all(math.isclose(b[s], a[s], rel_tol=RTOL) for s in b), (key, a, b)


def test_a_tensor_parallel_run_resumes_in_one_process(tp2, shards, tmp_path):
    _, two = tp2
    one = tmp_path / "one"
    assert main(args(shards, one, "--train.max_steps=4")) == 0
    _assert_records(two, one, [1, 2, 3, 4])
    from safetensors.torch import load_file  # the export gathers the shards into the one-process model's tensors

    assert max_abs_diff(load_file(two / "hf" / "model.safetensors"), load_file(one / "hf" / "model.safetensors")) \
        <= WEIGHT_ATOL
    resumed = tmp_path / "resumed"  # TP 2 -> TP 1: the step-2 checkpoint continues the one-process run
    assert main(args(shards, resumed, "--train.max_steps=4",
                     f"--checkpoint.resume={two / 'checkpoints' / 'step_2'}")) == 0
    _assert_records(resumed, one, [3, 4], keys=("loss", "grad_norm"))


def test_a_tensor_parallel_run_of_a_saved_model_with_activation_checkpointing_matches_one_process(
        tp2, shards, target_dir, tmp_path):
    _, two = tp2
    one = tmp_path / "one"
    assert main(_path_args(shards, one, target_dir)) == 0
    _assert_records(two.parent / "path", one, [1, 2])


def _four_ranks(rank, world_size, shards, out):
    from treadle.data.loader import slice_sequences
    from treadle.distributed import init_distributed
    from treadle.train.run import run_training

    got = {}
    engine, mesh = _engine(_axes(tp=2))  # FSDP 2 x TP 2
    assert (mesh.dp_rank, mesh.dp_size, mesh.coordinate("tp")) == (rank // 2, 2, rank % 2)
    got["fsdp_tp"] = _train(engine, mesh)
    got["fsdp_tp_export"] = snapshot(engine.export_state_dict())
    engine, mesh = _engine(_axes(rep=2))  # HSDP: replicate 2 x shard 2
    assert (mesh.dp_rank, mesh.dp_size) == (rank, 4) and mesh.fsdp_mesh.ndim == 2
    got["hsdp"] = _train(engine, mesh)
    got["hsdp_export"] = snapshot(engine.export_state_dict())
    # HSDP x context parallel: 2 replicas, each one context group of 2 ranks (FSDP2 shards over the group).
    from treadle.engine.context_parallel import apply_context_parallel

    model = tiny_llama(0)
    mesh = build_mesh(_axes(rep=2, cp=2), init_distributed("cpu"))
    layout = mesh.layout
    assert (layout.dp_rank, layout.dp_size, layout.cp_rank) == (rank // 2, 2, rank % 2)
    apply_context_parallel(model, layout.cp_group)
    engine, _ = _engine(_axes(rep=2, cp=2), model=model)
    got["hsdp_cp"] = [optimizer_step(engine, [slice_sequences(mb, layout.cp_rank, 2) for mb in
                                              rank_micro_batches(s, layout.dp_rank, 2)], grad_clip=GRAD_CLIP)
                      for s in range(STEPS)]
    got["hsdp_cp"] = [(r.loss, r.grad_norm, r.label_tokens, r.applied) for r in got["hsdp_cp"]]
    # Context parallel x tensor parallel: one data rank, its sequences split over 2 context ranks, each of whose
    # attention holds heads / 2 (TP) of which the context group's all-to-all splits again (heads / 4 per rank).
    model = tiny_llama(0)
    mesh = build_mesh(_axes(cp=2, tp=2), init_distributed("cpu"))
    layout = mesh.layout
    assert (layout.dp_size, layout.cp_rank, mesh.coordinate("tp")) == (1, rank // 2, rank % 2)
    apply_context_parallel(model, layout.cp_group)
    engine, _ = _engine(_axes(cp=2, tp=2), model=model)
    got["cp_tp"] = [optimizer_step(engine, [slice_sequences(mb, layout.cp_rank, 2) for mb in
                                            rank_micro_batches(s, 0, 1)], grad_clip=GRAD_CLIP) for s in range(STEPS)]
    got["cp_tp"] = [(r.loss, r.grad_norm, r.label_tokens, r.applied) for r in got["cp_tp"]]
    got["cp_tp_export"] = snapshot(engine.export_state_dict())
    # A whole run at FSDP 2 x TP 2 (checkpoints at steps 2 and 4); its step 2 resumed as FSDP 4 (GA 1: the same 16
    # rows a step).
    common = ("--train.threads=1", "--checkpoint.every=2", "--train.max_steps=4")
    run_training(load_config(None, args(shards, out / "fsdp_tp", *common, "--distributed.tensor_parallel=2")[1:]))
    run_training(load_config(None, args(shards, out / "fsdp4", *common, "--train.grad_accum_steps=1",
                                        f"--checkpoint.resume={out / 'fsdp_tp' / 'checkpoints' / 'step_2'}")[1:]))
    # A whole run at CP 2 x TP 2 (one data rank: GA 4, the same 16 rows a step), 2 steps.
    run_training(load_config(None, args(shards, out / "cp_tp", "--train.threads=1", "--train.max_steps=2",
                                        "--train.grad_accum_steps=4", "--distributed.tensor_parallel=2",
                                        "--distributed.context_parallel=2")[1:]))
    return got


def test_fsdp2_x_tp2_and_hsdp_match_one_process_and_resume_as_fsdp4(shards, tmp_path):
    out = tmp_path / "four"
    results = run_distributed(_four_ranks, world_size=4, timeout=500, shards=shards, out=out)
    engine, want = local_run()
    want_export = snapshot(engine.model.state_dict())
    for rank, res in enumerate(results):
        _assert_steps(res["hsdp_cp"], want, f"hsdp x cp rank {rank}")
    for kind in ("fsdp_tp", "hsdp", "cp_tp"):
        for rank, res in enumerate(results):
            _assert_steps(res[kind], want, f"{kind} rank {rank}")
        assert max_abs_diff(results[0][f"{kind}_export"], want_export) <= WEIGHT_ATOL
    one = tmp_path / "one"  # one process, the same 16 rows a step (GA 4)
    assert main(args(shards, one, "--train.max_steps=4", "--train.grad_accum_steps=4")) == 0
    _assert_records(out / "fsdp_tp", one, [1, 2, 3, 4])
    assert records(out / "fsdp_tp", "tokens") == records(one, "tokens")
    _assert_records(out / "fsdp4", one, [3, 4], keys=("loss", "grad_norm"))
    _assert_records(out / "cp_tp", one, [1, 2], keys=("loss", "grad_norm"))
