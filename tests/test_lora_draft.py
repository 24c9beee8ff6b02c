"""LoRA adapters on a trained draft (``draft.init`` with ``[lora]``; models/lora.py, docs/lora.md): the adapted
draft starts as its base, checkpoints hold adapters only and name the base draft, resume is exact, ``spec-eval
--draft BASE --adapter DIR`` decodes with what the run trained, and another base draft is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import SPEC_EVAL, draft_args, records
from treadle.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

# Each kind's small settings (as tests/test_eagle3.py, test_dflash.py and test_dspark.py run them).
KINDS = {
    "eagle3": ("--draft.kind=eagle3",),
    "dflash": ("--draft.kind=dflash", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4"),
    "dspark": ("--draft.kind=dspark", "--draft.block_size=5", "--draft.num_layers=2", "--draft.gamma=4"),
}
LORA = ("--lora.rank=4", "--lora.alpha=8", "--optim.lr=5e-2")


def _spec_eval(target, draft, out, *extra) -> dict:
    assert main([*SPEC_EVAL, "--target", str(target), "--draft", str(draft), "--num-prompts", "2", "--gamma", "4",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _checkpoint_names(ckpt) -> list[str]:
    from treadle.checkpoint.safety import read_metadata

    return list(read_metadata(ckpt / "state").state_dict_metadata)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_adapted_draft_starts_as_its_base_checkpoints_adapters_only_and_spec_eval_applies_it(
        kind, shards, eagle3_target_dir, tmp_path):
    target, base, run = eagle3_target_dir, tmp_path / "base", tmp_path / "lora"
    assert main(draft_args(shards, target, base, "--train.max_steps=2", *KINDS[kind])) == 0
    assert main(draft_args(shards, target, run, "--train.max_steps=3", "--checkpoint.every=3", *KINDS[kind],
                           f"--draft.init={base}", *LORA)) == 0
    # B starts at zero: the adapted draft's eval before any update is the base draft's last, exactly.
    assert records(run, "eval_loss")[0] == records(base, "eval_loss")[2]
    assert records(run, "tau_sim")[0] == records(base, "tau_sim")[2]
    # The checkpoint holds the adapters (and their optimizer state) of the draft module only: no target, no base.
    names = _checkpoint_names(run / "checkpoints" / "step_3")
    weights = [n for n in names if n.startswith("model.")]
    assert weights and all(n.startswith("model.draft_model.") and (".lora_A." in n or ".lora_B." in n) for n in weights)
    meta = json.loads((run / "checkpoints" / "step_3" / "train_state.json").read_text())["meta"]
    assert meta["base"]["draft_kind"] == kind and meta["base_fingerprint"] == meta["base"]["fingerprint"]
    # The export: a PEFT adapter directory beside (not copying) the base draft, naming the base draft.
    adapter = run / "adapter"
    assert not (run / "draft").exists() and (adapter / "adapter_config.json").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    # all-linear leaves the output heads out: the LM head, and DSpark's 1-output confidence head and Markov head
    assert not {"lm_head", "confidence", "markov_w2"} & set(config["target_modules"]) and config["r"] == 4
    assert {"q_proj", "down_proj"} <= set(config["target_modules"])
    assert json.loads((adapter / "treadle_adapter.json").read_text())["base"]["fingerprint"] == meta["base_fingerprint"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in tensors.items())  # trained: B moved off zero
    # spec-eval with the adapter is lossless; the merged draft is a draft of the kind's layout, unlike the base.
    got = _spec_eval(target, base, tmp_path / "a.json", "--adapter", str(adapter))
    assert got["lossless"] is True and got["drafter"] == kind and got["adapter"] == str(adapter)
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    merged, plain = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base / "draft" / "model.safetensors")
    assert merged.keys() == plain.keys() and any(not torch.equal(merged[k], plain[k]) for k in plain)
    assert _spec_eval(target, tmp_path / "merged", tmp_path / "m.json")["lossless"] is True


def test_eagle3_adapter_resumes_exactly_decodes_as_trained_and_refuses_another_base(
        shards, eagle3_target_dir, tmp_path, capsys):
    from treadle.config import load_config
    from treadle.drafts.registry import load_draft
    from treadle.models.hf import load_causal_lm
    from treadle.speculative.evaluate import adapt_drafter
    from treadle.train.run import build_trainer, close_trainer

    target, base, a, b = eagle3_target_dir, tmp_path / "base", tmp_path / "a", tmp_path / "b"
    assert main(draft_args(shards, target, base, "--train.max_steps=2", *KINDS["eagle3"])) == 0
    lora = (*KINDS["eagle3"], f"--draft.init={base}", *LORA)
    trainer = build_trainer(load_config(None, draft_args(shards, target, a, "--train.max_steps=4",
                                                         "--checkpoint.every=2", *lora)[1:]))
    try:
        trainer.fit()
        live = trainer.engine.module.eval()  # the trained DraftRunModel, the adapters in its draft module
    finally:
        close_trainer(trainer)
    # Only the draft module was wrapped: the target has no PEFT layer and stays frozen.
    assert not any("lora_" in n for n, _ in live.target.named_modules())
    assert all(not p.requires_grad for p in live.target.parameters())
    # Resume from step 2 elsewhere: steps 3 and 4 bit for bit, and the same adapter.
    assert main(draft_args(shards, target, b, "--train.max_steps=4", *lora,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert sorted(records(b)) == [3, 4] and all(records(a)[s] == records(b)[s] for s in (3, 4))
    wa, wb = load_file(a / "adapter" / "adapter_model.safetensors"), load_file(b / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # spec-eval's adapter path (base draft loaded, PEFT applies the adapter) scores as the trained run; the base not.
    texts = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    model = load_draft(base / "draft", load_causal_lm(target, "--target")).eval()
    with torch.no_grad():
        before = model(texts, positions).logits[0]
        drafter = type("D", (), {"model": model})()
        adapt_drafter(drafter, str(base), a / "adapter")
        after, want = model(texts, positions).logits[0], live(texts, positions).logits[0]
    assert torch.allclose(after, want, rtol=0, atol=1e-5) and not torch.allclose(after, before, atol=1e-4)

    # Another base draft where draft.init was: resume, export and spec-eval --adapter refuse it in one line.
    other = tmp_path / "other"
    assert main(draft_args(shards, target, other, "--train.max_steps=3", *KINDS["eagle3"], "--train.seed=1")) == 0
    shutil.rmtree(base / "draft")
    shutil.copytree(other / "draft", base / "draft")
    capsys.readouterr()
    for argv in (draft_args(shards, target, a, "--train.max_steps=6", *lora, "--checkpoint.allow_schedule_change=true"),
                 ["export", str(a), str(tmp_path / "x"), "--merge"],
                 ["spec-eval", "--target", str(target), "--draft", str(base), "--adapter", str(a / "adapter"),
                  "--num-prompts", "1", "--max-new-tokens", "8"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "was trained on another base model (the eagle3 draft for llama: weights_fingerprint " in err, err
        assert "then," in err and "hidden_size" not in err and len(err.splitlines()) == 1, err  # only what differs


def test_draft_adapters_are_refused_in_one_line_where_they_do_not_work(shards, target_dir, tmp_path, capsys):
    checks = [
        (("--draft.kind=eagle3", "--lora.rank=4"), "lora.rank with draft.kind = 'eagle3' and no draft.init"),
        (("--draft.kind=glide", "--lora.rank=4", f"--draft.init={tmp_path}"),
         "lora.rank with draft.kind = 'glide': not built for GLIDE"),
        (("--draft.kind=mtp", "--lora.rank=4"), "lora.rank with draft.kind = 'mtp': an MTP head is served"),
    ]
    for extra, want in checks:
        assert main(draft_args(shards, target_dir, tmp_path / "r", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and len(err.splitlines()) == 1, err
    assert main(["spec-eval", "--target", str(target_dir), "--draft", "prompt-lookup", "--adapter", str(tmp_path)]) == 2
    assert "an adapter adapts a treadle draft" in capsys.readouterr().err
