"""DeepSpeed ZeRO 0-3 at world size 2 (gloo, CPU) against one process on the whole batch.

One two-rank launch runs ZeRO stages 0, 1, 2 and 3 one after the other, then bf16 and
CPU-offload variants; a one-rank launch then resumes the two-rank checkpoints. The
reference, batches, model and tolerances are tests/test_engines_dist.py's (fp32: loss
1e-6 relative, grad norm 1e-5 relative, weights 1e-5 absolute). Per stage:

* 3 optimizer steps, GA=2 per rank on half the global batch, equal 3 steps of one
  process on the whole batch (the grad norm is the sharp check for "sum, not average,
  and no division by GA"; the reference clips, so DeepSpeed's clipping is covered);
* a step whose loss is NaN on rank 1 is skipped by the loop (``zero_grad`` without
  ``step``): weights unchanged, and the following step equals the reference's, which
  never saw that batch (no NaN gradient leaks into DeepSpeed's buffers or counters);
* DeepSpeed measures no second grad norm in ``step`` (the one ``clip_grad_norm`` took);
* a checkpoint taken after step 3 restores weights and optimizer: rolling the trained
  engine back, or loading it into a fresh engine from another seed, repeats the next
  step bit for bit; a LambdaLR over ``engine.optimizer`` steers DeepSpeed's update;
* a frozen embedding trains nowhere, is absent from the checkpoint files, has no
  optimizer state, and is exported whole (and partitioned under ZeRO-3);
* ``export_state_dict`` is the reference's weights on rank 0 and ``{}`` on rank 1;
* ``memory_report``: ZeRO-0 holds the whole model, ZeRO-3 at two ranks half of what the
  same bookkeeping gives for an unpartitioned copy (parameters, gradient buffer, fp32
  master and Adam moments: what ZeRO-3 holds at world size 1).

bf16 (stages 1-3) and CPU offload (stages 2, 3) run steps, a skip and export. At world
size 1, the ZeRO-0 checkpoint resumes as it is; the ZeRO-2 one is refused with a one-line
UserError naming the universal-checkpoint route, and resumes once converted along it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_engines_dist import (CPU, FROZEN, GA, GRAD_CLIP, ROWS, STEPS, WEIGHT_ATOL,
                                     assert_steps_match, global_batch, local_run, make_optimizer, max_abs_diff,
                                     rank_micro_batches, snapshot, tiny_llama, weights)
from treadle.engine.deepspeed import (META, TAG, UNIVERSAL_TAG, DeepSpeedEngine, check_resumable, deepspeed_config,
                                      universal_command)
from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError
from treadle.models.chunked_ce import use_chunked_loss
from treadle.train.resilience import _poisoned
from treadle.train.step import loss_sum, optimizer_step

STAGES = (0, 1, 2, 3)
SKIP, NEXT = STEPS, STEPS + 1  # batch 3 goes NaN on rank 1 (skipped); batch 4 is the next applied step
# ZeRO-3 keeps every parameter under 1e5 elements gathered by default, i.e. all of the tiny model's.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
VARIANTS = {  # name: (stage, bf16, offload); each runs steps 0, 1, a skipped 2, then 3
    "bf16_zero1": (1, True, False),  # DeepSpeed's BF16_Optimizer
    "bf16_zero2": (2, True, False),  # the ZeRO optimizer in bf16 (its own overflow switch)
    "bf16_zero3": (3, True, False),
    "offload_zero2": (2, False, True),
    "offload_zero3": (3, False, True),
}


# ---------------------------------------------------------------- on each rank

def _build(stage: int, seed: int = 0, freeze_embedding: bool = False, bf16: bool = False, offload: bool = False,
           user_config: dict | None = None, chunk_tokens: int = 0, checkpointing: str = "none") -> DeepSpeedEngine:
    from treadle.config import ModelConfig
    from treadle.models.checkpointing import apply_activation_checkpointing

    model = tiny_llama(seed, freeze_embedding)
    if chunk_tokens:  # model.loss_chunk_tokens: ZeRO-3 gathers the head's weight only inside the head's forward
        use_chunked_loss(model, chunk_tokens, IGNORE_INDEX)
    apply_activation_checkpointing(model, ModelConfig(activation_checkpointing=checkpointing))  # before initialize
    return DeepSpeedEngine(model, make_optimizer(model), CPU, zero_stage=stage, grad_accum_steps=GA,
                           micro_batch_size=ROWS // torch.distributed.get_world_size() // GA, grad_clip=GRAD_CLIP,
                           bf16=bf16, offload=offload, user_config=user_config or (PARTITION_ALL if stage == 3 else None))


def _steps(engine, steps, rank, world_size, skip=()) -> list[tuple[float, float, int, bool]]:
    out = []
    for s in steps:
        loss_fn = _poisoned(loss_sum) if s in skip and rank == 1 else loss_sum
        r = optimizer_step(engine, rank_micro_batches(s, rank, world_size), grad_clip=GRAD_CLIP, loss_fn=loss_fn)
        out.append((r.loss, r.grad_norm, r.label_tokens, r.applied))
    return out


def _norm_measurements(engine):
    """A counter of DeepSpeed's own grad-norm computations (the class methods; treadle's reuse shadows them)."""
    from unittest import mock

    import deepspeed.runtime.engine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if engine.zero_stage == 0:  # DeepSpeed's fp32 clipping measures the norm again unless treadle's value is reused
        return mock.patch.object(deepspeed.runtime.engine, "clip_grad_norm_", wraps=deepspeed.runtime.engine.clip_grad_norm_)
    cls, name = ((DeepSpeedZeroOptimizer_Stage3, "_get_norm_groups") if engine.zero_stage == 3
                 else (DeepSpeedZeroOptimizer, "scaled_global_norm"))
    return mock.patch.object(cls, name, autospec=True, side_effect=getattr(cls, name))


def _checkpoint_keys(directory) -> set[str]:
    """Every string key anywhere in DeepSpeed's files of a checkpoint (parameter names among them)."""
    keys: set[str] = set()

    def walk(obj):
        if isinstance(obj, dict):
            keys.update(k for k in obj if isinstance(k, str))
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for f in sorted((directory / TAG).glob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False))  # our own files: DeepSpeed pickles its config
    return keys


def _check_stage(stage: int, rank: int, world_size: int, tmp: str) -> dict:
    out: dict = {}
    engine = _build(stage)
    assert (engine.rank, engine.world_size, engine.zero_stage) == (rank, world_size, stage)
    out["steps"] = _steps(engine, range(STEPS), rank, world_size)
    out["export3"] = snapshot(engine.export_state_dict())
    ckpt = Path(tmp) / f"zero{stage}"
    engine.save_checkpoint(ckpt)

    out["skipped"] = _steps(engine, [SKIP], rank, world_size, skip=[SKIP])
    out["after_skip"] = snapshot(engine.export_state_dict())
    with _norm_measurements(engine) as measured:
        out["next"] = _steps(engine, [NEXT], rank, world_size)
    out["ds_norms"] = measured.call_count
    out["export_next"] = snapshot(engine.export_state_dict())
    out["memory"] = engine.memory_report()

    # Rollback in place (what the trainer does after repeated non-finite steps), then a fresh engine.
    engine.load_checkpoint(ckpt)
    out["next_rollback"] = _steps(engine, [NEXT], rank, world_size)
    out["export_rollback"] = snapshot(engine.export_state_dict())
    fresh = _build(stage, seed=123)
    fresh.load_checkpoint(ckpt)
    out["next_resumed"] = _steps(fresh, [NEXT], rank, world_size)
    out["export_resumed"] = snapshot(fresh.export_state_dict())
    # The loop's LambdaLR writes engine.optimizer's param groups: at lr 0 DeepSpeed's step changes nothing.
    torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda _: 0.0)
    out["lr0_applied"] = _steps(fresh, [NEXT + 1], rank, world_size)[0][3]
    out["export_lr0"] = snapshot(fresh.export_state_dict())

    if stage == 3:
        out["chunked_steps"] = _steps(_build(stage, chunk_tokens=5), range(2), rank, world_size)

    frozen = _build(stage, freeze_embedding=True)
    out["frozen_steps"] = _steps(frozen, range(2), rank, world_size)
    out["frozen_export"] = snapshot(frozen.export_state_dict())
    # Adam moments this rank holds (ZeRO: a flat partition of the trainable parameters only).
    out["frozen_moment_numel"] = sum(s["exp_avg"].numel() for s in frozen.optimizer.state.values())
    embedding = frozen.module.model.embed_tokens.weight
    out["frozen_partition_numel"] = embedding.ds_tensor.numel() if stage == 3 else embedding.numel()
    frozen.save_checkpoint(Path(tmp) / f"zero{stage}_frozen")
    if rank == 0:
        out["frozen_ckpt_keys"] = _checkpoint_keys(Path(tmp) / f"zero{stage}_frozen")
    return out


def _check_variant(stage: int, bf16: bool, offload: bool, rank: int, world_size: int, tmp: str, name: str) -> dict:
    engine = _build(stage, bf16=bf16, offload=offload)
    out = {"steps": _steps(engine, [0, 1], rank, world_size)}
    before = snapshot(engine.export_state_dict())
    out["skipped"] = _steps(engine, [2], rank, world_size, skip=[2])
    after = snapshot(engine.export_state_dict())  # every rank: a collective
    out["skip_changed"] = max_abs_diff(after, before) if rank == 0 else 0.0
    out["steps"] += _steps(engine, [3], rank, world_size)
    out["export"] = snapshot(engine.export_state_dict())
    if bf16 and stage < 3 and rank == 0:  # ZeRO-1/2: the whole module on every rank, in bf16
        out["module"] = snapshot(engine.module.state_dict())
    engine.save_checkpoint(Path(tmp) / name)  # what a bf16 / offload checkpoint pickles (the allow-list test)
    return out


def check_deepspeed(rank: int, world_size: int, tmp: str) -> dict:
    out = {f"zero{stage}": _check_stage(stage, rank, world_size, tmp) for stage in STAGES}
    out.update({name: _check_variant(*spec, rank, world_size, tmp, name) for name, spec in VARIANTS.items()})
    # ZeRO-3 with full activation checkpointing: the recomputed layers gather their partitioned parameters again.
    checkpointed = _build(3, checkpointing="full")
    calls = []  # each layer's MLP activation runs in forward and again in backward
    for layer in checkpointed.module.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda *_: calls.append(1))
    out["zero3_checkpointing"] = {"steps": _steps(checkpointed, range(2), rank, world_size), "act_calls": len(calls)}
    return out


def resume_on_one_rank(rank: int, world_size: int, tmp: str) -> dict:
    """The two-rank checkpoints at world size 1: ZeRO-0 (one whole optimizer state) loads; ZeRO-2 is refused as it
    is, and resumes once converted to DeepSpeed's universal format (in the test process, as the refusal says)."""
    engine = _build(0, seed=7)
    engine.load_checkpoint(Path(tmp) / "zero0")
    out = {"next": _steps(engine, [NEXT], rank, world_size)}
    try:
        _build(2, seed=7).load_checkpoint(Path(tmp) / "zero2")
    except UserError as exc:
        out["refused"] = str(exc)
    engine = _build(2, seed=7, user_config={"checkpoint": {"load_universal": True}})
    engine.load_checkpoint(Path(tmp) / "zero2")
    out["next_universal"] = _steps(engine, [NEXT], rank, world_size)
    return out


# ---------------------------------------------------------------- in the test process

def _apply(engine, step: int):
    r = optimizer_step(engine, [global_batch(step)], grad_clip=GRAD_CLIP)
    return r.loss, r.grad_norm, r.label_tokens, r.applied


@pytest.fixture(scope="module")
def reference() -> dict:
    engine, steps = local_run()
    ref = {"steps": steps, "weights3": weights(engine.model)}
    ref["next"] = [_apply(engine, NEXT)]  # the skipped batch never reaches one process
    ref["weights_next"] = weights(engine.model)
    frozen, ref["frozen_steps"] = local_run(freeze_embedding=True, steps=2)
    ref["frozen_weights"] = weights(frozen.model)
    ref["trainable_numel"] = sum(p.numel() for p in frozen.model.parameters() if p.requires_grad)
    variant, ref["variant_steps"] = local_run(steps=2)
    ref["variant_steps"] = ref["variant_steps"] + [_apply(variant, 3)]
    ref["variant_weights"] = weights(variant.model)
    return ref


@pytest.fixture(scope="module")
def launched_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepspeed_dist")


@pytest.fixture(scope="module")
def launched(launched_dir) -> tuple[list[dict], dict]:
    tmp = str(launched_dir)
    results = run_distributed(check_deepspeed, world_size=2, timeout=300, tmp=tmp)  # 120 s: too short when loaded
    command = universal_command(Path(tmp) / "zero2").split()
    subprocess.run([sys.executable, *command[1:]], check=True, capture_output=True, timeout=120)
    one_rank = run_distributed(resume_on_one_rank, world_size=1, timeout=120, tmp=tmp)[0]
    return results, one_rank


def test_zero3_with_activation_checkpointing_matches_one_process(launched, reference):
    results, _ = launched
    for rank, res in enumerate(results):
        assert_steps_match(res["zero3_checkpointing"]["steps"], reference["steps"][:2], f"zero3 checkpointing rank {rank}")
        assert res["zero3_checkpointing"]["act_calls"] == 2 * 2 * GA * len(tiny_llama().model.layers)  # 2 steps, twice


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_with_accumulation_match_one_process_and_skips_leave_no_trace(launched, reference, stage):
    results, _ = launched
    kind = f"zero{stage}"
    for rank, res in enumerate(results):  # loss and norm come out of collectives: equal on every rank
        r = res[kind]
        assert_steps_match(r["steps"], reference["steps"], f"{kind} rank {rank}")
        (loss, norm, _, applied), = r["skipped"]
        assert not applied and math.isnan(loss) and not math.isfinite(norm)
        assert_steps_match(r["next"], reference["next"], f"{kind} rank {rank} after the skip")
    ours = results[0][kind]
    assert max_abs_diff(ours["export3"], reference["weights3"]) <= WEIGHT_ATOL
    assert max_abs_diff(ours["after_skip"], ours["export3"]) == 0.0
    assert max_abs_diff(ours["export_next"], reference["weights_next"]) <= WEIGHT_ATOL
    assert all(v.dtype == torch.float32 and v.device == CPU for v in ours["export3"].values())
    assert results[1][kind]["export3"] == {}  # only rank 0 gets the full weights
    assert all(norm > GRAD_CLIP for _, norm, _, _ in reference["steps"])  # the reference clips
    # One norm per step: clip_grad_norm's (ZeRO 1-3); fp32 ZeRO-0 clips with it and never measures again.
    assert ours["ds_norms"] == (0 if stage == 0 else 1)


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_round_trip_rollback_and_lr_schedule(launched, stage):
    results, _ = launched
    kind = f"zero{stage}"
    for res in results:
        r = res[kind]
        assert r["next_rollback"] == r["next"] and r["next_resumed"] == r["next"]  # bit-identical continuation
        assert r["lr0_applied"]
    ours = results[0][kind]
    assert max_abs_diff(ours["export_rollback"], ours["export_next"]) == 0.0
    assert max_abs_diff(ours["export_resumed"], ours["export_next"]) == 0.0
    assert max_abs_diff(ours["export_lr0"], ours["export_resumed"]) == 0.0


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_parameters_train_nowhere_and_stay_out_of_checkpoints(launched, reference, stage):
    results, _ = launched
    kind = f"zero{stage}"
    for rank, res in enumerate(results):
        assert_steps_match(res[kind]["frozen_steps"], reference["frozen_steps"], f"{kind} frozen rank {rank}")
    keys = results[0][kind]["frozen_ckpt_keys"]
    assert FROZEN not in keys and "lm_head.weight" in keys
    moments = [res[kind]["frozen_moment_numel"] for res in results]
    if stage == 0:
        assert moments == [reference["trainable_numel"]] * 2
    else:  # one partition each, padded to an alignment of a few elements
        assert 0 <= sum(moments) - reference["trainable_numel"] < 64
    embedding = tiny_llama(0).model.embed_tokens.weight.detach()
    partitions = [res[kind]["frozen_partition_numel"] for res in results]
    assert partitions == [embedding.numel() // 2 if stage == 3 else embedding.numel()] * 2
    export = results[0][kind]["frozen_export"]
    assert max_abs_diff(export, reference["frozen_weights"]) <= WEIGHT_ATOL
    assert torch.equal(export[FROZEN], embedding)


def test_chunked_cross_entropy_under_zero3_matches_the_plain_head_in_one_process(launched, reference):
    results, _ = launched
    for rank, res in enumerate(results):
        assert_steps_match(res["zero3"]["chunked_steps"], reference["steps"][:2], f"zero3 chunked rank {rank}")


def test_memory_report_zero3_holds_half_of_an_unpartitioned_copy(launched):
    results, _ = launched
    model = tiny_llama(0)
    full = sum(p.numel() * 4 for p in model.parameters())  # fp32, every parameter trainable here
    zero0 = results[0]["zero0"]["memory"]
    # After a step: fp32 ZeRO-0's masters are the parameters, and its gradients are freed.
    assert zero0 == {"params": full, "grads": 0, "optim": 2 * full}
    unpartitioned = full + full + 3 * full  # params, gradient buffer, fp32 master + two Adam moments
    for res in results:
        zero3 = res["zero3"]["memory"]
        assert zero3["params"] == pytest.approx(full / 2, rel=0.02)
        assert zero3["grads"] == pytest.approx(full / 2, rel=0.02)
        assert zero3["optim"] == pytest.approx(3 * full / 2, rel=0.02)
        assert sum(zero3.values()) / unpartitioned == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_and_offload_variants(launched, reference, name):
    results, _ = launched
    _, bf16, _ = VARIANTS[name]
    for rank, res in enumerate(results):
        r = res[name]
        (loss, _, _, applied), = r["skipped"]
        assert not applied and math.isnan(loss)
        if bf16:
            for (loss, norm, tokens, applied), (rloss, rnorm, rtokens, _) in zip(r["steps"], reference["variant_steps"]):
                assert applied and tokens == rtokens
                assert loss == pytest.approx(rloss, rel=2e-2) and loss != rloss  # bf16 really computed
                assert norm == pytest.approx(rnorm, rel=5e-2)
        else:
            assert_steps_match(r["steps"], reference["variant_steps"], f"{name} rank {rank}")
    ours = results[0][name]
    assert ours["skip_changed"] == 0.0
    export = ours["export"]
    assert all(v.dtype == torch.float32 for v in export.values())
    if not bf16:
        assert max_abs_diff(export, reference["variant_weights"]) <= WEIGHT_ATOL
    else:
        # bf16 gradients flip the sign of a few tiny Adam updates (lr 1e-2): close on average, within 3 steps at most.
        diffs = torch.cat([(export[k] - w).abs().flatten() for k, w in reference["variant_weights"].items()])
        assert diffs.mean() < 2e-3 and diffs.max() < 6e-2
        # The fp32 masters, not the bf16 copies the module computes with: values bf16 cannot hold.
        assert any(not torch.equal(v, v.bfloat16().float()) for v in export.values())
    if "module" in ours:  # ZeRO-1/2: the module's bf16 weights are exactly those masters, rounded
        assert all(torch.equal(export[k].bfloat16(), w) for k, w in ours["module"].items())
    assert results[1][name]["export"] == {}


def test_world_size_1_loads_zero0_refuses_zero2_and_resumes_it_converted_to_universal(launched, reference):
    _, one_rank = launched
    assert_steps_match(one_rank["next"], reference["next"], "ZeRO-0 resumed on one rank")
    message = one_rank["refused"]
    assert "\n" not in message
    assert "world size 2" in message and "world size 1" in message
    assert universal_command(message.split("checkpoint ", 1)[1].split(" holds")[0]) in message
    assert '{"checkpoint": {"load_universal": true}}' in message
    assert_steps_match(one_rank["next_universal"], reference["next"], "ZeRO-2 converted to universal, on one rank")


def test_the_pickle_allow_list_is_exactly_what_deepspeed_writes(launched, launched_dir):
    """Every file of every checkpoint above (ZeRO 0-3, frozen, bf16, offload, two ranks, and ZeRO-2 converted to the
    universal format) passes the vetting, and together they use every global of the allow-list but its spare
    storage types: the list is DeepSpeed 0.19.8's, no wider. A DeepSpeed upgrade that pickles more shows up here."""
    from treadle.checkpoint import safety

    seen: set[str] = set()

    class Listing(safety._VettingUnpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    checkpoints = sorted(p for p in launched_dir.iterdir() if (p / META).is_file())
    assert len(checkpoints) == len(STAGES) * 2 + len(VARIANTS)
    assert (launched_dir / "zero2" / UNIVERSAL_TAG / "zero").is_dir()
    original = safety._VettingUnpickler
    safety._VettingUnpickler = Listing
    try:
        for ckpt in checkpoints:
            safety.vet_deepspeed(ckpt, ckpt)
    finally:
        safety._VettingUnpickler = original
    spare_storages = {g for g in safety._DEEPSPEED_GLOBALS if g.endswith("Storage")} - {"torch.FloatStorage",
                                                                                     "torch.BFloat16Storage"}
    assert seen == safety._DEEPSPEED_GLOBALS - spare_storages


# ---------------------------------------------------------------- no process group

def test_deepspeed_config_batch_arithmetic_clipping_and_merge():
    cfg = deepspeed_config(zero_stage=2, micro_batch_size=4, grad_accum_steps=8, world_size=3, grad_clip=0.0, bf16=False)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (4, 8, 96)
    assert cfg["gradient_clipping"] == 0.0  # written even when off: DeepSpeed's default would clip at 1.0
    assert cfg["zero_optimization"] == {"stage": 2} and cfg["bf16"] == {"enabled": False} and "data_types" not in cfg
    assert cfg["zero_allow_untested_optimizer"] and not cfg["wall_clock_breakdown"]

    cfg = deepspeed_config(zero_stage=3, micro_batch_size=1, grad_accum_steps=1, world_size=2, grad_clip=1.0, bf16=True,
                           offload=True, user_config={"zero_optimization": {"reduce_bucket_size": 1000},
                                                      "gradient_clipping": 0.5, "extra": [1]})
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"}, "reduce_bucket_size": 1000}
    assert cfg["gradient_clipping"] == 0.5 and cfg["extra"] == [1]  # the user's keys win, nested ones merged
    assert cfg["bf16"] == {"enabled": True} and cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "offload_param" not in deepspeed_config(zero_stage=2, micro_batch_size=1, grad_accum_steps=1, world_size=1,
                                                   grad_clip=1.0, bf16=False, offload=True)["zero_optimization"]
    for bf16, offload in ((False, True), (True, False)):
        with pytest.raises(UserError, match="zero_stage 1-3"):
            deepspeed_config(zero_stage=0, micro_batch_size=1, grad_accum_steps=1, world_size=1, grad_clip=1.0,
                             bf16=bf16, offload=offload)


def test_check_resumable(tmp_path):
    (tmp_path / META).write_text(json.dumps({"world_size": 4, "zero_stage": 3, "bf16": False, "partitioned": True}))
    check_resumable(tmp_path, 4, 3)
    with pytest.raises(UserError, match="ZeRO-3 state partitioned over world size 4, but this run has world size 8"):
        check_resumable(tmp_path, 8, 3)
    with pytest.raises(UserError, match="and ZeRO-2"):
        check_resumable(tmp_path, 4, 2)
    (tmp_path / META).write_text(json.dumps({"world_size": 4, "zero_stage": 0, "bf16": False, "partitioned": False}))
    check_resumable(tmp_path, 1, 0)  # one whole optimizer state: any world size
    with pytest.raises(UserError, match="not a treadle DeepSpeed checkpoint"):
        check_resumable(tmp_path / "missing", 1, 0)


def test_module_loading_is_strict_for_trainable_parameters_only():
    from treadle.engine.deepspeed import _load_trainable

    model = tiny_llama(0, freeze_embedding=True)
    frozen = model.model.embed_tokens.weight.detach().clone()
    saved = {k: v + 1 for k, v in tiny_llama(0).state_dict().items()}  # a full model's checkpoint, frozen key too
    _load_trainable(saved, model)
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, frozen)  # an input, not a result: never overwritten
    del saved["lm_head.weight"]
    with pytest.raises(UserError, match=r"missing trainable \['lm_head.weight'\]"):
        _load_trainable(saved, model)
