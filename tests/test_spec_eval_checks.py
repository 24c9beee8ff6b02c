"""spec-eval refuses what a draft kind would refuse at decode time before any model loads (issue 48, stumble 3):
one line, exit 2, from the draft's config.json (and the adapter's JSON files) alone.

The drafts and the target here are a config.json beside weights that are not weights: a refusal that came after
loading anything would be another error (or a traceback), so each passing case shows nothing was loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.cli import main

GARBAGE = b"not a safetensors file: spec-eval must refuse before reading it\n"

DRAFTS = {
    "dspark7": {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
                "dflash_config": {"block_size": 7, "target_layer_ids": [0], "mask_token_id": 3}},
    "dflash8": {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                "dflash_config": {"block_size": 8, "target_layer_ids": [0], "mask_token_id": 3}},
    "dflash2_4": {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
                  "dflash_config": {"block_size": 4, "target_layer_ids": [0], "mask_token_id": 3}},
    "lilicorr4": {"architectures": ["LiLiCorrDraftModel"], "model_type": "qwen3",
                  "dflash_config": {"block_size": 4, "target_layer_ids": [0], "mask_token_id": 3}},
    "stages3": {"model_type": "deepseek_v4", "dspark_block_size": 3},
    "glide": {"treadle_draft_kind": "glide", "model_type": "llama"},
    "lm": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
}
# adapter directories: what treadle_adapter.json records of the base (None: no such file, an adapter from PEFT)
ADAPTERS = {
    "model": {"model_type": "llama", "hidden_size": 32, "config_fingerprint": "c0ffee", "weights_fingerprint": "ab",
              "fingerprint": "1234"},
    "eagle3": {"draft_kind": "eagle3", "model_type": "llama", "config_fingerprint": "c0ffee",
               "weights_fingerprint": "cd", "fingerprint": "5678"},
    "empty": "no adapter_config.json",
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spec_checks")
    for name, config in {**DRAFTS, "target": DRAFTS["lm"]}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        (root / name / "model.safetensors").write_bytes(GARBAGE)
    for name, base in ADAPTERS.items():
        (root / f"adapter-{name}").mkdir()
        if isinstance(base, dict):
            (root / f"adapter-{name}" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
            (root / f"adapter-{name}" / "treadle_adapter.json").write_text(json.dumps({"base": base}))
            (root / f"adapter-{name}" / "adapter_model.safetensors").write_bytes(GARBAGE)
    return root


CASES = [  # (draft, flags, what the line says)
    ("dspark7", ["--gamma", "9"], "--gamma 9 with --draft {d}: one forward of this dspark draft proposes at most 7 "
                                  "tokens (the block its config.json states); accepted: --gamma <= 7"),
    ("dspark7", ["--tree", "2,2,2,2,2,2,2,2"], "(depth 8) with --draft {d}: one forward of this dspark draft proposes "
                                               "at most 7 tokens"),
    ("dflash8", ["--gamma", "8"], "accepted: --gamma <= 7"),
    ("dflash2_4", ["--tree", "2,2,2,2"], "--tree 2,2,2,2 (depth 4) with --draft {d}: one forward of this dflash2 draft "
                                         "proposes at most 3 tokens"),
    ("lilicorr4", ["--tree", "dynamic:2,4,8", "--temperature", "0.7"], "this lilicorr draft proposes at most 3 tokens"),
    ("stages3", ["--gamma", "4"], "this dspark draft proposes at most 3 tokens"),
    ("dflash8", ["--confidence-threshold", "0.5"], "--confidence-threshold 0.5 with --draft {d} (a dflash draft, no "
                                                   "confidence head); accepted: a draft with a confidence head"),
    ("prompt-lookup", ["--confidence-threshold", "0.5"], "(prompt lookup, no confidence head)"),
    ("dspark7", ["--confidence-threshold", "1.5"], "--confidence-threshold 1.5: accepted: a probability in 0..1"),
    ("prompt-lookup", ["--adapter", "{a}/adapter-eagle3"], "(prompt lookup): an adapter adapts a treadle draft"),
    ("lm", ["--adapter", "{a}/adapter-eagle3"], "(a causal LM): an adapter adapts a treadle draft"),
    ("glide", ["--adapter", "{a}/adapter-eagle3"], "(a glide draft): not built for GLIDE"),
    ("dspark7", ["--adapter", "{a}/adapter-empty"], "no adapter_config.json in it"),
    ("dspark7", ["--adapter", "{a}/adapter-model"], "is an adapter of a model (llama, hidden_size 32, config fingerprint "
                                                    "c0ffee, weights ab), not of a draft; accepted: an adapter of the "
                                                    "dspark draft --draft {d}"),
    ("dflash8", ["--adapter", "{a}/adapter-eagle3"], "adapts a eagle3 draft, --draft {d} is a dflash draft"),
]


@pytest.mark.parametrize("draft, flags, expect", CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in CASES])
def test_spec_eval_refuses_what_the_draft_would_before_loading(dirs, capsys, draft, flags, expect):
    d = draft if draft == "prompt-lookup" else str(dirs / draft)
    flags = [f.format(a=dirs) for f in flags]
    capsys.readouterr()
    rc = main(["spec-eval", "--target", str(dirs / "target"), "--draft", d, *flags, "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("treadle: error: "), err
    assert expect.format(d=d, a=dirs) in err, err


def test_the_options_a_draft_takes_go_on_to_load_it(dirs, capsys):
    """The control: --gamma 7 on the block-7 draft passes the checks and goes on to load the target (whose
    directory holds no tokenizer here), so the refusals above were made before anything loaded."""
    capsys.readouterr()
    rc = main(["spec-eval", "--target", str(dirs / "target"), "--draft", str(dirs / "dspark7"), "--gamma", "7",
               "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "no usable tokenizer" in err and "one forward of this" not in err, err
