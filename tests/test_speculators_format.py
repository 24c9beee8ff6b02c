"""The speculators format (drafts/speculators_format.py, drafts/eagle3/speculators.py) against speculators' own loader.

speculators 0.9.0 pins torch <= 2.14.1, transformers <= 5.19 and datasets <= 5.1.0: the oldest end satisfies the
first two but carries datasets 5.2.0, so the package is not installed into a venv. ``make test-oldest`` unpacks it
and the few modules it imports (constraints-speculators.txt) with ``pip install --no-deps --target
.venv-oldest/speculators``; its loader then runs in a subprocess of the oldest venv's python with that directory on its
path (its imports stay out of this process). At the newest end (torch 2.15, transformers 5.24) the contract test
skips in one line: speculators does not support those releases. The other tests here need no speculators.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file, save_file

import transformers
from treadle.drafts.eagle3 import speculators as eagle3_speculators
from treadle.drafts.eagle3.model import load_eagle3
from treadle.drafts.registry import KINDS
from treadle.errors import UserError

from tests.test_eagle3_layout import DRAFT_VOCAB, LAYERS, TARGET, T, exported_draft

SPECULATORS = Path(os.environ.get("TREADLE_SPECULATORS", Path(sys.prefix) / "speculators"))

# speculators' side, run in its own process: its loader on the export, its forward's first TTT step's logits.
LOADER = """
import sys, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
out, inputs = sys.argv[1], load_file(sys.argv[2])
config = SpeculatorModelConfig.from_pretrained(out)
config.transformer_layer_config._attn_implementation = "eager"  # its flex-attention default compiles on the CPU
model = SpeculatorModel.from_pretrained(out, config=config).eval()
logits = []
model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
with torch.no_grad():
    model(inputs["aux"], inputs["ids"], torch.zeros_like(inputs["ids"]), position_ids=inputs["positions"], ttt_steps=1)
maps = {} if model.d2t is None else {"d2t": model.d2t.contiguous()}  # a full vocabulary: no map
save_file({"logits": logits[0].contiguous(), **maps}, sys.argv[3])
print(type(model).__name__, type(config).__name__)
"""


def _runnable() -> str | None:
    """Why speculators' loader cannot run here (None: it can)."""
    torch_version = Version(torch.__version__.split("+")[0])
    if torch_version > Version("2.14.1") or Version(transformers.__version__) > Version("5.19"):
        return (f"speculators 0.9.0 pins torch <= 2.14.1 and transformers <= 5.19 (here {torch.__version__}, "
                f"{transformers.__version__}): its contract test runs at the oldest end (make test-oldest)")
    if not (SPECULATORS / "speculators").is_dir():
        return f"speculators 0.9.0 is not unpacked at {SPECULATORS} (make test-oldest puts it there)"
    return None


@pytest.fixture(params=[DRAFT_VOCAB, None], ids=["reduced", "full"])
def exported(tmp_path, request):
    """(Eagle3Model, target, speculators export dir): tests/test_eagle3_layout.py's random EAGLE-3 draft of an 8-layer
    llama3-rotary target, its head over DRAFT_VOCAB tokens (a d2t map) or the whole vocabulary."""
    return exported_draft(tmp_path, request.param, to="speculators", ttt_steps=4)


def test_the_export_is_speculators_eagle3_config_and_names(exported):
    model, target, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4}]
    assert config["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    # the verifier as the run named it: speculators' from_pretrained loads its embedding from there
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(out.parent / "target"),
                                                        "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 512
    assert config["draft_vocab_size"] == model.draft_model.vocab_size
    assert set(load_file(str(out / "model.safetensors"))) == eagle3_speculators.NAMES


def test_draft_init_and_spec_eval_read_the_speculators_export_as_the_draft_it_was(exported):
    model, target, out = exported
    loaded = load_eagle3(out, target).draft_model
    for (name, want), (_, got) in zip(model.draft_model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(want, got), name


def test_a_kind_without_a_speculators_layout_or_a_name_mismatch_is_refused_before_writing(exported, tmp_path):
    model, target, out = exported
    accepted = [k for k, kind in KINDS.items() if kind.speculators is not None]
    assert {"eagle3", "dflash", "dflash2", "dspark", "xpress"} <= set(accepted) and "glide" not in accepted
    from treadle.drafts import speculators_format
    from treadle.drafts.registry import speculators_table

    with pytest.raises(UserError, match=r"draft.kind = 'glide' has no speculators layout \(.*\); accepted: .*'eagle3'"):
        speculators_table(KINDS["glide"])
    weights = {k[len("draft_model."):]: v for k, v in model.state_dict().items() if k.startswith("draft_model.")}
    weights.pop("fc.weight")
    with pytest.raises(UserError, match="missing"):
        eagle3_speculators.export(model.draft_model, weights, target, torch.float32, {})
    bad = json.loads((out / "config.json").read_text())
    bad["norm_output"] = True
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match=r"norm_output"):
        load_eagle3(out, target)


@pytest.mark.skipif(_runnable() is not None, reason=_runnable() or "")
def test_speculators_own_loader_loads_the_export_and_its_forward_agrees(exported, tmp_path):
    model, target, out = exported
    ids = torch.randint(0, TARGET["vocab_size"], (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        ours = model(ids, torch.arange(T)[None], steps=1).logits[0]
    # treadle's row t reads token t's features and token t + 1's embedding; speculators' row t reads input_ids[t].
    inputs = {"aux": torch.cat([hidden[i] for i in LAYERS], -1)[:, : T - 1].contiguous(),
              "ids": ids[:, 1:].contiguous(),
              "positions": torch.arange(T - 1)[None]}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(SPECULATORS)}
    run = subprocess.run([sys.executable, "-c", LOADER, str(out), str(tmp_path / "inputs.safetensors"),
                          str(tmp_path / "theirs.safetensors")], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[:2] == ["Eagle3DraftModel", "Eagle3SpeculatorConfig"]
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    torch.testing.assert_close(theirs["logits"], ours[:, : T - 1], rtol=0, atol=1e-5)
    draft = model.draft_model
    if draft.reduced:  # its proposals are the same target ids
        assert torch.equal(theirs["d2t"] + torch.arange(draft.vocab_size), draft.draft_to_target())
    else:
        assert "d2t" not in theirs
