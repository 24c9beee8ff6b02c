"""Training on your own data: a slice of it is held out for validation unless a validation set is named (the
built-in corpus, Python sources, says nothing about a user's data), and the start line says which set is used."""

from __future__ import annotations

import json

import pytest

from tests.helpers import args, records
from treadle.cli import main
from treadle.config import OWN_DATA_VAL_FRACTION, load_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("overrides, val, fraction", [
    (['--data.train=["my.jsonl"]'], ["builtin"], OWN_DATA_VAL_FRACTION),  # held out, not the built-in corpus
    (["--data.train=shards/train"], ["builtin"], OWN_DATA_VAL_FRACTION),
    (['--data.sources=[{name="a",path="builtin"},{name="b",path="my.jsonl"}]'], ["builtin"], OWN_DATA_VAL_FRACTION),
    (["--data.train=my.jsonl", "--data.val=builtin"], ["builtin"], 0.0),  # named: kept
    (["--data.train=my.jsonl", "--data.val=[]"], [], 0.0),
    (["--data.train=my.jsonl", "--data.val_fraction=0.2"], ["builtin"], 0.2),
    ([], ["builtin"], 0.0),  # the built-in corpus keeps its own validation split
    (['--data.sources=[{name="a",path="builtin"}]'], ["builtin"], 0.0),
])
def test_own_training_data_holds_out_a_slice_by_default(overrides, val, fraction):
    cfg = load_config(None, overrides)
    assert (cfg.data.val, cfg.data.val_fraction) == (val, fraction)


def test_the_default_is_in_the_resolved_config_and_survives_a_round_trip(tmp_path):
    from treadle.config import save_config

    cfg = load_config(None, ["--data.train=my.jsonl"])
    save_config(cfg, tmp_path / "config.toml")
    assert f"val_fraction = {OWN_DATA_VAL_FRACTION}" in (tmp_path / "config.toml").read_text()
    assert load_config(tmp_path / "config.toml") == cfg


def test_a_run_on_a_jsonl_file_validates_on_its_held_out_documents(shards, tmp_path, capsys):
    data = tmp_path / "my.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 4}) + "\n"
                            for i in range(80)))
    run = tmp_path / "run"
    argv = [a for a in args(shards, run, "--train.max_steps=2", "--train.eval_every=2")
            if not a.startswith(("--data.train=", "--data.val="))]
    assert main(argv + [f"--data.train={data}", f"--data.tokenizer={shards / 'tok'}"]) == 0
    out = capsys.readouterr().out
    assert f"samples held out of the training data (data.val_fraction = {OWN_DATA_VAL_FRACTION})" in out
    assert sorted(records(run, "eval_loss")) == [0, 2]
    assert load_config(run / "config.toml").data.val_fraction == OWN_DATA_VAL_FRACTION

    builtin = tmp_path / "builtin"
    assert main(args(shards, builtin, "--train.max_steps=2", "--data.val=[]")) == 0
    assert "no validation set (data.val = [])" in capsys.readouterr().out


def test_a_model_path_with_only_a_config_json_trains_that_architecture_from_scratch(shards, tmp_path, capsys):
    """--model.path at a directory holding a config.json and no weights (the usual way to say "this architecture,
    fresh weights") builds the model from it with random weights, saying so, instead of failing on a missing
    model.safetensors."""
    from transformers import LlamaConfig

    from tests.helpers import TARGET

    arch = tmp_path / "arch"
    LlamaConfig(**TARGET).save_pretrained(arch)
    assert sorted(p.name for p in arch.iterdir()) == ["config.json"]
    run = tmp_path / "run"
    argv = [a for a in args(shards, run, "--train.max_steps=2") if not a.startswith("--model.overrides=")]
    assert main(argv + [f"--model.path={arch}"]) == 0
    err = capsys.readouterr().err
    assert (f"treadle: model.path {arch} holds a config.json and no weights: a llama model built from it with random "
            "weights (training from scratch)") in err
    assert (run / "hf" / "model.safetensors").is_file() and len(records(run)) == 2
    # The exported model has weights: training on from it loads them, with no such line.
    assert main([*argv, f"--train.output_dir={tmp_path / 'again'}", f"--model.path={run / 'hf'}"]) == 0
    assert "no weights" not in capsys.readouterr().err
