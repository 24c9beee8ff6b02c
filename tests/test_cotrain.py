"""A draft trained beside its target in the same step (draft.target = 'self', train/cotrain.py)."""

import json

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


@pytest.mark.parametrize("bad, key", [
    (("--draft.kind=glide", "--draft.target=self"), "draft.kind = 'glide'"),
    ((*BESIDE, "--draft.features=/nowhere"), "draft.features"),
    ((*BESIDE, "--distributed.tensor_parallel=2"), "tensor_parallel"),
    ((*BESIDE, "--distributed.engine=fsdp2"), "fsdp2"),
    ((*BESIDE, "--lora.rank=4"), "lora.rank"),
    ((*BESIDE, "--draft.weight=0.5"), "draft.weight"),
    (("--draft.joint=true",), "draft.joint"),
])
def test_what_a_draft_beside_its_target_cannot_run_with_is_one_line(shards, tmp_path, capsys, bad, key):
    assert main(run_args(shards, tmp_path / "run", *bad)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "run").exists()
