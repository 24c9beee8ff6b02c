"""DDP and FSDP2 at world size 2 (gloo, CPU) against one process on the whole batch.

One launch (two ranks) runs both engines one after the other and returns what the
tests below compare with a single-process ``LocalEngine`` reference computed here:
3 optimizer steps with GA=2 per rank (each rank its half of the global batch, micro-
batches with different numbers of valid label tokens) must equal 3 steps with GA=1 on
the whole batch. A launch costs several seconds, so it checks everything at once:
losses, grad norms, weights, state_dict keys, a DCP round trip at world size 2, the
collectives, frozen parameters, export, and loading the 2-rank checkpoint in 1 process.

Tolerances (fp32): loss 1e-6 relative, grad norm 1e-5 relative, weights 1e-5 absolute.
The grad norm is the sharp check for "sum, do not average, across ranks": AdamW's
update hardly changes when every gradient is halved, the norm does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

from tests.distributed import DistributedTestError, run_distributed
from treadle.data.packed import IGNORE_INDEX
from treadle.engine.local import LocalEngine
from treadle.engine.optim import param_groups
from treadle.models.chunked_ce import use_chunked_loss
from treadle.train.step import optimizer_step

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, use_cache=False)
ROWS, SEQ, GA, STEPS = 8, 16, 2, 3  # global batch 8 x 16; per rank GA=2 micro-batches of 2 rows
GRAD_CLIP = 1.0
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-6, 1e-5, 1e-5
CPU = torch.device("cpu")
FROZEN = "model.embed_tokens.weight"
ENGINES = ("ddp", "fsdp2")


def tiny_llama(seed: int = 0, freeze_embedding: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    if freeze_embedding:
        model.model.embed_tokens.requires_grad_(False)
    return model


def make_optimizer(model):
    # Two parameter groups (decayed / not), as the real optimizer has: group layout must survive checkpoints too.
    return torch.optim.AdamW(param_groups(model, 0.1, False, False), lr=1e-2)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Packed rows: two documents per row (positions restart), the cross-document label and a prefix masked."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, LLAMA["vocab_size"], (ROWS, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    pos = torch.empty(ROWS, SEQ, dtype=torch.long)
    for i in range(ROWS):
        boundary = 3 + (i + step) % 10  # the second document starts here
        pos[i, :boundary] = torch.arange(boundary)
        pos[i, boundary:] = torch.arange(SEQ - boundary)
        labels[i, boundary - 1] = IGNORE_INDEX  # never predict the next document
        labels[i, : (3 * i + step) % SEQ] = IGNORE_INDEX  # very different valid counts per micro-batch
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": pos}


def rank_micro_batches(step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """Rank r's contiguous slice of the global batch, split into GA micro-batches."""
    per_rank = ROWS // world_size
    mb = per_rank // GA
    lo = rank * per_rank
    batch = global_batch(step)
    return [{k: v[lo + m * mb: lo + (m + 1) * mb] for k, v in batch.items()} for m in range(GA)]


def weights(model) -> dict[str, torch.Tensor]:
    return snapshot(model.state_dict())


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Exports (like LocalEngine's) may alias the live parameters: copy before training on.
    return {k: v.detach().clone() for k, v in state.items()}


# ---------------------------------------------------------------- on each rank

def _build(kind: str, seed: int, freeze_embedding: bool = False, chunk_tokens: int = 0, checkpointing: str = "none",
           **fsdp_kwargs):
    from treadle.config import ModelConfig
    from treadle.engine.ddp import DDPEngine
    from treadle.engine.fsdp2 import FSDP2Engine
    from treadle.models.checkpointing import apply_activation_checkpointing

    model = tiny_llama(seed, freeze_embedding)
    if chunk_tokens:  # model.loss_chunk_tokens: the head is replaced before the engine wraps the model
        use_chunked_loss(model, chunk_tokens, IGNORE_INDEX)
    apply_activation_checkpointing(model, ModelConfig(activation_checkpointing=checkpointing))  # before the wrap
    if kind == "ddp":
        return DDPEngine(model, make_optimizer(model), CPU)
    return FSDP2Engine(model, make_optimizer, CPU, **fsdp_kwargs)


def _steps(engine, steps, rank, world_size) -> list[tuple[float, float, int, bool]]:
    out = []
    for s in steps:
        r = optimizer_step(engine, rank_micro_batches(s, rank, world_size), grad_clip=GRAD_CLIP)
        out.append((r.loss, r.grad_norm, r.label_tokens, r.applied))
    return out


def _check_engine(kind: str, rank: int, world_size: int, ckpt_dir: str) -> dict:
    out: dict = {}
    engine = _build(kind, seed=0)
    assert engine.rank == rank and engine.world_size == world_size
    out["steps"] = _steps(engine, range(STEPS), rank, world_size)

    state = engine.state_dict()
    out["model_keys"] = sorted(state["model"])
    out["optim_keys"] = sorted(state["optim"]["state"])
    out["optim_groups"] = [sorted(g["params"]) for g in state["optim"]["param_groups"]]
    dcp.save(state, checkpoint_id=ckpt_dir)
    out["export3"] = snapshot(engine.export_state_dict())

    # Continue one step; then the same step from a fresh engine (other seed) loaded from the checkpoint.
    out["step4"] = _steps(engine, [STEPS], rank, world_size)
    out["export4"] = snapshot(engine.export_state_dict())
    fresh = _build(kind, seed=123)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(state)
    out["step4_resumed"] = _steps(fresh, [STEPS], rank, world_size)
    out["export4_resumed"] = snapshot(fresh.export_state_dict())
    if kind == "ddp":  # every replica, not only rank 0's, holds the same weights
        out["replica4"] = weights(engine.module)

    out["agree"] = (engine.all_agree(rank != 1), engine.all_agree(True))
    out["any"] = (engine.any_rank(rank == 0), engine.any_rank(False))
    out["sum"] = engine.all_reduce_sum(torch.tensor([rank + 1.0], dtype=torch.float64)).tolist()

    # Frozen embedding: trains, is sharded / replicated like the rest, never checkpointed.
    frozen = _build(kind, seed=0, freeze_embedding=True)
    out["frozen_steps"] = _steps(frozen, range(2), rank, world_size)
    state = frozen.state_dict()
    out["frozen_model_keys"] = sorted(state["model"])
    out["frozen_optim_keys"] = sorted(state["optim"]["state"])
    out["frozen_export"] = snapshot(frozen.export_state_dict())

    # Chunked cross-entropy: the head's weight is gathered (FSDP2) / synced (DDP) inside the model's forward.
    chunked = _build(kind, seed=0, chunk_tokens=5)
    out["chunked_steps"] = _steps(chunked, range(2), rank, world_size)

    if kind == "fsdp2":
        # CPU offload changes where shards live, not the math; bf16 compute stays close to fp32.
        offload = _build(kind, seed=0, cpu_offload=True)
        out["offload_steps"] = _steps(offload, range(2), rank, world_size)
        bf16 = _build(kind, seed=0, mp_param_dtype=torch.bfloat16, reshard_after_forward=False)
        out["bf16_steps"] = _steps(bf16, range(2), rank, world_size)
        # Activation checkpointing under FSDP2: layers recomputed in backward (their parameters gathered again by
        # FSDP's pre-backward hook, outside the checkpoint), same numbers.
        checkpointed = _build(kind, seed=0, checkpointing="selective")
        calls = []  # the MLP activation of every layer runs in forward and again in backward
        for layer in checkpointed.module.model.layers:
            layer.mlp.act_fn.register_forward_hook(lambda *_: calls.append(1))
        out["checkpointing_steps"] = _steps(checkpointed, range(2), rank, world_size)
        out["checkpointing_act_calls"] = len(calls)
        out["checkpointing_keys"] = sorted(checkpointed.state_dict()["model"])
    return out


def check_engines(rank: int, world_size: int, tmp: str) -> dict:
    return {kind: _check_engine(kind, rank, world_size, f"{tmp}/{kind}") for kind in ENGINES}


# ---------------------------------------------------------------- in the test process

def local_run(freeze_embedding: bool = False, steps: int = STEPS, seed: int = 0) -> tuple[LocalEngine, list]:
    model = tiny_llama(seed, freeze_embedding)
    engine = LocalEngine(model, make_optimizer(model), CPU)
    results = []
    for s in range(steps):
        r = optimizer_step(engine, [global_batch(s)], grad_clip=GRAD_CLIP)
        results.append((r.loss, r.grad_norm, r.label_tokens, r.applied))
    return engine, results


@pytest.fixture(scope="module")
def reference() -> dict:
    engine, steps = local_run()
    ref = {"steps": steps, "weights3": weights(engine.model)}
    state = engine.state_dict()
    ref["model_keys"] = sorted(state["model"])
    ref["optim_keys"] = sorted(state["optim"]["state"])
    ref["optim_groups"] = [sorted(g["params"]) for g in state["optim"]["param_groups"]]
    r = optimizer_step(engine, [global_batch(STEPS)], grad_clip=GRAD_CLIP)
    ref["step4"] = [(r.loss, r.grad_norm, r.label_tokens, r.applied)]
    ref["weights4"] = weights(engine.model)
    frozen, ref["frozen_steps"] = local_run(freeze_embedding=True, steps=2)
    ref["frozen_weights"] = weights(frozen.model)
    ref["frozen_model_keys"] = sorted(frozen.state_dict()["model"])
    return ref


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], str]:
    tmp = str(tmp_path_factory.mktemp("engines_dist"))
    return run_distributed(check_engines, world_size=2, timeout=300, tmp=tmp), tmp


def assert_steps_match(got, want, what, loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL):
    assert len(got) == len(want)
    for i, ((loss, norm, tokens, applied), (rloss, rnorm, rtokens, rapplied)) in enumerate(zip(got, want)):
        assert tokens == rtokens and applied and rapplied, f"{what} step {i}"
        assert loss == pytest.approx(rloss, rel=loss_rtol), f"{what} step {i} loss"
        assert norm == pytest.approx(rnorm, rel=norm_rtol), f"{what} step {i} grad norm"


def max_abs_diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


@pytest.mark.parametrize("kind", ENGINES)
def test_two_ranks_with_accumulation_match_one_process(launched, reference, kind):
    results, _ = launched
    for rank, res in enumerate(results):  # loss and norm come out of collectives: equal on every rank
        assert_steps_match(res[kind]["steps"], reference["steps"], f"{kind} rank {rank}")
        assert_steps_match(res[kind]["step4"], reference["step4"], f"{kind} rank {rank}")
    ours = results[0][kind]
    assert max_abs_diff(ours["export3"], reference["weights3"]) <= WEIGHT_ATOL
    assert max_abs_diff(ours["export4"], reference["weights4"]) <= WEIGHT_ATOL
    assert results[1][kind]["export3"] == {}  # only rank 0 gets the full weights
    if kind == "ddp":
        assert max_abs_diff(results[1][kind]["replica4"], ours["export4"]) == 0.0
    # The reference clips: the check covers the global norm of sharded/replicated grads, not only the unclipped path.
    assert all(norm > GRAD_CLIP for _, norm, _, _ in reference["steps"])


@pytest.mark.parametrize("kind", ENGINES)
def test_state_dict_keys_and_world_size_2_checkpoint_round_trip(launched, reference, kind):
    results, _ = launched
    for res in results:
        r = res[kind]
        assert r["model_keys"] == reference["model_keys"]  # no "module." prefix, no FSDP renaming
        assert r["optim_keys"] == reference["optim_keys"]
        assert r["optim_groups"] == reference["optim_groups"]
        assert r["step4_resumed"] == r["step4"]  # bit-identical continuation
    ours = results[0][kind]
    assert max_abs_diff(ours["export4_resumed"], ours["export4"]) == 0.0


@pytest.mark.parametrize("kind", ENGINES)
def test_collectives(launched, kind):
    results, _ = launched
    for res in results:
        assert res[kind]["agree"] == (False, True)
        assert res[kind]["any"] == (True, False)
        assert res[kind]["sum"] == [3.0]


@pytest.mark.parametrize("kind", ENGINES)
def test_frozen_parameters_train_and_stay_out_of_checkpoints(launched, reference, kind):
    results, _ = launched
    for rank, res in enumerate(results):
        r = res[kind]
        assert_steps_match(r["frozen_steps"], reference["frozen_steps"], f"{kind} frozen rank {rank}")
        assert FROZEN not in r["frozen_model_keys"] and FROZEN not in r["frozen_optim_keys"]
        assert r["frozen_model_keys"] == reference["frozen_model_keys"]
        assert sorted(r["frozen_optim_keys"]) == sorted(k for k in reference["optim_keys"] if k != FROZEN)
    export = results[0][kind]["frozen_export"]
    assert FROZEN in export  # export is the whole model, frozen weights included
    assert max_abs_diff(export, reference["frozen_weights"]) <= WEIGHT_ATOL
    assert torch.equal(export[FROZEN], tiny_llama(0).model.embed_tokens.weight.detach())


def test_fsdp2_cpu_offload_and_bf16_compute(launched, reference):
    results, _ = launched
    for rank, res in enumerate(results):
        r = res["fsdp2"]
        assert_steps_match(r["offload_steps"], reference["steps"][:2], f"offload rank {rank}")
        for (loss, norm, _, applied), (rloss, *_rest) in zip(r["bf16_steps"], reference["steps"]):
            assert applied and math.isfinite(norm)
            assert loss == pytest.approx(rloss, rel=2e-2)
            assert loss != rloss  # bf16 really computed (fp32 would agree to ~1e-7 or exactly)


@pytest.mark.parametrize("kind", ENGINES)
def test_chunked_cross_entropy_at_two_ranks_matches_the_plain_head_in_one_process(launched, reference, kind):
    results, _ = launched
    for rank, res in enumerate(results):
        assert_steps_match(res[kind]["chunked_steps"], reference["steps"][:2], f"{kind} chunked rank {rank}")


def test_fsdp2_with_activation_checkpointing_matches_one_process(launched, reference):
    results, _ = launched
    for rank, res in enumerate(results):
        assert_steps_match(res["fsdp2"]["checkpointing_steps"], reference["steps"][:2], f"checkpointing rank {rank}")
        assert res["fsdp2"]["checkpointing_keys"] == reference["model_keys"]
        assert res["fsdp2"]["checkpointing_act_calls"] == 2 * 2 * GA * LLAMA["num_hidden_layers"]  # 2 steps, twice


def test_init_distributed_without_torchrun_env_is_one_process(monkeypatch):
    from treadle import distributed
    from treadle.errors import UserError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.init_distributed("cpu")
    assert (info.rank, info.world_size, info.device, info.backend, info.distributed) == (0, 1, CPU, None, False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(UserError, match="train.device"):
        distributed.choose_device("tpu:x")


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # this test's own dcp.load, on purpose without a group
def test_world_size_2_checkpoint_loads_in_one_process(launched, reference, kind):
    _, tmp = launched
    engine, _ = local_run(steps=0, seed=7)
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=f"{tmp}/{kind}")  # no process group here
    engine.load_state_dict(state)
    assert max_abs_diff(weights(engine.model), reference["weights3"]) <= WEIGHT_ATOL
    # The optimizer state came along too: the next step is the reference's next step.
    r = optimizer_step(engine, [global_batch(STEPS)], grad_clip=GRAD_CLIP)
    assert_steps_match([(r.loss, r.grad_norm, r.label_tokens, r.applied)], reference["step4"], f"{kind} 1-rank resume")
    assert max_abs_diff(weights(engine.model), reference["weights4"]) <= WEIGHT_ATOL


def fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    torch.distributed.barrier()  # rank 0 would wait here forever if the helper did not end it
    return rank


def test_a_failing_rank_raises_with_its_traceback_instead_of_hanging():
    with pytest.raises(DistributedTestError, match="rank 1 fails on purpose") as info:
        run_distributed(fail_on_rank_1, world_size=2, timeout=120)
    # The cause comes first, with the child's traceback, even when rank 0 (peer lost) exits before it is seen.
    assert "-- rank 1 (first to fail):" in str(info.value) and "in fail_on_rank_1" in str(info.value)
