"""The speculators format of the kinds on DFlash's backbone (drafts/speculators_format.py ``BlockTable``;
drafts/{dflash,dflash2,dspark}/speculators.py) against speculators' own loader and model code, both ways.

As tests/test_speculators_format.py (EAGLE-3): speculators 0.9.0 runs at the oldest end only, in a subprocess of the
oldest venv's python with ``.venv-oldest/speculators`` on its path (``make test-oldest`` unpacks it); at the newest
end that test skips in one line. The config, refusal and read-back tests need no speculators.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_dflash import dflash
from tests.test_dflash2 import dflash2
from tests.test_dspark import dspark
from tests.test_speculators_format import SPECULATORS, _runnable
from treadle.checkpoint.export import export_draft
from treadle.config.schema import DraftConfig
from treadle.drafts import registry
from treadle.drafts.glide.model import document_ids
from treadle.drafts.targets import target_identity
from treadle.errors import UserError

T = 14
BUILDERS = {"dflash": dflash, "dflash2": dflash2, "dspark": dspark}
TREADLE_KEYS = ("treadle_draft_kind", "target", "target_config", "training")  # what a draft trained elsewhere lacks

# speculators' side, in its own process, per export directory: its loader, its training forward on every anchor of
# one row (the losses replaced by a recorder of what reaches them: the draft's logits, DSpark's confidence logits,
# DFlash2's selector scores), and its own save_pretrained of the loaded draft.
LOADER = """
import importlib, sys, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
inputs = load_file(sys.argv[1])
for out, saved, result in zip(*[iter(sys.argv[2:])] * 3):
    config = SpeculatorModelConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # its flex-attention default compiles on the CPU
    model = SpeculatorModel.from_pretrained(out, config=config).eval()
    seen = {}
    def record(*args, **kwargs):
        seen.update({f"arg{i}": a for i, a in enumerate(args)}, **kwargs)
        return torch.zeros(()), {}
    importlib.import_module(type(model).__module__).compute_metrics = record
    ids = inputs["ids"]
    anchors = ids.shape[1] - model.block_size  # every position but the last block's: all anchors, sorted
    with torch.no_grad():
        model(inputs["aux"], ids, torch.ones_like(ids), inputs["last"], torch.zeros_like(ids),
              position_ids=torch.arange(ids.shape[1])[None], max_anchors=anchors)
    save_file({k: v.contiguous() for k, v in seen.items() if isinstance(v, torch.Tensor)}, result)
    model.save_pretrained(saved)
    print("loaded", type(model).__name__, type(config).__name__)
"""


def _export(tmp_path, kind: str, **kwargs):
    """(run model, export dir): the tests' random ``kind`` draft of a 4-layer Llama target (saved beside it, the
    verifier speculators loads the embedding and head from), exported ``--to speculators``."""
    model = BUILDERS[kind](**kwargs)
    target_dir = tmp_path / f"target-{kind}"
    model.target.save_pretrained(target_dir)
    out = tmp_path / f"{kind}-speculators"
    export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, model.target),
                 DraftConfig(kind=kind, target=str(target_dir)), step=0, to="speculators")
    return model, out


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_the_export_is_speculators_config_and_names(tmp_path, kind):
    model, out = _export(tmp_path, kind)
    draft = model.draft_model
    config = json.loads((out / "config.json").read_text())
    anchored = kind == "dspark"  # speculators' sample_from_anchor: DSpark's every slot drafts
    assert config["speculators_model_type"] == kind and config["speculators_version"] == "0.9.0"
    assert config["speculators_config"]["algorithm"] == kind
    assert config["speculators_config"]["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": draft.block_size - (0 if anchored else 1)}]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / f"target-{kind}")
    # output_hidden_states indices, as speculators' DFlash converter makes them from z-lab's ids (+ 1)
    assert config["aux_hidden_state_layer_ids"] == [1, 3] == list(draft.feature_layers)
    assert config["sample_from_anchor"] is anchored and config["block_size"] == draft.block_size
    assert config["mask_token_id"] == 511 and config["draft_vocab_size"] == 512
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["vocab_size"] == 512 and layer["num_hidden_layers"] == 2
    assert not {"dflash_config", "architectures", "auto_map", "block_size", "target_layer_ids"} & layer.keys()
    assert config["treadle_draft_kind"] == kind and config["target"]["config_fingerprint"]
    tensors = load_file(str(out / "model.safetensors"))
    # the engine layout's names (speculators' models use z-lab's / DeepSpec's), no embedding, head or vocabulary map
    engine = registry.kind(kind).export(draft, dict(draft.state_dict()), model.target.config, torch.float32, "fp32",
                                        {})[0]
    assert tensors.keys() == engine.keys()
    assert not {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"} & tensors.keys()
    assert not (out / "dflash.py").exists()  # the engine layout's remote code: no auto_map names it here


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_speculators_draft_from_elsewhere_imports_as_the_draft_it_was(tmp_path, kind):
    """A speculators-format directory without treadle's metadata (a draft trained with speculators) is read by the
    kind's reader and loads with draft.init's loader as the same draft."""
    model, out = _export(tmp_path, kind)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TREADLE_KEYS}))
    found = registry.read_draft_config(out)
    assert found["treadle_draft_kind"] == kind
    loaded = registry.load_draft(out, model.target).draft_model
    assert loaded.feature_layers == (1, 3) and loaded.block_size == model.draft_model.block_size
    for name, want in model.draft_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], want), name


def test_variants_treadle_does_not_compute_are_refused_in_one_line(tmp_path):
    model, out = _export(tmp_path, "dflash")
    config = json.loads((out / "config.json").read_text())
    for change, match in (({"sample_from_anchor": True}, "sample_from_anchor = True; accepted: False"),
                          ({"draft_vocab_size": 100}, "draft_vocab_size = 100"),
                          ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids = None")):
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=match):
            registry.load_draft(out, model.target)
    headless = dflash2()
    headless.draft_model.drop_selector()
    with pytest.raises(UserError, match="no candidate selector.*nothing was written"):
        _export_model(tmp_path, headless, "dflash2")
    assert not (tmp_path / "dflash2-headless").exists()
    from transformers import Gemma2Config

    from treadle.drafts.speculators_format import logit_transform_refusal

    assert "softcap" in logit_transform_refusal(None, Gemma2Config(final_logit_softcapping=30.0))
    assert logit_transform_refusal(None, model.target.config) is None
    with pytest.raises(UserError, match=r"draft.kind = 'glide' has no speculators layout \(speculators 0.9.0 "):
        registry.speculators_table(registry.kind("glide"))
    with pytest.raises(UserError, match=r"'lilicorr' has no speculators layout \(speculators 0.9.0 "):
        registry.speculators_table(registry.kind("lilicorr"))


def _export_model(tmp_path, model, kind):
    target_dir = tmp_path / f"target-{kind}-headless"
    model.target.save_pretrained(target_dir)
    return export_draft(model, model.state_dict(), tmp_path / f"{kind}-headless", target_dir,
                        target_identity(target_dir, model.target), DraftConfig(kind=kind, target=str(target_dir)),
                        to="speculators")


def _treadle_side(kind: str, model, ids: torch.Tensor) -> dict:
    """What speculators' forward records, computed by treadle's draft on the same row and anchors."""
    bs = model.draft_model.block_size
    pos = torch.arange(T)[None]
    anchors = torch.arange(T - bs)[None]
    with torch.no_grad():
        if kind == "dspark":
            _, features = model._target_forward(ids, pos, hidden=True)
            hidden = model._blocks(ids, pos, features, anchors, document_ids(pos))
            prev = model.draft_model.markov_w1(ids[0, anchors[0][:, None] + torch.arange(bs)])[None]
            return {"logits": model.slot_logits(hidden, prev), "confidence": model.draft_model.confidence_logit(
                hidden, prev)}
        out = model(ids, pos, anchors)
        return {"logits": out.logits, "hidden": out.hidden}


@pytest.mark.skipif(_runnable() is not None, reason=_runnable() or "")
def test_speculators_own_loader_loads_each_export_its_forward_agrees_and_its_save_imports(tmp_path):
    models, outs = {}, {}
    for kind in BUILDERS:
        models[kind], outs[kind] = _export(tmp_path, kind)
    target = models["dflash"].target  # the same seeded target for every kind
    ids = torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
    inputs = {"ids": ids, "aux": torch.cat([hidden[1], hidden[3]], -1).contiguous(), "last": hidden[-1].contiguous()}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    args = [a for kind in BUILDERS for a in (outs[kind], tmp_path / f"{kind}-saved", tmp_path / f"{kind}.safetensors")]
    run = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "inputs.safetensors"), *map(str, args)],
                         env={**os.environ, "PYTHONPATH": str(SPECULATORS)}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("loaded ")]  # not its logs
    assert loaded == [["DFlashDraftModel", "DFlashSpeculatorConfig"], ["DFlash2DraftModel", "DFlash2SpeculatorConfig"],
                      ["DSparkDraftModel", "DSparkSpeculatorConfig"]]
    for kind, model in models.items():
        draft = model.draft_model
        bs = draft.block_size
        theirs = load_file(str(tmp_path / f"{kind}.safetensors"))
        ours = _treadle_side(kind, model, ids)
        n = T - bs
        if kind == "dspark":  # every slot drafts: slot k guesses anchor + k + 1
            torch.testing.assert_close(theirs["arg0"].view(1, n, bs, -1), ours["logits"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(theirs["arg2"].view(1, n, bs), ours["confidence"], rtol=1e-5, atol=1e-5)
        else:  # slot 0 is the anchor; slots 1.. guess anchor + k
            unary = theirs["unary_logits" if kind == "dflash2" else "arg0"].view(1, n, bs, -1)[:, :, 1:]
            torch.testing.assert_close(unary, ours["logits"], rtol=1e-5, atol=1e-5)
        if kind == "dflash2":  # the selector's scores of speculators' candidates after the same predecessors
            cand = theirs["training_candidate_ids"].view(1, n, bs, -1)[:, :, 1:]
            scores = theirs["candidate_logits"].view(1, n, bs, -1)[:, :, 1:]
            preds = ids[0, torch.arange(n)[:, None] + torch.arange(bs - 1)][None]  # token anchor + k - 1
            with torch.no_grad():
                want = draft.selector(ours["hidden"], ours["logits"].gather(-1, cand), cand, preds)
            torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)
        # speculators' own save of the draft, without treadle's keys, imports as the same draft
        saved = tmp_path / f"{kind}-saved"
        config = json.loads((saved / "config.json").read_text())
        (saved / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TREADLE_KEYS}))
        loaded = registry.load_draft(saved, model.target).draft_model
        for name, want in draft.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], want), (kind, name)
