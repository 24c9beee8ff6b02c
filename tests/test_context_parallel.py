"""Context parallelism (Ulysses, ``distributed.context_parallel``): each rank holds a slice of every sequence.

Unit tests of the data half (the slice, the shifted labels, the position ids, the loader) and of the mask run
in this process. One launch at world size 2 (gloo) checks the model half against one process on the same batch:
FSDP2, DDP and DeepSpeed ZeRO-3 at CP = 2 (GA 2, packed documents whose boundary falls on either side of the cut
or across it): losses, grad norms, label-token counts, weights after 3 steps and eval loss; key/value heads
replicated (1 kv head, 2 ranks); activation checkpointing; chunked cross-entropy; and a whole run through ``run_training`` against the same run in one
process (loss, eval loss, grad norm, tokens per step). GLIDE drafts at CP = 2: the draft objective's loss sums
and the draft's gradients (lag 3, position offset, self-attention window; chunked scores and activation
checkpointing too) and the eval CE equal one process's (the whole draft run: tests/test_run_dist.py). EAGLE-3
drafts at CP = 2 (a 3-step unroll, reduced vocabulary, chunked scores; activation checkpointing too): the objective's
sums, acc_k counts and the draft's gradients equal one process's on the dense, unchunked reference path.

Tolerances (fp32): as tests/test_engines_dist.py; the GLIDE comparisons run in float64 (1e-10 relative).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import find_packed_sequence_indices

from tests.distributed import run_distributed
from tests.helpers import args, records
from tests.test_engines_dist import (CPU, GA, GRAD_CLIP, LLAMA, LOSS_RTOL, STEPS, WEIGHT_ATOL, assert_steps_match,
                                     global_batch, local_run, make_optimizer, max_abs_diff, snapshot, tiny_llama)
from treadle.cli import main
from treadle.config import ModelConfig, load_config
from treadle.data.loader import StepLoader, eval_batches, slice_sequences
from treadle.data.packed import IGNORE_INDEX
from treadle.engine.context_parallel import check_model, packed_causal_mask
from treadle.errors import UserError
from treadle.models.chunked_ce import use_chunked_loss
from treadle.models.hf import build_model
from treadle.engine.local import LocalEngine
from treadle.config import DraftConfig
from treadle.drafts.glide.model import GlideDraft, GlideModel
from treadle.drafts.glide.objective import GlideObjective
from treadle.train.moe import router_objective
from treadle.train.run import refuse_sliced_load_balancing
from treadle.train.step import label_tokens, loss_sum, optimizer_step

CP = 2
# DeepSpeed needs nothing of its own: treadle's engines all SUM gradients over every rank (the context group's
# share included), DeepSpeed's through its loss x world size (engine/deepspeed.py).
ENGINES = ("fsdp2", "ddp", "deepspeed")
_MOE = {"hidden_size": 32, "moe_intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------- the data half, in this process

def test_slices_partition_the_sequence_keep_the_boundary_label_and_continue_positions():
    batch = global_batch(0)
    batch["source"] = torch.arange(len(batch["input_ids"]))
    parts = [slice_sequences(batch, r, CP) for r in range(CP)]
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), batch[key])
        assert parts[0][key].shape[1] == batch[key].shape[1] // CP
    assert all(torch.equal(p["source"], batch["source"]) for p in parts)  # per row: not cut
    # Labels were shifted before the cut: rank 0's last label is rank 1's first input (not lost at the cut).
    valid = parts[0]["labels"][:, -1] != IGNORE_INDEX
    assert valid.any() and torch.equal(parts[0]["labels"][valid, -1], parts[1]["input_ids"][valid, 0])
    # A document running across the cut keeps counting on rank 1 (no restart at the slice start)...
    crossing = parts[1]["position_ids"][:, 0] != 0
    assert crossing.any() and torch.equal(parts[1]["position_ids"][crossing, 0], parts[0]["position_ids"][crossing, -1] + 1)
    # ...and the slices' label counts add up to the sequence's: the step's token count stays global.
    assert sum(int(label_tokens(p)) for p in parts) == int(label_tokens(batch))
    with pytest.raises(UserError, match="data.seq_len = 16 cannot be split into distributed.context_parallel = 3"):
        slice_sequences(batch, 0, 3)


class _Rows:
    """A dataset of packed-looking rows (no shards needed): row i = global_batch's row i % 8, tokens offset by i."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        b = global_batch(i // 8)
        return {"input_ids": b["input_ids"][i % 8], "labels": b["labels"][i % 8], "position_ids": b["position_ids"][i % 8]}


def test_the_ranks_of_a_context_group_get_the_same_rows_each_its_slice():
    whole = StepLoader(_Rows(), micro_batch_size=2, grad_accum_steps=2, seed=3)
    slices = [StepLoader(_Rows(), micro_batch_size=2, grad_accum_steps=2, seed=3, cp_rank=r, cp_size=CP) for r in range(CP)]
    for _ in range(3):
        want = whole.next_step()
        got = [s.next_step() for s in slices]
        for m, mb in enumerate(want):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(torch.cat([g[m][key] for g in got], dim=1), mb[key])
            assert all(torch.equal(g[m]["order_position"], mb["order_position"]) for g in got)
    assert slices[0].global_batch == whole.global_batch  # data parallelism is unchanged by the cut
    evals = [list(eval_batches(_Rows(), 4, 2, cp_rank=r, cp_size=CP)) for r in range(CP)]
    for b, mb in enumerate(eval_batches(_Rows(), 4, 2)):
        assert torch.equal(torch.cat([e[b]["labels"] for e in evals], dim=1), mb["labels"])


def test_packed_causal_mask_is_transformers_rule_and_none_for_single_documents():
    pos = global_batch(1)["position_ids"]
    mask = packed_causal_mask(pos)
    docs = find_packed_sequence_indices(pos)
    T = pos.shape[1]
    for b in range(pos.shape[0]):
        want = torch.tensor([[j <= i and docs[b, i] == docs[b, j] for j in range(T)] for i in range(T)])
        assert torch.equal(mask[b, 0], want)
    assert packed_causal_mask(torch.arange(T)[None].expand(2, T)) is None  # one document: sdpa's is_causal
    windowed = packed_causal_mask(torch.arange(T)[None], sliding_window=4)[0, 0]
    assert windowed[10, 7] and not windowed[10, 6] and not windowed[6, 10]


def test_models_cp_cannot_split_are_refused_in_one_line():
    check_model(tiny_llama().config, CP)  # 4 heads, 2 kv heads: fine
    check_model(tiny_llama().config, 4)  # 4 heads, 2 kv heads replicated: fine
    with pytest.raises(UserError, match=r"context_parallel = 3 does not divide the model's 4 attention heads"):
        check_model(tiny_llama().config, 3)
    eager = build_model(ModelConfig(preset="tiny", overrides={"attn_implementation": "eager"}), 64)
    with pytest.raises(UserError, match=r"needs sdpa attention, the model uses 'eager'"):
        check_model(eager.config, CP)
    # An MoE's load-balancing loss is not a token sum: on slices it would be another loss. Off, the run may go on.
    moe = ModelConfig(preset="tiny-moe", overrides=_MOE)
    with pytest.raises(UserError, match=r"router_aux_loss_coef = 0.001, the model's own when unset\): it would be "):
        refuse_sliced_load_balancing(router_objective(build_model(moe, 64), moe), CP)
    moe = ModelConfig(preset="tiny-moe", overrides=_MOE, router_aux_loss_coef=0, router_z_loss_coef=0.001)
    refuse_sliced_load_balancing(router_objective(build_model(moe, 64), moe), CP)


def test_layouts_that_cannot_work_exit_2_with_one_line(shards, tmp_path, capsys):
    cases = [
        (["--distributed.context_parallel=2"], "distributed.context_parallel = 2 does not divide the world size 1"),
        (["--distributed.context_parallel=3"], "data.seq_len = 32 cannot be split into distributed.context_parallel = 3"),
    ]
    for extra, message in cases:
        out = tmp_path / "run"
        assert main(args(shards, out, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("treadle: error:") and message in err[0], err
        assert not out.exists()


# ---------------------------------------------------------------- the model half, at world size 2

def _llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(LLAMA | overrides)))


def _engine(kind: str, group, seed: int = 0, checkpointing: str = "none", chunk_tokens: int = 0, **llama):
    from treadle.engine.context_parallel import apply_context_parallel
    from treadle.engine.ddp import DDPEngine
    from treadle.engine.fsdp2 import FSDP2Engine
    from treadle.models.checkpointing import apply_activation_checkpointing

    model = _llama(seed, **llama)
    if chunk_tokens:
        use_chunked_loss(model, chunk_tokens, IGNORE_INDEX)
    apply_activation_checkpointing(model, ModelConfig(activation_checkpointing=checkpointing))
    apply_context_parallel(model, group)
    if kind == "deepspeed":  # ZeRO-3, every parameter partitioned: its reduce-scatter averages over all ranks
        from treadle.engine.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, make_optimizer(model), CPU, zero_stage=3, grad_accum_steps=GA, micro_batch_size=4,
                               grad_clip=GRAD_CLIP, bf16=False, offload=False,
                               user_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    return DDPEngine(model, make_optimizer(model), CPU) if kind == "ddp" else FSDP2Engine(model, make_optimizer, CPU)


def _micro_batches(step: int, cp_rank: int) -> list[dict[str, torch.Tensor]]:
    """The whole global batch on every rank of the (only) context group, each its slice, in GA micro-batches."""
    batch = slice_sequences(global_batch(step), cp_rank, CP)
    rows = len(batch["input_ids"]) // GA
    return [{k: v[m * rows:(m + 1) * rows] for k, v in batch.items()} for m in range(GA)]


def _train(engine, steps, cp_rank):
    out = []
    for s in steps:
        r = optimizer_step(engine, _micro_batches(s, cp_rank), grad_clip=GRAD_CLIP)
        out.append((r.loss, r.grad_norm, r.label_tokens, r.applied))
    return out


@torch.no_grad()
def _eval_loss(engine, cp_rank) -> float:
    batch = slice_sequences(global_batch(99), cp_rank, CP)
    sums = torch.stack([loss_sum(engine.model, batch).sum().double(), label_tokens(batch).double()])
    total, tokens = engine.all_reduce_sum(sums).tolist()
    return total / tokens


def _cp_ranks(rank, world_size, shards, out):
    from treadle.distributed import init_distributed
    from treadle.engine.mesh import context_layout
    from treadle.train.run import run_training

    layout = context_layout(init_distributed("cpu"), CP)
    assert (layout.dp_rank, layout.dp_size, layout.cp_rank, layout.cp_size) == (0, 1, rank, CP)
    got = {}
    for kind in ENGINES:
        engine = _engine(kind, layout.cp_group)
        got[kind] = {"eval0": _eval_loss(engine, rank), "steps": _train(engine, range(STEPS), rank),
                     "export": snapshot(engine.export_state_dict())}
    # One key/value head for two ranks: replicated before the exchange. Activation checkpointing recomputes the
    # attention (and its all-to-alls) in backward.
    got["kv1"] = _train(_engine("fsdp2", layout.cp_group, num_key_value_heads=1), range(2), rank)
    got["checkpointed"] = _train(_engine("fsdp2", layout.cp_group, checkpointing="selective"), range(2), rank)
    got["chunked"] = _train(_engine("fsdp2", layout.cp_group, chunk_tokens=5), range(2), rank)  # CE chunks of a slice

    got["glide"] = {name: _glide_scores(rank, layout.cp_group, **case) for name, case in GLIDE_CASES.items()}
    got["eagle3"] = {name: _eagle3_scores(rank, layout.cp_group, **case) for name, case in EAGLE3_CASES.items()}

    # A whole run: the loader's slices, eval, checkpoint and export at CP = 2 on FSDP2 (engine auto).
    run_training(load_config(None, args(shards, out, "--train.max_steps=3", "--train.threads=1",
                                        "--distributed.context_parallel=2", "--checkpoint.every=2")[1:]))
    return got


@pytest.fixture(scope="module")
def launched(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "two"
    return run_distributed(_cp_ranks, world_size=2, timeout=300, shards=shards, out=out), out


def test_context_parallel_2_matches_one_process_on_fsdp2_and_ddp(launched):
    results, _ = launched
    engine, steps = local_run()
    want_export = snapshot(engine.model.state_dict())
    ref_model = tiny_llama(0)
    want_eval = _reference_eval(ref_model)
    for kind in ENGINES:
        for rank, res in enumerate(results):  # every rank of the group reports the step's loss and norm
            assert_steps_match(res[kind]["steps"], steps, f"{kind} rank {rank}")
            assert res[kind]["eval0"] == pytest.approx(want_eval, rel=LOSS_RTOL)
        assert max_abs_diff(results[0][kind]["export"], want_export) <= WEIGHT_ATOL
    assert all(norm > GRAD_CLIP for _, norm, _, _ in steps)  # the norm is compared before clipping
    for variant, llama in (("kv1", {"num_key_value_heads": 1}), ("checkpointed", {}), ("chunked", {})):
        model = _llama(0, **llama)
        ref = LocalEngine(model, make_optimizer(model), CPU)
        want = [(r.loss, r.grad_norm, r.label_tokens, r.applied)
                for r in (optimizer_step(ref, [global_batch(s)], grad_clip=GRAD_CLIP) for s in range(2))]
        for rank, res in enumerate(results):
            assert_steps_match(res[variant], want, f"{variant} rank {rank}")


# ---------------------------------------------------------------- GLIDE drafts at CP = 2

# Lag 3 and an offset from position 4 on: the cross-attention reads target K/V across the cut (rank 1's first
# queries read rank 0's keys); a 5-token self-attention window across it too. The documents of global_batch cross
# the cut in some rows.
_DRAFT = DraftConfig(kind="glide", target="unused", loss="mix", gamma=4, window=5, max_position_offset=40)
GLIDE_CASES = {"plain": {}, "chunked_checkpointed": {"chunk": 5, "checkpointing": "full"}}
RTOL64 = 1e-10


def _glide(chunk: int = 0, checkpointing: str = "none") -> GlideModel:
    from treadle.models.checkpointing import apply_activation_checkpointing

    # float64: the draft's KL is a difference of near-equal log-sum-exps, where fp32's CPU-dependent rounding
    # leaves ~1e-6 relative; in float64 the ranks' sums must match one process's to 1e-10.
    model = GlideModel(_llama(0), GlideDraft(_llama(0).config, window=_DRAFT.window)).double()
    model.loss_chunk_tokens = chunk
    apply_activation_checkpointing(model.draft_model, ModelConfig(activation_checkpointing=checkpointing))
    return model.train()


def _glide_scores(cp_rank: int = 0, group=None, **case) -> dict:
    """The draft objective's sums and the draft's gradients on this rank's slice (the whole batch without a group);
    then the eval CE. The ranks' sums add up to one process's."""
    objective = GlideObjective(_DRAFT, max_positions=2048, seq_len=16)
    return _draft_scores(_glide(**case), global_batch(5), objective, cp_rank, group, lag=3)


def _draft_scores(model, batch, objective, cp_rank, group, lag) -> dict:
    """A draft objective's sums (loss, side sums, eval CE) and the draft's gradients on this rank's slice."""
    if group is not None:
        from treadle.engine.context_parallel import apply_context_parallel

        apply_context_parallel(model, group)
        batch = slice_sequences(batch, cp_rank, CP)
    loss, report = objective.losses(model.train(), batch, lag=lag, offset=7, train=True)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.draft_model.named_parameters()}
    with torch.no_grad():
        ce, _ = objective.evaluate(model, batch)
    return {"loss": float(loss.detach().sum()), "eval": float(ce.sum()), "grads": grads,
            **{k: float(v) for k, v in report.items()}}


def test_a_glide_draft_at_context_parallel_2_matches_one_process(launched):
    results, _ = launched
    for name, case in GLIDE_CASES.items():
        want = _glide_scores(**case)
        got = [res["glide"][name] for res in results]
        for key in ("loss", "draft_kl", "target_loss", "eval"):
            assert sum(g[key] for g in got) == pytest.approx(want[key], rel=RTOL64), (name, key)
        for param, grad in want["grads"].items():
            assert grad.dtype == torch.float64 and grad.abs().sum() > 0, param  # every draft weight is trained
            assert torch.allclose(sum(g["grads"][param] for g in got), grad, rtol=1e-9, atol=1e-12), (name, param)


# ---------------------------------------------------------------- EAGLE-3 drafts at CP = 2

# Steps 0..2 score up to 3 indices ahead: rank 0's last rows read rank 1's labels and teacher; an offset from
# position 4 on. Chunks of 5 rows cut rank slices of 8 rows.
_EAGLE3 = DraftConfig(kind="eagle3", target="unused", loss="mix", ttt_steps=3, max_position_offset=40)
EAGLE3_CASES = {"chunked": {}, "checkpointed": {"checkpointing": "full"}}


def _eagle3_scores(cp_rank: int = 0, group=None, checkpointing: str = "none") -> dict:
    """As ``_glide_scores`` for an EAGLE-3 draft; without a group, the dense-mask, whole-logits reference."""
    from treadle.models.checkpointing import apply_activation_checkpointing
    from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model
    from treadle.drafts.eagle3.objective import Eagle3Objective

    target = _llama(0, num_hidden_layers=3)
    torch.manual_seed(1)
    model = Eagle3Model(target, Eagle3Draft(target.config, (1, 2, 3), vocab_size=64)).double()
    model.draft_model.set_vocabulary(torch.randperm(LLAMA["vocab_size"], generator=torch.Generator().manual_seed(2))[:64])
    apply_activation_checkpointing(model.draft_model, ModelConfig(activation_checkpointing=checkpointing))
    model.dense_attention, model.loss_chunk_tokens = group is None, 0 if group is None else 5
    objective = Eagle3Objective(_EAGLE3, max_positions=2048, seq_len=16)
    return _draft_scores(model, global_batch(6), objective, cp_rank, group, lag=0)


def test_an_eagle3_draft_at_context_parallel_2_matches_one_process(launched):
    results, _ = launched
    want = _eagle3_scores()
    assert {"ttt_rows_3", "draft_kl", "target_loss"} <= want.keys() and want["ttt_rows_3"] > 0
    for name in EAGLE3_CASES:
        got = [res["eagle3"][name] for res in results]
        for key, value in want.items():
            if key != "grads":
                assert sum(g[key] for g in got) == pytest.approx(value, rel=RTOL64), (name, key)
        for param, grad in want["grads"].items():
            assert grad.abs().sum() > 0, param  # every draft weight is trained
            assert torch.allclose(sum(g["grads"][param] for g in got), grad, rtol=1e-9, atol=1e-12), (name, param)


def _reference_eval(model) -> float:
    batch = global_batch(99)
    with torch.no_grad():
        return float(loss_sum(model, batch).sum() / label_tokens(batch))


def test_a_context_parallel_run_matches_one_process(launched, shards, tmp_path):
    _, two = launched
    one = tmp_path / "one"
    assert main(args(shards, one, "--train.max_steps=3", "--checkpoint.every=2")) == 0
    for key in ("loss", "eval_loss", "grad_norm", "tokens"):
        a, b = records(one, key), records(two, key)
        assert a.keys() == b.keys() and a, key
        assert all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in a), (key, a, b)
    # The CP = 2 checkpoint resumes in one process (CP = 1) and continues the same run.
    resumed = tmp_path / "resumed"
    assert main(args(shards, resumed, "--train.max_steps=3", f"--checkpoint.resume={two / 'checkpoints' / 'step_2'}")) == 0
    assert records(resumed).keys() == {3} and math.isclose(records(resumed)[3], records(two)[3], rel_tol=LOSS_RTOL)
    config = json.loads((two / "hf" / "config.json").read_text())
    assert "treadle" not in json.dumps(config)  # the export is a plain HF model: the wrapper is not recorded
