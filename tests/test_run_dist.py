"""Whole runs at world size 2 (gloo, CPU), through the same ``build_trainer`` / ``run_training`` as the CLI.

One launch does several runs, because each launch costs seconds: an FSDP2 run that a
single process must reproduce (and resume from at world size 1), a DDP run where only
rank 1 sees a NaN, a DDP run where only rank 1 gets SIGTERM, and a health check that one
rank misses. The single-process references run here, in the test process.

Tolerances (fp32): losses 1e-5 relative (two ranks sum the same terms in another order).
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.helpers import KL_ATOL, args, draft_args, mixture_args, moe_args, records, write_pairs
from treadle import compat
from treadle.cli import main
from treadle.config import load_config
from treadle.distributed import DistInfo
from treadle.engine import resolve_engine
from treadle.errors import UserError
from treadle.train.callbacks import Callback, CheckpointCallback

LOSS_RTOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _cfg(shards, out, *extra):
    return load_config(None, args(shards, out, "--train.threads=1", *extra)[1:])


def _mixture_cfg(shards, out, *extra):
    return load_config(None, mixture_args(shards, out.parent / "pairs.jsonl", out, "--train.threads=1", *extra)[1:])


def _fingerprint(module: torch.nn.Module) -> float:
    """A number that differs when any weight differs (replicas that drifted apart)."""
    return float(sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(module.parameters())))


class SignalAt(Callback):
    """Delivers ``sig`` to this process right after step ``step`` (as a scheduler would, to one rank only)."""

    def __init__(self, step: int, sig: int = signal.SIGTERM):
        self.step, self.sig = step, sig

    def on_step_end(self, trainer, result) -> None:
        if trainer.state.step == self.step:
            os.kill(os.getpid(), self.sig)


def _runs(rank, world_size, shards, out):
    from treadle.distributed import HealthCheck, HealthCheckFailed
    from treadle.train.run import build_trainer, run_training

    got = {}
    # 1. FSDP2 on a mixture of a shard source and an SFT file (rank 0 tokenizes it) with a phase at step 3,
    #    checkpoints at 2 and 4, written in the background; the health check runs after every step.
    run_training(_mixture_cfg(shards, out / "fsdp2", "--train.max_steps=4", "--checkpoint.every=2",
                              "--distributed.engine=fsdp2", "--distributed.health_check_every=1",
                              "--checkpoint.async_save=true"))  # the writer on its own group beside the health check

    # 2. DDP, a NaN loss on rank 1 only at step 2: both ranks must skip that update. A checkpoint is due by time
    #    after every step on rank 0's clock; rank 1's own would never be: rank 0's decides for both.
    trainer = build_trainer(_cfg(shards, out / "nan", "--train.max_steps=3", "--distributed.engine=ddp",
                                 "--resilience.inject_nan_steps=[2]", "--resilience.inject_nan_ranks=[1]",
                                 "--checkpoint.every_minutes=0.00001"))
    if rank == 1:
        next(cb for cb in trainer.callbacks if isinstance(cb, CheckpointCallback)).every_s = 1e9
    trainer.fit()
    trainer.metrics.close()
    got["nan"] = (trainer.state.skipped_steps, _fingerprint(trainer.engine.module))

    # 3. DDP, SIGTERM to rank 1 only after step 2: both stop after step 2 with one checkpoint.
    trainer = build_trainer(_cfg(shards, out / "term", "--train.max_steps=6", "--distributed.engine=ddp"))
    if rank == 1:
        trainer.callbacks.insert(0, SignalAt(2))
    trainer.fit()
    trainer.metrics.close()
    got["term"] = (trainer.state.step, trainer.stop_reason)

    # 4. MoE on FSDP2 at GA 1: each rank trains one of the micro-batches a single process trains at GA 2.
    run_training(load_config(None, moe_args(shards, out / "moe", "--train.max_steps=2", "--train.grad_accum_steps=1",
                                            "--distributed.engine=fsdp2", "--train.threads=1")[1:]))

    # 6. LoRA adapters (the base frozen, sharded or partitioned beside them) on every multi-process engine;
    #    FSDP2 checkpoints at 2 and 4 (resumed in one process below).
    for name, extra in LORA_ENGINES.items():
        run_training(_cfg(shards, out / name, *LORA, *extra))

    # 5. A rank that does not come to the health check is reported within its timeout, not waited on.
    check = HealthCheck(timeout_s=2.0)
    check.check(0)  # everyone present: passes
    if rank == 1:
        time.sleep(4.0)
    t0 = time.perf_counter()
    try:
        check.check(7)
        got["health"] = None
    except HealthCheckFailed as exc:
        got["health"] = (str(exc), time.perf_counter() - t0)
    return got


LORA = ["--lora.rank=4", "--lora.alpha=8"]
LORA_ENGINES = {"lora-fsdp2": ["--distributed.engine=fsdp2", "--train.max_steps=4", "--checkpoint.every=2"],
                "lora-ddp": ["--distributed.engine=ddp", "--train.max_steps=2"],
                "lora-zero2": ["--distributed.engine=deepspeed", "--distributed.zero_stage=2", "--train.max_steps=2"],
                "lora-zero3": ["--distributed.engine=deepspeed", "--distributed.zero_stage=3", "--train.max_steps=2"]}


def test_world_size_2_runs_match_one_process_and_agree_on_faults(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    res = run_distributed(_runs, world_size=2, timeout=240, shards=shards, out=tmp_path)

    # FSDP2 at 2 ranks x GA 2 == one process with GA 4 (same global batch, same sample order, same mixture draws).
    one = tmp_path / "one"
    assert main(mixture_args(shards, pairs, one, "--train.max_steps=4", "--train.grad_accum_steps=4")) == 0
    two = tmp_path / "fsdp2"
    assert records(two, "phase") == {1: 0, 2: 0, 3: 0, 4: 1}
    for key in ("loss", "eval_loss", "grad_norm", "lr", "loss/code", "tokens/code", "tokens/sft"):
        a, b = records(one, key), records(two, key)
        assert a.keys() == b.keys() and a
        assert all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in a), (key, a, b)
    assert records(one, "tokens") == records(two, "tokens")  # tokens count both ranks
    # FLOPs per device and the peak memory of the window (the max over ranks: a collective at every record).
    assert all(v > 0 for v in records(two, "tflops_per_s").values()) and len(records(two, "peak_rss_gib")) == 4
    assert sorted(p.name for p in (two / "checkpoints" / "step_2" / "rng").iterdir()) == ["rank_0.json", "rank_1.json"]
    assert (two / "hf" / "model.safetensors").is_file()

    # The 2-rank FSDP2 checkpoint resumes in one process and continues the same run, through the phase at step 3.
    resumed = tmp_path / "resumed"
    assert main(mixture_args(shards, pairs, resumed, "--train.max_steps=4", "--train.grad_accum_steps=4",
                             f"--checkpoint.resume={two / 'checkpoints' / 'step_2'}")) == 0
    for key in ("loss", "lr", "tokens/sft"):
        a, b = records(two, key), records(resumed, key)
        assert sorted(b) == [3, 4] and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in b), key

    # NaN on one rank: both skipped the same step and stayed identical replicas.
    (skipped0, w0), (skipped1, w1) = res[0]["nan"], res[1]["nan"]
    assert skipped0 == skipped1 == 1 and w0 == w1
    assert records(tmp_path / "nan", "skipped_steps") == {2: 1, 3: 1}
    assert records(tmp_path / "nan")[2] is None  # the NaN loss itself is logged (as null)
    ckpts = tmp_path / "nan" / "checkpoints"  # by time, without checkpoint.every: steps 1, 2, 3 (keep_last 2)
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]
    assert len(list((ckpts / "step_2" / "rng").iterdir())) == 2

    # SIGTERM on one rank: both stopped after step 2, and the checkpoint of step 2 is complete.
    assert res[0]["term"] == (2, "stop requested by another rank") and res[1]["term"] == (2, "SIGTERM")
    ckpts = tmp_path / "term" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_2"]
    assert (ckpts / "latest").resolve().name == "step_2" and len(list((ckpts / "step_2" / "rng").iterdir())) == 2

    # MoE: the router losses and expert counts of 2 ranks x GA 1 are those of 1 process x GA 2 (same micro-batches:
    # the load-balancing loss is per micro-batch, so this holds although GA 1 x 4 rows would differ).
    one, two = tmp_path / "moe-one", tmp_path / "moe"
    assert main(moe_args(shards, one, "--train.max_steps=2")) == 0
    for key in ("loss", "grad_norm", "router_aux_loss", "router_z_loss", "expert_load_max_mean", "eval_loss"):
        a, b = records(one, key), records(two, key)
        assert a.keys() == b.keys() and a and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in a), (key, a, b)
    assert records(one, "expert_tokens") == records(two, "expert_tokens")

    # LoRA: every engine's run is the one-process run (2 ranks x GA 2 = GA 4); its checkpoints hold the adapters
    # only; the FSDP2 run's step_2 resumes in one process and continues it.
    one = tmp_path / "lora-one"
    assert main(args(shards, one, *LORA, "--train.max_steps=4", "--train.grad_accum_steps=4")) == 0
    for name in LORA_ENGINES:
        run = tmp_path / name
        for key in ("loss", "grad_norm", "eval_loss"):  # eval: at 0 and at each run's end (2 or 4)
            a, b = records(one, key), records(run, key)
            steps = a.keys() & b.keys() if key == "eval_loss" else b.keys()
            assert steps and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in steps), (name, key, a, b)
        last = max(records(run))
        names = _checkpoint_tensor_names(run / "checkpoints" / f"step_{last}")
        assert names and all("lora_" in k for k in names if not k.startswith("optim.")), (name, names)
        assert (run / "adapter" / "adapter_model.safetensors").is_file()
    resumed = tmp_path / "lora-resumed"
    assert main(args(shards, resumed, *LORA, "--train.max_steps=4", "--train.grad_accum_steps=4",
                     f"--checkpoint.resume={tmp_path / 'lora-fsdp2' / 'checkpoints' / 'step_2'}")) == 0
    a, b = records(tmp_path / "lora-fsdp2"), records(resumed)
    assert sorted(b) == [3, 4] and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in b)

    # The health check named the missing rank's absence within about its timeout.
    message, waited = res[0]["health"]
    assert "after step 7" in message and "hung or dead" in message and waited < 4.0


# fsdp2 also checkpoints the draft block's activations: the one-process run it is compared with does not.
# cp2: one data-parallel replica whose two ranks each hold half of every sequence (GA 4: the same global batch).
DRAFT_ENGINES = {"fsdp2": ["--distributed.engine=fsdp2", "--model.activation_checkpointing=full"],
                 "zero3": ["--distributed.engine=deepspeed", "--distributed.zero_stage=3"],
                 "cp2": ["--distributed.context_parallel=2", "--train.grad_accum_steps=4"]}
# An EAGLE-3 draft (reduced vocabulary, 3 unroll steps) on fsdp2, compared with its own one-process run.
EAGLE3 = ["--draft.kind=eagle3", "--draft.vocab_size=200", "--draft.ttt_steps=3"]
DRAFT_ENGINES["eagle3-fsdp2"] = DRAFT_ENGINES["fsdp2"] + EAGLE3
# An EAGLE-3 run at CP = 2 (its scores chunk by chunk, auto) against the one-process run (whole logits).
DRAFT_ENGINES["eagle3-cp2"] = DRAFT_ENGINES["cp2"] + EAGLE3
# A DFlash block draft on fsdp2: its anchors are drawn per row by the row's global position, not per rank.
DFLASH = ["--draft.kind=dflash", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
          "--draft.anchors=4"]
DRAFT_ENGINES["dflash-fsdp2"] = DRAFT_ENGINES["fsdp2"] + DFLASH
# DFlash2 on fsdp2 (its selector in the root unit) and ZeRO-3 (its convolutions' and selector's own parameters
# gathered around their forwards).
DFLASH2 = ["--draft.kind=dflash2", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4", "--draft.anchors=4",
           "--draft.conv_group_size=8", "--draft.selector_rank=16", "--draft.selector_top_k=4"]
DRAFT_ENGINES["dflash2-fsdp2"] = DRAFT_ENGINES["fsdp2"] + DFLASH2
DRAFT_ENGINES["dflash2-zero3"] = DRAFT_ENGINES["zero3"] + DFLASH2
# DSpark on ZeRO-3 (its Markov and confidence heads gathered by their own forwards, in chunked_rows' recompute too)
# and LiLiCorr on fsdp2 (the correlator in the root unit, run inside the model's forward); one run each: the other
# engine shards the same DFlash backbone the runs above check.
DSPARK = ["--draft.kind=dspark", "--draft.block_size=5", "--draft.num_layers=2", "--draft.gamma=4", "--draft.anchors=4",
          "--draft.markov_rank=8"]
LILICORR = ["--draft.kind=lilicorr", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
            "--draft.anchors=4", "--draft.candidates=4"]
DRAFT_ENGINES["dspark-zero3"] = DRAFT_ENGINES["zero3"] + DSPARK
# DSpine on both: on ZeRO-3 its injection gates gathered by their own forwards, its transfer codes (a buffer computed
# from the target's head when the draft is new) read from the target's files, the target being built empty there; on
# fsdp2 the injection module (every layer's gates and readouts) in the root unit, the codes a buffer every rank holds.
DSPINE = ["--draft.kind=dspine", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4", "--draft.anchors=4",
          "--draft.candidates=4"]
DRAFT_ENGINES["dspine-fsdp2"] = DRAFT_ENGINES["fsdp2"] + DSPINE
DRAFT_ENGINES["dspine-zero3"] = DRAFT_ENGINES["zero3"] + DSPINE
DRAFT_ENGINES["lilicorr-fsdp2"] = DRAFT_ENGINES["fsdp2"] + LILICORR
# XPress on both (its refiner in the root unit on fsdp2; on ZeRO-3 gathered by its own forwards, the Jacobi passes'
# too).
XPRESS = ["--draft.kind=xpress", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
          "--draft.anchors=4"]
DRAFT_ENGINES["xpress-fsdp2"] = DRAFT_ENGINES["fsdp2"] + XPRESS
DRAFT_ENGINES["xpress-zero3"] = DRAFT_ENGINES["zero3"] + XPRESS
# The frozen target split over 2 tensor-parallel ranks for its forward (one data-parallel replica: GA 4), the draft
# whole on both: EAGLE-3 and the block kinds read its hidden states. LiLiCorr also reads the target's embedding (its
# candidates' rows) and head, which TP leaves whole.
TP2 = ["--distributed.tensor_parallel=2", "--train.grad_accum_steps=4"]
DRAFT_ENGINES["eagle3-tp2"] = TP2 + EAGLE3
DRAFT_ENGINES["dflash-tp2"] = TP2 + DFLASH
DRAFT_ENGINES["lilicorr-tp2"] = TP2 + LILICORR
# Each kind's one-process reference run (GA 4: the global batch of every run above).
ONE_PROCESS = {"glide": [], "eagle3": EAGLE3, "dflash": DFLASH, "dflash2": DFLASH2, "dspark": DSPARK,
               "lilicorr": LILICORR, "dspine": DSPINE, "xpress": XPRESS}


def _kind(name: str) -> str:
    """The draft kind of a DRAFT_ENGINES run: its name's prefix, GLIDE's runs named by their engine alone."""
    return next((k for k in ONE_PROCESS if name.startswith(k + "-")), "glide")


# torch < 2.13's FSDP2 cannot train a draft beside a frozen target: every run on it (fsdp2, and auto: CP, TP) is
# refused there (asserted below); ZeRO-3 runs.
REFUSED = [] if compat.FSDP2_TRAINS_DRAFTS else [n for n, a in DRAFT_ENGINES.items() if "--distributed.engine=deepspeed" not in a]
for _name in REFUSED:
    del DRAFT_ENGINES[_name]


def _draft_runs(rank, world_size, shards, target_dir, eagle3_target_dir, out):
    from treadle.train.run import build_trainer

    got = {}
    for name, extra in DRAFT_ENGINES.items():
        target = target_dir if _kind(name) == "glide" else eagle3_target_dir
        trainer = build_trainer(load_config(None, draft_args(shards, target, out / name, "--train.max_steps=3",
                                                             "--train.threads=1", *extra)[1:]))
        # Full weights on rank 0 (gathered: every rank calls it), copied: where FSDP2's shard dimension has one rank
        # (TP 2 on 2 ranks) the "gathered" tensors are the live parameters' own storage.
        before = {k: v.clone() for k, v in trainer.engine.export_state_dict().items()}
        trainer.fit()
        trainer.metrics.close()
        after = trainer.engine.export_state_dict()
        if rank == 0:
            target = [k for k in before if k.startswith("target.")]
            draft = [k for k in before if k.startswith("draft_model.")]
            got[name] = {"target_keys": len(target), "draft_keys": len(draft),
                         "target_same": all(torch.equal(before[k], after[k]) for k in target),
                         "draft_changed": any(not torch.equal(before[k], after[k]) for k in draft)}
    # GLIDE reads the target's per-head K/V, which TP splits: refused in one line, on every rank, before any write.
    try:
        build_trainer(load_config(None, draft_args(shards, target_dir, out / "glide-tp2", "--train.max_steps=3",
                                                   "--train.threads=1", *TP2)[1:]))
        got["glide-tp2"] = None
    except UserError as exc:
        got["glide-tp2"] = (str(exc), (out / "glide-tp2").exists())
    return got


def _checkpoint_tensor_names(step_dir) -> list[str]:
    """Every tensor name a checkpoint holds: DCP metadata, or DeepSpeed's module state file."""
    from treadle.checkpoint.safety import read_metadata

    if (step_dir / "state").is_dir():
        return list(read_metadata(step_dir / "state").state_dict_metadata)
    names = []
    for f in sorted((step_dir / "deepspeed").rglob("*model_states.pt")):
        names += list(torch.load(f, map_location="cpu", weights_only=False)["module"])
    return names


def test_draft_runs_at_world_size_2_on_fsdp2_zero3_and_context_parallel(shards, target_dir, eagle3_target_dir,
                                                                         tmp_path):
    res = run_distributed(_draft_runs, world_size=2, timeout=600, shards=shards, target_dir=target_dir,
                          eagle3_target_dir=eagle3_target_dir, out=tmp_path)[0]
    one = {kind: tmp_path / f"one-{kind}" for kind in ONE_PROCESS}
    for kind, extra in ONE_PROCESS.items():
        target = target_dir if kind == "glide" else eagle3_target_dir
        assert main(draft_args(shards, target, one[kind], "--train.max_steps=3", "--train.grad_accum_steps=4",
                               *extra)) == 0
    if REFUSED:  # those runs are refused in one line naming the release that has it, before any rank starts work
        with pytest.raises(UserError, match=r"for a draft run needs torch >= 2\.13.*accepted: distributed.engine"):
            resolve_engine("fsdp2", DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                                             backend="gloo"), draft=True)
    message, written = res["glide-tp2"]
    why = "draft.kind = 'glide'" if compat.FSDP2_TRAINS_DRAFTS else "needs torch >= 2.13"  # the first refusal met
    alternatives = "'eagle3', 'dflash', 'dflash2', 'dspark', 'lilicorr' or 'xpress'"  # the kinds reading hidden states
    assert why in message and (not compat.FSDP2_TRAINS_DRAFTS or "per-head K/V" in message and alternatives in message)
    assert "\n" not in message and not written
    for name in DRAFT_ENGINES:
        got, run = res[name], tmp_path / name
        assert got["target_keys"] > 0 and got["draft_keys"] > 0
        assert got["target_same"] and got["draft_changed"], got
        # The same draft run as one process: lags and anchors are drawn per global micro-batch, not per rank.
        kind = _kind(name)
        ref = one[kind]
        accuracies = {"eagle3": ("acc_1", "acc_3"), "dflash": ("acc_1", "acc_5", "eal"),
                      "dflash2": ("acc_1", "acc_5", "eal", "selector_ce"),
                      "dspark": ("acc_1", "acc_5", "eal", "confidence_bce"),
                      "lilicorr": ("acc_1", "acc_5", "eal", "lattice_ce", "lattice_penalty"),
                      "xpress": ("acc_1", "acc_5", "eal", "refined_loss", "consistency_loss")}.get(kind, ())
        for key in ("loss", "draft_kl", "eval_loss", "eval_acc_1", "tau_sim", "grad_norm") + accuracies:
            a, b = records(ref, key), records(run, key)
            atol = KL_ATOL if key in ("loss", "draft_kl") else 0.0  # draft.loss = "kl": the loss is a KL too
            assert a.keys() == b.keys() and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL, abs_tol=atol) for s in a), (
                name, key, a, b)
        # Checkpoints hold the draft only; the export is the draft alone.
        names = _checkpoint_tensor_names(run / "checkpoints" / "step_3")
        assert names and not [k for k in names if "target" in k], name
        # treadle export rebuilds the run's own draft export from either checkpoint format, in one process.
        assert main(["export", str(run), "--to", "draft", str(tmp_path / f"{name}-export")]) == 0
        want, again = load_file(run / "draft" / "model.safetensors"), load_file(tmp_path / f"{name}-export" / "model.safetensors")
        assert want.keys() == again.keys() and all(torch.equal(want[k], again[k]) for k in want), name
