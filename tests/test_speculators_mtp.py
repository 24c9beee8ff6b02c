"""The speculators format of an MTP module (drafts/mtp/speculators.py) against speculators' own loader, both ways.

As tests/test_speculators_format.py: speculators 0.9.0 runs at the oldest end only, in a subprocess of the oldest
venv's python with ``.venv-oldest/speculators`` on its path; the other tests need no speculators. The target is
tests/test_mtp_qwen3_next.py's hybrid Qwen3-Next (a Gated-DeltaNet layer, then full attention; a MoE MLP).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_mtp_qwen3_next import HYBRID, qwen3_next
from tests.test_speculators_format import SPECULATORS, _runnable
from treadle.checkpoint.export import export_draft
from treadle.config.schema import DraftConfig
from treadle.drafts import registry
from treadle.drafts.mtp import speculators
from treadle.drafts.mtp.model import MtpDraft, MtpModel
from treadle.drafts.targets import target_identity
from treadle.errors import UserError

T = 12
TREADLE_KEYS = ("treadle_draft_kind", "target", "target_config", "training")

# speculators' side: its loader, its teacher-forced forward (step 0's logits), its own save of the module.
LOADER = """
import sys, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
out, inputs, saved, result = sys.argv[1:]
inputs = load_file(inputs)
model = SpeculatorModel.from_pretrained(out, config=SpeculatorModelConfig.from_pretrained(out)).eval()
with torch.no_grad():
    logits = model(inputs["ids"], inputs["hidden"])[0]
save_file({"step0": logits[0].contiguous()}, result)
model.save_pretrained(saved)
print("loaded", type(model).__name__, len(logits))
"""


@pytest.fixture
def exported(tmp_path):
    """(MtpModel with every weight drawn, export dir): the module of a hybrid Qwen3-Next target, exported
    ``--to speculators`` with 2 replayed steps."""
    target = qwen3_next(HYBRID)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    torch.manual_seed(1)
    draft = MtpDraft(target)
    for p in draft.parameters():  # a wrong norm, concat order or expert changes the logits
        torch.nn.init.normal_(p, std=0.3 if p.dim() >= 2 else 0.1)
    model = MtpModel(target, draft).eval()
    out = tmp_path / "speculators"
    export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, target),
                 DraftConfig(kind="mtp", target=str(target_dir), ttt_steps=2), step=0, to="speculators")
    return model, out


def test_the_export_is_speculators_mtp_and_reads_back_as_the_same_module(exported):
    model, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["architectures"] == ["MTPDraftModel"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 2}]
    assert config["transformer_layer_config"]["model_type"] == "qwen3_next"
    assert config["transformer_layer_config"]["layer_types"] == HYBRID  # the verifier's own config
    tensors = load_file(str(out / "model.safetensors"))
    assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight",
            "mtp_layers.0.hidden_layernorm.weight", "mtp_layers.0.final_layernorm.weight",
            "mtp_layers.0.mlp.experts.gate_up_proj", "mtp_layers.0.self_attn.q_proj.weight"} <= tensors.keys()
    assert all(k.startswith("mtp_layers.0.") for k in tensors)
    for strip in (False, True):  # treadle's export, and one without treadle's keys (trained with speculators)
        if strip:
            (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TREADLE_KEYS}))
        assert registry.read_draft_config(out)["treadle_draft_kind"] == "mtp"
        loaded = registry.load_draft(out, model.target).draft_model
        for name, want in model.draft_model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], want), name
    save_file({**tensors, "lm_head.weight": torch.zeros(1), "model.norm.weight": torch.zeros(1)},
              str(out / "model.safetensors"))
    with pytest.raises(UserError, match=r"holds \['model.norm.weight'\], not speculators' MTP layer"):
        registry.load_draft(out, model.target)


def test_a_deepseek_module_is_refused_in_one_line():
    from tests.test_mtp import tiny_target

    target = tiny_target()
    reason = speculators.refusal(MtpDraft(target), target.config)
    assert reason.startswith("speculators 0.9.0's MTPDraftModel has no 'deepseek_v3' layer")


@pytest.mark.skipif(_runnable() is not None, reason=_runnable() or "")
def test_speculators_own_loader_loads_the_export_its_forward_agrees_and_its_save_imports(exported, tmp_path):
    model, out = exported
    ids = torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T)[None]
    with torch.no_grad():
        hidden = model._target_forward(ids, pos)  # the target's final (normed) state: what the module reads
        ours = model(ids, pos, steps=1).logits[0]
    save_file({"ids": ids, "hidden": hidden.contiguous()}, str(tmp_path / "inputs.safetensors"))
    run = subprocess.run([sys.executable, "-c", LOADER, str(out), str(tmp_path / "inputs.safetensors"),
                          str(tmp_path / "saved"), str(tmp_path / "theirs.safetensors")],
                         env={**os.environ, "PYTHONPATH": str(SPECULATORS)}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("loaded ")] == [
        ["MTPDraftModel", "2"]]
    # speculators' step 0, row t: token t + 1's embedding and the target's state at t, guessing token t + 2 (its
    # rows stop where step 2's targets would run out)
    theirs = load_file(str(tmp_path / "theirs.safetensors"))["step0"]
    torch.testing.assert_close(theirs, ours[:, : theirs.shape[1]], rtol=1e-5, atol=1e-5)
    saved = tmp_path / "saved"
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TREADLE_KEYS}))
    loaded = registry.load_draft(saved, model.target).draft_model
    for name, want in model.draft_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], want), name
