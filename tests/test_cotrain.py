"""A draft trained beside its target in the same step (draft.target = 'self', train/cotrain.py)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import args, records
from treadle.cli import main

FOUR_LAYERS = "{hidden_size=32,intermediate_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2}"
BESIDE = ("--draft.kind=eagle3", "--draft.target=self", "--draft.vocab_size=200", "--draft.eval_prompts=2",
          "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12")


def run_args(shards, out, *extra):
    return args(shards, out, f"--model.overrides={FOUR_LAYERS}", *extra)


def fit_float64(argv):
    """`treadle train ARGV` with the model (and a draft beside it) in float64: two runs that compute the target alike
    agree to the bit on any CPU."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.train.cotrain import BesideLoss
    from treadle.train.run import build_trainer, close_trainer

    trainer = build_trainer(load_config(None, argv[1:]))
    try:
        trainer.engine.module.double()
        if isinstance(trainer.loss_fn, BesideLoss):
            trainer.loss_fn.draft.model.draft_model.double()
        trainer.fit()
    finally:
        close_trainer(trainer)
        distributed.destroy()
    return trainer


def test_a_detached_draft_leaves_the_target_as_alone_and_a_joint_one_trains_it(shards, tmp_path):
    """float64: the target's losses and final weights with a detached draft beside it are those of the run alone; a
    joint draft's loss reaches the trunk (the same first step, another second). The draft's figures are logged and
    its export, next to the target's, loads against that target."""
    common = ("--train.max_steps=3", "--train.eval_every=3")
    alone = fit_float64(run_args(shards, tmp_path / "alone", *common))
    beside = fit_float64(run_args(shards, tmp_path / "beside", *common, *BESIDE))
    joint = fit_float64(run_args(shards, tmp_path / "joint", *common, *BESIDE, "--draft.joint=true",
                                 "--checkpoint.export_hf=false"))

    a, b = records(tmp_path / "alone"), records(tmp_path / "beside")
    assert a == b and len(a) == 3
    assert records(tmp_path / "alone", "eval_loss") == records(tmp_path / "beside", "eval_loss")
    wa, wb = alone.engine.module.state_dict(), beside.engine.module.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # The draft trained (its own loss, lr and acceptance beside the target's), and joint: the target's own loss is
    # the run alone's at step 1 and not after (the draft's gradient reached the trunk).
    for key in ("draft_loss", "draft_lr", "draft_grad_norm", "acc_1"):
        assert len(records(tmp_path / "beside", key)) == 3, key
    assert set(records(tmp_path / "beside", "tau_sim")) == {0, 3}
    draft_losses = records(tmp_path / "beside", "draft_loss")
    assert all(v > 0 for v in draft_losses.values())
    target = records(tmp_path / "joint", "target_loss")
    assert target[1] == a[1] and target[2] != a[2]
    assert records(tmp_path / "joint", "loss")[1] == pytest.approx(a[1] + 0.3 * records(tmp_path / "joint",
                                                                                         "draft_loss")[1], rel=1e-12)
    assert not (tmp_path / "joint" / "draft").exists()

    # Export: hf/ the target, draft/ the draft in the EAGLE layout naming that export as its target.
    from transformers import AutoModelForCausalLM

    from treadle.drafts.eagle3.model import load_eagle3
    from treadle.model_dirs import model_fingerprint

    hf, draft = tmp_path / "beside" / "hf", tmp_path / "beside" / "draft"
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    assert config["target"]["content_fingerprint"] == model_fingerprint(hf)
    loaded = load_eagle3(draft, AutoModelForCausalLM.from_pretrained(hf))  # checks the target's fingerprint too
    trained = beside.loss_fn.draft.draft.state_dict()
    got = loaded.draft_model.state_dict()
    assert got.keys() == trained.keys()
    assert all(torch.allclose(got[k].double(), trained[k].double(), atol=1e-6) for k in got)
    assert load_file(draft / "model.safetensors")["d2t"].shape == (200,)


def test_a_draft_beside_its_target_resumes_bit_for_bit(shards, tmp_path):
    """The draft's weights and optimizer ride in the run's checkpoint, its schedule in the train state: a run resumed
    at step 2 continues the target's and the draft's losses of the run that never stopped."""
    from treadle.checkpoint.safety import read_metadata

    a, b = tmp_path / "a", tmp_path / "b"
    common = ("--train.max_steps=4", "--train.eval_every=0", *BESIDE, "--draft.lr=1e-2")
    assert main(run_args(shards, a, *common, "--checkpoint.every=2")) == 0
    keys = list(read_metadata(a / "checkpoints" / "step_2" / "state").state_dict_metadata)
    assert any(k.startswith("draft.model.") for k in keys) and any(k.startswith("draft.optim.") for k in keys)
    assert main(run_args(shards, b, *common, f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    for key in ("loss", "draft_loss", "draft_lr"):
        ra, rb = records(a, key), records(b, key)
        assert [ra[s] for s in (3, 4)] == [rb[s] for s in (3, 4)], key
    assert records(a, "draft_lr")[1] == 1e-2
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # treadle export of such a checkpoint is the model's (the draft: the run's draft/); --to draft says so.
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    hf, again = load_file(a / "hf" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert hf.keys() == again.keys() and all(torch.equal(hf[k], again[k]) for k in hf)
    assert main(["export", str(a), str(tmp_path / "draft"), "--to", "draft"]) == 2


@pytest.mark.parametrize("bad, key", [
    (("--draft.kind=glide", "--draft.target=self"), "draft.kind = 'glide'"),
    ((*BESIDE, "--draft.features=/nowhere"), "draft.features"),
    ((*BESIDE, "--distributed.tensor_parallel=2"), "tensor_parallel"),
    ((*BESIDE, "--distributed.context_parallel=2"), "context_parallel"),
    ((*BESIDE, "--lora.rank=4"), "lora.rank"),
    ((*BESIDE, "--draft.weight=0.5"), "draft.weight"),
    (("--draft.joint=true",), "draft.joint"),
    (("--draft.kind=mtp", "--draft.target=self", "--draft.joint=true"), "draft.loss = 'kl'"),
])
def test_what_a_draft_beside_its_target_cannot_run_with_is_one_line(shards, tmp_path, capsys, bad, key):
    assert main(run_args(shards, tmp_path / "run", *bad)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "run").exists()


def test_shifted_labels_never_cross_a_packed_document():
    """MTP's step k at row t is scored against token t + k + 2: only where that token is in t's document and
    labelled (a packed row's documents restart their positions; the data marks each document's last label -100)."""
    from treadle.data.packed import IGNORE_INDEX
    from treadle.drafts.ttt import scored_rows

    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    doc = torch.cumsum((positions == 0).long(), -1)
    T = positions.shape[1]
    labels = torch.arange(T)[None].clone()  # labels[t] = token t + 1
    labels[:, :-1][doc[:, 1:] != doc[:, :-1]] = IGNORE_INDEX  # a document's last token predicts nothing
    labels[:, -1] = IGNORE_INDEX
    for k in range(3):
        want = [[bool(doc[0, t] == doc[0, t + 1 + k] and labels[0, t + 1 + k] != IGNORE_INDEX)
                 for t in range(T - 1 - k)]]
        assert scored_rows(positions, labels, k).tolist() == want, k
    assert not scored_rows(positions, labels, 0)[0, 2]  # row 2 (doc 1) would guess token 4, doc 2's first


DEEPSEEK = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=61,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=61, q_lora_rank=32,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=512,
                num_nextn_predict_layers=1, use_cache=False)  # 61 layers: where transformers reads the MTP layer


def safetensors_of(model_dir):
    """Every tensor a checkpoint directory holds, by name (whichever files it is split into)."""
    from treadle.models.checkpoint_files import safetensors_files

    return {n: t for f in safetensors_files(model_dir) for n, t in load_file(model_dir / f).items()}


# A joint MTP head beside a DeepSeek-V3 model built from its config alone (DEEPSEEK, saved as model.path).
MTP_BESIDE = ("--model.overrides={}", "--train.max_steps=2", "--train.micro_batch_size=2",
              "--train.eval_at_start=false", "--train.eval_batches=1", "--draft.kind=mtp", "--draft.target=self",
              "--draft.joint=true", "--draft.loss=ce", "--draft.ttt_steps=1", "--draft.gamma=1",
              "--draft.eval_prompts=2", "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12")


def test_mtp_pretraining_trains_the_mtp_layer_with_the_model_and_transformers_generates_with_it(shards, tmp_path):
    """A DeepSeek-V3 config with num_nextn_predict_layers, built from scratch, trains its MTP layer from step 0 with
    the MTP loss in the trunk's (x 0.3). The model's export hf/ (and treadle export of the run's checkpoint) carries
    the trained layer at model.layers.61.*: transformers' generate(use_mtp=True) runs it losslessly and a later mtp
    run takes hf/ as its draft.target, finding the layer there; draft/ is the stand-alone layout, no stitched copy."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from treadle.config.draft import DraftConfig
    from treadle.drafts.mtp.model import build_mtp, load_mtp

    DeepseekV3Config(**DEEPSEEK).save_pretrained(tmp_path / "config")
    run = tmp_path / "run"
    assert main(args(shards, run, f"--model.path={tmp_path / 'config'}", *MTP_BESIDE, "--train.grad_accum_steps=1",
                     "--checkpoint.every=2")) == 0
    loss, target, draft = records(run), records(run, "target_loss"), records(run, "draft_loss")
    assert all(loss[s] == pytest.approx(target[s] + 0.3 * draft[s], rel=1e-6) for s in (1, 2))
    hf = run / "hf"
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not (run / "draft" / "stitched").exists()  # hf/ is that layout: no second copy of the model
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    mine = load_mtp(run / "draft", model).draft_model.state_dict()  # draft/ names hf/ as its target (checked)
    shipped = build_mtp(DraftConfig(kind="mtp", target=str(hf)), 512, None)[0]  # a later mtp run on hf/
    assert shipped.origin == "MTP module: the layer the target ships"
    theirs = shipped.draft_model.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in mine)
    # treadle export of the run's checkpoint writes the same model, its layer included.
    assert main(["export", str(run / "checkpoints" / "step_2"), str(tmp_path / "again")]) == 0
    exported, again = safetensors_of(hf), safetensors_of(tmp_path / "again")
    assert any(k.startswith("model.layers.61.eh_proj") for k in exported)
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)

    from transformers import modeling_layers

    if not hasattr(modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MTP generation (generate(use_mtp=True)): hf/ checked above")
    layer = modeling_layers.MtpModel.from_pretrained(model).layers[0].state_dict()
    assert layer.keys() == mine.keys() and all(torch.equal(layer[k], mine[k]) for k in mine)
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=12, do_sample=False, use_cache=True, attention_mask=torch.ones(1, 8, dtype=torch.long))
    assert torch.equal(model.generate(prompt, use_mtp=True, **kw), model.generate(prompt, **kw))


def _runs(rank, world_size, runs):
    from treadle.config import load_config
    from treadle.train.run import run_training

    for argv in runs:  # one launch, several runs: each rank's imports are paid once
        run_training(load_config(None, argv[1:]))
    return rank


def test_a_draft_beside_its_target_matches_one_process_on_every_engine(shards, tmp_path, monkeypatch):
    """2 ranks x GA 1 == one process x GA 2, on DDP, FSDP2 (detached; joint EAGLE-3, and joint MTP, whose head is the
    target's, read whole into the backward) and ZeRO-3: the target's and the draft's losses and gradient norms, and
    the draft's exported weights (its gradients summed over the ranks by the draft itself, outside the engine).
    ZeRO-3's checkpoint carries the draft beside DeepSpeed's files: resumed at step 2, step 3 is the run's that
    never stopped."""
    from transformers import DeepseekV3Config

    from tests.distributed import run_distributed

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    DeepseekV3Config(**{**DEEPSEEK, "num_hidden_layers": 2, "first_k_dense_replace": 2}).save_pretrained(
        tmp_path / "config")  # two layers (no transformers generate here, which reads the MTP layer at 61)
    joint, zero3 = ("--draft.joint=true",), ("--distributed.engine=deepspeed", "--distributed.zero_stage=3")
    resume = f"--checkpoint.resume={tmp_path / 'zero3' / 'checkpoints' / 'step_2'}"
    runs = {"ddp": ("--distributed.engine=ddp",), "fsdp2": ("--distributed.engine=fsdp2",),
            "fsdp2-joint": ("--distributed.engine=fsdp2", *joint), "zero3": (*zero3, "--checkpoint.every=2"),
            "zero3-resumed": (*zero3, resume), "fsdp2-mtp": ("--distributed.engine=fsdp2",),
            "zero3-mtp": (*zero3, "--checkpoint.every=2")}

    def argv(name, *extra):
        if "mtp" in name:
            return args(shards, tmp_path / name, f"--model.path={tmp_path / 'config'}", *MTP_BESIDE, *extra)
        return run_args(shards, tmp_path / name, "--train.max_steps=3", *BESIDE, *extra)

    run_distributed(_runs, world_size=2, timeout=400, runs=[
        argv(name, "--train.grad_accum_steps=1", "--train.threads=1", *extra) for name, extra in runs.items()])
    for name, extra in (("one", ()), ("one-joint", joint), ("one-mtp", ())):
        assert main(argv(name, *extra)) == 0
    pairs = (("ddp", "one"), ("fsdp2", "one"), ("fsdp2-joint", "one-joint"), ("fsdp2-mtp", "one-mtp"),
             ("zero3", "one"), ("zero3-resumed", "zero3"), ("zero3-mtp", "one-mtp"))
    for two, one in pairs:
        for key in ("loss", "grad_norm", "draft_loss", "draft_grad_norm", "eval_loss", "tau_sim"):
            a, b = records(tmp_path / one, key), records(tmp_path / two, key)
            if two == "zero3-resumed":
                a = {s: v for s, v in a.items() if s in b}
                assert 3 in b, key
            assert a.keys() == b.keys() and a == pytest.approx(b, rel=1e-5, abs=1e-7), (two, key)
        wa, wb = (load_file(tmp_path / run / "draft" / "model.safetensors") for run in (one, two))
        assert wa.keys() == wb.keys()
        # Adam divides by the root of a gradient's square: where it is fp32 noise (an expert few tokens reach), the
        # noise is amplified up to the lr; 1e-5 is what 2 steps at lr 5e-3 leave of it here (2e-6 seen).
        assert all(torch.allclose(wa[k].double(), wb[k].double(), rtol=1e-4, atol=1e-5) for k in wa), two
    # joint: the draft's loss reached the target (its loss after step 1 is not the detached run's)
    assert records(tmp_path / "fsdp2-joint", "target_loss")[2] != records(tmp_path / "fsdp2", "loss")[2]
    # treadle export of a ZeRO-3 checkpoint puts the MTP layer it trained (from companions/) into the model, as hf/
    assert main(["export", str(tmp_path / "zero3-mtp" / "checkpoints" / "step_2"), str(tmp_path / "exported")]) == 0
    hf, exported = safetensors_of(tmp_path / "zero3-mtp" / "hf"), safetensors_of(tmp_path / "exported")
    layer = [k for k in hf if k.startswith("model.layers.2.")]  # the MTP layer, after the model's two
    assert layer and hf.keys() == exported.keys() and all(torch.equal(hf[k], exported[k]) for k in hf)


def test_draft_trainer_steps_a_draft_beside_a_loop_it_does_not_own_and_publishes_it(tmp_path):
    """The Python entry point: the loop's forward is tapped (no second target forward), the target is untouched by
    the draft, the published layout loads against the target, and a directory treadle did not write is refused."""
    import runpy

    from transformers import LlamaConfig, LlamaForCausalLM

    from treadle import DraftTrainer, UserError
    from treadle.drafts.eagle3.model import load_eagle3

    example = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "draft_beside_rl.py"))
    example["main"](tmp_path / "rl", updates=2, publish_every=2)
    assert json.loads((tmp_path / "rl" / "draft" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"]

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    drafter = DraftTrainer(target, "eagle3", lr=1e-2, ttt_steps=2)
    forwards = []
    target.register_forward_hook(lambda *_: forwards.append(1))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    rows = torch.randint(0, 256, (2, 16))
    with drafter.reading():
        target(input_ids=rows).logits.sum().backward()  # the loop's own forward and backward
    got = drafter.step(rows)
    assert len(forwards) == 1 and got["draft_loss"] > 0 and "acc_1" in got and got["draft_lr"] == 1e-2
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    grads = {n: p.grad.clone() for n, p in target.named_parameters()}  # the loop's, untouched by the draft's backward
    drafter.step(rows)  # no reading this time: the target runs once more, without grad
    assert len(forwards) == 2 and all(torch.equal(grads[n], p.grad) for n, p in target.named_parameters())

    published = drafter.publish(tmp_path / "served")
    loaded = load_eagle3(published, target)
    mine = drafter.model.state_dict()
    assert all(torch.equal(loaded.draft_model.state_dict()[k], mine[k]) for k in mine)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="treadle replaces only its own"):
        drafter.publish(foreign)
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1


def test_a_rollback_takes_the_draft_back_with_the_run(shards, tmp_path):
    """Two bad steps (3, 4) roll the run back to step 2: the draft's schedule (and weights, optimizer) come back
    with it, so the step trained again as 3 has the draft lr of step 3, not of the step the bad stretch reached."""
    run = tmp_path / "run"
    assert main(run_args(shards, run, "--train.max_steps=5", "--checkpoint.every=2", "--checkpoint.keep_last=10",
                         "--resilience.nan_policy=rollback", "--resilience.max_consecutive_bad=2",
                         "--resilience.inject_nan_steps=[3,4]", "--train.eval_every=0", "--schedule.decay=linear",
                         *BESIDE)) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    draft_lrs = [(r["step"], r["draft_lr"]) for r in lines if "draft_lr" in r]
    assert [s for s, _ in draft_lrs] == [1, 2, 3, 4, 3, 4, 5]
    assert draft_lrs[4][1] == draft_lrs[2][1] and draft_lrs[5][1] == draft_lrs[3][1]  # the schedule came back too
    assert all(math.isfinite(r["draft_loss"]) for r in lines if r.get("step", 0) >= 3 and "draft_loss" in r)
