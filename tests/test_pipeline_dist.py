"""Pipeline parallelism at 2 stages (gloo, CPU) against one process on the same batches.

One launch (two ranks) runs every schedule (gpipe, 1f1b, interleaved 1f1b: 4 stages on 2 ranks), a model with
tied embeddings, a DCP checkpoint written by the stages, and whole runs through ``run_training`` (data, eval,
checkpoint, HF export); the tests below compare each with a single-process ``LocalEngine`` or a PP=1 run, and
resume the PP=2 run's checkpoint at PP=1. The reference takes the step's micro-batches in one loop (GA=4):
a pipeline must give the same loss (normalized by the step's token count over all micro-batches), the same
global grad norm and the same weights. A second launch (four ranks: two stages x two data-parallel ranks) checks
both ways of running the data ranks against the same reference: whole stages whose gradients are summed
(``engine = auto``), with tied embeddings, and FSDP2 inside each stage (``engine = fsdp2``: 1f1b with tied
embeddings, interleaved 1f1b); whole 4-rank runs of each against one process, their checkpoints resumed in one
process and one process's checkpoint resumed by them; and a layout that does not fit, refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.distributed import run_distributed
from tests.helpers import TARGET, args, records
from treadle.config import load_config
from treadle.engine.local import LocalEngine
from treadle.engine.optim import param_groups
from treadle.train.step import loss_sum, optimizer_step

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, use_cache=False)
ROWS, SEQ, GA, STEPS = 8, 16, 4, 2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-6, 1e-5, 1e-5
CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny_llama(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=tied))


def make_optimizer(model):
    return torch.optim.AdamW(param_groups(model, 0.1, False, False), lr=1e-2)


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """GA micro-batches of packed rows (positions restart mid-row) with very different valid label counts."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, LLAMA["vocab_size"], (ROWS, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    pos = torch.empty(ROWS, SEQ, dtype=torch.long)
    for i in range(ROWS):
        b = 3 + (i + step) % 10
        pos[i, :b], pos[i, b:] = torch.arange(b), torch.arange(SEQ - b)
        labels[i, b - 1] = -100
        labels[i, : (3 * i + step) % SEQ] = -100
    batch = {"input_ids": ids[:, :-1], "labels": labels, "position_ids": pos}
    mb = ROWS // GA
    return [{k: v[m * mb:(m + 1) * mb] for k, v in batch.items()} for m in range(GA)]


def _steps(engine, steps) -> list[tuple[float, float, int]]:
    out = []
    for s in steps:
        r = optimizer_step(engine, micro_batches(s), grad_clip=1.0)
        assert r.applied
        out.append((r.loss, r.grad_norm, r.label_tokens))
    return out


def _eval(engine) -> list[float]:
    def measure(model, batch):
        return torch.stack([loss_sum(model, batch).sum().double(), (batch["labels"] != -100).sum().double()])
    return engine.forward_only(micro_batches(9), measure).tolist()


# ---------------------------------------------------------------- on each rank

def _pipeline(schedule: str, tied: bool = False, micro: int = GA, fsdp: dict | None = None):
    from treadle.engine.pipeline import PipelineEngine

    import contextlib
    return PipelineEngine(tiny_llama(tied), make_optimizer, CPU, pipeline_parallel=2, schedule=schedule,
                          micro_batches=micro, autocast=contextlib.nullcontext, fsdp=fsdp)


def run_args(shards, out, saved, *extra) -> list[str]:
    """A whole run of the saved 4-layer model (``model.path``: built empty, each stage read from its files)."""
    return [a for a in args(shards, out) if not a.startswith("--model.overrides")][1:] + [
        "--train.threads=1", f"--model.path={saved}", "--checkpoint.every=2", "--train.eval_every=2",
        "--schedule.decay=constant", *extra]


def _check(rank: int, world_size: int, tmp: str, shards, out, saved) -> dict:
    import contextlib

    from treadle.engine.pipeline import PipelineEngine
    from treadle.models.sharded_load import empty_causal_lm
    from treadle.train.run import run_training

    got = {}
    for schedule in SCHEDULES:
        engine = _pipeline(schedule)
        got[schedule] = {"steps": _steps(engine, range(STEPS)), "eval": _eval(engine),
                         "weights": engine.export_state_dict(), "keys": sorted(engine.state_dict()["model"])}
        if schedule == "1f1b":  # the stages' checkpoint: each writes its own tensors under the full model's names
            dcp.save(engine.state_dict(), checkpoint_id=f"{tmp}/ckpt")
    engine = _pipeline("1f1b", tied=True)
    got["tied"] = {"steps": _steps(engine, range(STEPS)), "weights": engine.export_state_dict()}
    # Built empty from the saved (tied, bf16, several files) model: each rank reads its stages' tensors only.
    model, why = empty_causal_lm(saved, "model.path")
    assert why is None
    engine = PipelineEngine(model, make_optimizer, CPU, pipeline_parallel=2, schedule="interleaved_1f1b",
                            micro_batches=GA, autocast=contextlib.nullcontext)
    got["empty"] = {"state": {k: v.detach().clone() for k, v in engine.model.state_dict().items()},
                    "tied": rank == 1 and engine.model.lm_head.weight is engine.model.model.embed_tokens.weight}
    # Whole runs (model.path: built empty): 2 steps at PP=2 with a checkpoint, eval and the HF export (resumed at
    # PP=1 in the test).
    run_training(load_config(None, run_args(shards, out / "pp2", saved, "--train.max_steps=2",
                                            "--distributed.pipeline_parallel=2", "--distributed.pipeline_schedule=gpipe")))
    return got


def _half_steps(engine) -> list[tuple[float, float, int]]:
    """The steps of a data rank that takes its half of every step's micro-batches (GA / 2 of them)."""
    half = slice(engine.data_rank * GA // 2, (engine.data_rank + 1) * GA // 2)
    out = []
    for s in range(STEPS):
        r = optimizer_step(engine, micro_batches(s)[half], grad_clip=1.0)
        out.append((r.loss, r.grad_norm, r.label_tokens))
    return out


def _half_eval(engine) -> list[float]:
    """Evaluation sums over both data ranks, each taking half of the batches."""
    def measure(model, batch):
        return torch.stack([loss_sum(model, batch).sum().double(), (batch["labels"] != -100).sum().double()])
    half = slice(engine.data_rank * GA // 2, (engine.data_rank + 1) * GA // 2)
    return engine.all_reduce_sum(engine.forward_only(micro_batches(9)[half], measure)).tolist()


def _sharded(engine) -> bool:
    """Every parameter of the rank's stages is a DTensor holding about half of its rows (two shards)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) and p.to_local().shape[0] <= -(-p.shape[0] // 2)
               for p in engine.model.parameters())


def _check_replicas(rank: int, world_size: int, shards, out, saved, reference) -> dict:
    """Four ranks: two stages x two data-parallel ranks (rank = stage rank x 2 + data rank); each data rank takes
    half of every step's micro-batches (GA / 2 of them), as the data-parallel ranks do in a run. First two
    pipelines of whole stages (their gradients summed), then FSDP2 inside each stage."""
    from treadle.errors import UserError
    from treadle.train.run import run_training

    engine = _pipeline("1f1b", tied=True, micro=GA // 2)
    assert (engine.stage_rank, engine.data_rank, engine.data_world_size) == (rank // 2, rank % 2, 2)
    got = {"steps": _half_steps(engine), "eval": _half_eval(engine)}
    got["weights"] = engine.export_state_dict()
    # A whole run: 2 pipelines x 2 stages, micro-batch 2 x GA 2 x 2 replicas = the 8 rows of one process's step.
    layout = ["--train.micro_batch_size=2", "--train.eval_batches=4",  # the same 8 samples as one process
              "--distributed.pipeline_parallel=2", "--distributed.pipeline_schedule=gpipe"]
    run_training(load_config(None, run_args(shards, out / "pp2dp2", saved, "--train.max_steps=2", *layout)))
    # The one-process run's step-2 checkpoint (PP = 1) resumed here, at 2 stages x 2 pipelines, to step 4.
    resume = f"--checkpoint.resume={reference / 'checkpoints' / 'step_2'}"
    run_training(load_config(None, run_args(shards, out / "from_pp1", saved, "--train.max_steps=4", *layout, resume)))

    # FSDP2 inside each stage: the same steps, each stage's parameters sharded over its two data ranks.
    got["fsdp"] = {}
    for schedule, tied in (("1f1b", True), ("interleaved_1f1b", False)):
        engine = _pipeline(schedule, tied=tied, micro=GA // 2, fsdp={})
        got["fsdp"][schedule] = {"steps": _half_steps(engine), "eval": _half_eval(engine), "sharded": _sharded(engine),
                                 "weights": engine.export_state_dict()}
    # Whole runs at 2 stages x FSDP 2 (model.path: built empty, each rank reading its stage's shards): 2 steps with
    # a checkpoint (resumed in one process by the test), and one process's step-2 checkpoint resumed here to step 4.
    fsdp = ["--train.micro_batch_size=2", "--train.eval_batches=4", "--distributed.pipeline_parallel=2",
            "--distributed.engine=fsdp2", "--distributed.pipeline_schedule=1f1b"]
    run_training(load_config(None, run_args(shards, out / "pp2fsdp2", saved, "--train.max_steps=2", *fsdp)))
    run_training(load_config(None, run_args(shards, out / "fsdp_from_pp1", saved, "--train.max_steps=4", *fsdp,
                                            resume)))
    try:  # 2 stages x 4 shards on 4 ranks: refused before anything is written
        run_training(load_config(None, run_args(shards, out / "bad", saved, "--train.max_steps=2", *fsdp,
                                                "--distributed.data_parallel_shard=4")))
    except UserError as e:
        got["refused"] = str(e)
    return got


# ---------------------------------------------------------------- in the test process

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-layer Llama with tied embeddings saved in bf16 over several safetensors files."""
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("pipeline_model") / "llama"
    LlamaForCausalLM(LlamaConfig(**(TARGET | {"num_hidden_layers": 4, "tie_word_embeddings": True}))).to(
        torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.fixture(scope="module")
def launched(tmp_path_factory, shards, saved):
    tmp = tmp_path_factory.mktemp("pipeline_dist")
    return run_distributed(_check, world_size=2, timeout=300, tmp=str(tmp), shards=shards, out=tmp, saved=saved), tmp


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, shards, saved):
    """The reference run: 4 steps in one process (PP = 1), checkpoints at 2 and 4."""
    from treadle.train.run import run_training

    out = tmp_path_factory.mktemp("pipeline_ref") / "pp1"
    run_training(load_config(None, run_args(shards, out, saved, "--train.max_steps=4")))
    return out


def _local(tied: bool = False):
    model = tiny_llama(tied)
    return LocalEngine(model, make_optimizer(model), CPU)


def _close(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _assert_steps(got, want):
    for (loss, norm, tokens), (rloss, rnorm, rtokens) in zip(got, want, strict=True):
        assert tokens == rtokens
        assert loss == pytest.approx(rloss, rel=LOSS_RTOL)
        assert norm == pytest.approx(rnorm, rel=NORM_RTOL)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_stages_match_one_process(launched, schedule):
    results, _ = launched
    ref = _local()
    want = _steps(ref, range(STEPS))
    for res in results:  # loss and norm are known on every rank, not only on the last stage
        _assert_steps(res[schedule]["steps"], want)
        assert res[schedule]["eval"] == pytest.approx(_eval(ref), rel=1e-6)
    assert _close(results[0][schedule]["weights"], ref.export_state_dict()) <= WEIGHT_ATOL
    assert results[1][schedule]["weights"] == {}  # the full model is gathered on rank 0 only
    # Each stage holds only its own tensors, under the full model's names; together they are the whole model.
    keys = [set(res[schedule]["keys"]) for res in results]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(ref.state_dict()["model"])


def test_stages_built_empty_read_only_their_own_tensors(launched, saved):
    """A model.path model built on the meta device and split: each rank holds its stages' tensors only (layers
    0 and 2 with the embedding on rank 0, 1 and 3 with norm and head on rank 1: interleaved), read from the files
    and equal to from_pretrained's; the last rank's head is tied to the embedding it keeps."""
    from treadle.models.hf import load_causal_lm

    want = load_causal_lm(saved, "model.path").state_dict()
    states = [res["empty"]["state"] for res in launched[0]]
    assert {k for k in states[0] if ".layers." in k} == {k for k in want if ".layers.0." in k or ".layers.2." in k}
    assert {k for k in states[1] if ".layers." in k} == {k for k in want if ".layers.1." in k or ".layers.3." in k}
    assert "lm_head.weight" not in states[0] and "model.norm.weight" in states[1]
    for state in states:
        assert all(not v.is_meta and torch.equal(v, want[k]) for k, v in state.items())
    assert launched[0][1]["empty"]["tied"]


def test_tied_embeddings_across_stages_match_one_process(launched):
    results, _ = launched
    ref = _local(tied=True)
    want = _steps(ref, range(STEPS))
    for res in results:
        _assert_steps(res["tied"]["steps"], want)
    weights = results[0]["tied"]["weights"]
    assert _close(weights, ref.export_state_dict()) <= WEIGHT_ATOL
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_stage_checkpoint_resumes_in_one_process(launched):
    """The 1f1b stages' DCP checkpoint after 2 steps, loaded by one process, continues like the uninterrupted run
    (two more steps: the second also checks the optimizer state)."""
    _, tmp = launched
    ref = _local()
    _steps(ref, range(STEPS))
    want = _steps(ref, range(STEPS, STEPS + 2))
    resumed = _local()
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=str(tmp / "ckpt"))
    resumed.load_state_dict(state)
    _assert_steps(_steps(resumed, range(STEPS, STEPS + 2)), want)
    assert _close(resumed.export_state_dict(), ref.export_state_dict()) <= WEIGHT_ATOL


def test_pipeline_run_resumes_at_pp1_and_exports_the_full_model(launched, one_process_run, shards, saved):
    """treadle train at PP=2 (gpipe) for 2 steps, resumed at PP=1 to step 4, equals an uninterrupted PP=1 run."""
    _, tmp = launched
    from treadle.train.run import run_training

    pp2, pp1 = tmp / "pp2", one_process_run
    one = records(pp1)
    assert records(pp2) == pytest.approx({s: one[s] for s in (1, 2)}, rel=1e-5)
    assert records(pp2, "eval_loss") == pytest.approx({s: records(pp1, "eval_loss")[s] for s in (0, 2)}, rel=1e-5)
    exported = load_file(pp2 / "hf" / "model.safetensors")
    assert len(exported) == len(load_file(pp1 / "hf" / "model.safetensors"))  # every layer, not one stage's
    run_training(load_config(None, run_args(shards, pp2, saved, "--train.max_steps=4")))
    assert records(pp2) == pytest.approx(one, rel=1e-5)
    assert records(pp2, "eval_loss") == pytest.approx(records(pp1, "eval_loss"), rel=1e-5)
    final, want = load_file(pp2 / "hf" / "model.safetensors"), load_file(pp1 / "hf" / "model.safetensors")
    assert _close(final, want) <= WEIGHT_ATOL


def test_models_that_cannot_be_split_are_one_line():
    from treadle.engine.pipeline import plan_stages
    from treadle.errors import UserError

    _, layout = plan_stages(tiny_llama(), 2, "interleaved_1f1b")
    assert layout == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(UserError, match="4 decoder layers do not split into 3 equal stages"):
        plan_stages(tiny_llama(), 3, "1f1b")
    # Gemma 2 soft-caps its logits in the model's forward: a stage without the head would cap its hidden states.
    # Gemma (its embedding scale lives in the embedding module in transformers 5) splits fine.
    from transformers import Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    plan_stages(GemmaForCausalLM(GemmaConfig(**small)), 2, "gpipe")
    with pytest.raises(UserError, match="gemma2 models cannot be split into stages"):
        plan_stages(Gemma2ForCausalLM(Gemma2Config(**small)), 2, "gpipe")
    # Built empty (model.path, read stage by stage later): checked on a random twin, one layer per stage.
    with torch.device("meta"):
        empty_llama, empty_gemma2 = tiny_llama(), Gemma2ForCausalLM(Gemma2Config(**small))
    state = torch.random.get_rng_state()
    plan_stages(empty_llama, 2, "interleaved_1f1b")
    with pytest.raises(UserError, match="gemma2 models cannot be split into stages"):
        plan_stages(empty_gemma2, 2, "gpipe")
    assert torch.equal(torch.random.get_rng_state(), state)  # the twin's init draws leave the run's RNG alone


# ---------------------------------------------------------------- two pipelines side by side (4 ranks)

@pytest.fixture(scope="module")
def replicas(tmp_path_factory, shards, saved, one_process_run):
    tmp = tmp_path_factory.mktemp("pipeline_dp")
    return run_distributed(_check_replicas, world_size=4, timeout=300, shards=shards, out=tmp, saved=saved,
                           reference=one_process_run), tmp


def test_two_pipelines_of_two_stages_match_one_process(replicas, one_process_run, shards, saved):
    results, tmp = replicas
    ref = _local(tied=True)
    want = _steps(ref, range(STEPS))
    for res in results:  # every rank of both pipelines: the step's loss over both replicas, the global norm
        _assert_steps(res["steps"], want)
        assert res["eval"] == pytest.approx(_eval(ref), rel=1e-6)
    weights = results[0]["weights"]
    assert _close(weights, ref.export_state_dict()) <= WEIGHT_ATOL
    assert all(res["weights"] == {} for res in results[1:])
    # The whole 4-rank run equals one process's, and its stages' checkpoint (written by 4 ranks) resumes there.
    from treadle.train.run import run_training

    run = tmp / "pp2dp2"
    assert records(run) == pytest.approx({s: records(one_process_run)[s] for s in (1, 2)}, rel=1e-5)
    assert records(run, "eval_loss") == pytest.approx({s: records(one_process_run, "eval_loss")[s] for s in (0, 2)},
                                                      rel=1e-5)
    run_training(load_config(None, run_args(shards, run, saved, "--train.max_steps=4")))
    assert records(run) == pytest.approx(records(one_process_run), rel=1e-5)
    # And the other way: one process's checkpoint continued by 4 ranks in 2 pipelines of 2 stages.
    resumed = records(tmp / "from_pp1")
    assert resumed.keys() == {3, 4} and resumed == pytest.approx({s: records(one_process_run)[s] for s in (3, 4)}, rel=1e-5)


def test_fsdp2_inside_two_stages_matches_one_process(replicas, one_process_run, shards, saved):
    """engine = fsdp2 at 2 stages x 2 shards: the same losses, norms and weights as one process (the engine with
    1f1b and tied embeddings, and with interleaved 1f1b), whole runs that resume across layouts both ways, and a
    layout whose product is not the launch's refused in one line."""
    from treadle.train.run import run_training

    results, tmp = replicas
    for schedule, tied in (("1f1b", True), ("interleaved_1f1b", False)):
        ref = _local(tied)
        want = _steps(ref, range(STEPS))
        for res in results:
            got = res["fsdp"][schedule]
            assert got["sharded"]
            _assert_steps(got["steps"], want)
            assert got["eval"] == pytest.approx(_eval(ref), rel=1e-6)
        assert _close(results[0]["fsdp"][schedule]["weights"], ref.export_state_dict()) <= WEIGHT_ATOL
        assert all(res["fsdp"][schedule]["weights"] == {} for res in results[1:])
    one = records(one_process_run)
    run = tmp / "pp2fsdp2"
    assert records(run) == pytest.approx({s: one[s] for s in (1, 2)}, rel=1e-5)
    assert records(run, "eval_loss") == pytest.approx({s: records(one_process_run, "eval_loss")[s] for s in (0, 2)},
                                                      rel=1e-5)
    # The sharded stages' checkpoint (4 ranks) continued by one process, to the one-process run's step 4.
    run_training(load_config(None, run_args(shards, run, saved, "--train.max_steps=4")))
    assert records(run) == pytest.approx(one, rel=1e-5)
    want = load_file(one_process_run / "hf" / "model.safetensors")
    assert _close(load_file(run / "hf" / "model.safetensors"), want) <= WEIGHT_ATOL
    # One process's checkpoint continued by 2 stages x FSDP 2; its export gathered from the shards of both stages.
    resumed = records(tmp / "fsdp_from_pp1")
    assert resumed.keys() == {3, 4} and resumed == pytest.approx({s: one[s] for s in (3, 4)}, rel=1e-5)
    assert _close(load_file(tmp / "fsdp_from_pp1" / "hf" / "model.safetensors"), want) <= WEIGHT_ATOL
    for res in results:
        assert res["refused"].startswith("distributed: pipeline_parallel 2 x data_parallel_shard 4 = 8 ranks, but "
                                         "the launch has 4; accepted:") and "\n" not in res["refused"]
    assert not (tmp / "bad").exists()


def test_engines_that_cannot_run_stages_are_refused_in_one_line():
    from treadle.distributed import DistInfo
    from treadle.engine import resolve_engine
    from treadle.errors import UserError

    info = DistInfo(0, 4, 0, CPU, "gloo")
    assert resolve_engine("auto", info, 2) == resolve_engine("fsdp2", info, 2) == "pipeline"
    with pytest.raises(UserError, match=r"^distributed.engine = 'ddp' with pipeline_parallel = 2: .*accepted: "
                                        r"distributed.engine = auto .* or fsdp2 "):
        resolve_engine("ddp", info, 2)
