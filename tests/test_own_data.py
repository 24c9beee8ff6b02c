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


def _config_json(tmp_path, name, **fields):
    """A directory holding only a config.json: TARGET's architecture with ``fields`` on top."""
    from transformers import LlamaConfig

    from tests.helpers import TARGET

    arch = tmp_path / name
    LlamaConfig(**(TARGET | fields)).save_pretrained(arch)
    assert sorted(p.name for p in arch.iterdir()) == ["config.json"]
    return arch


def test_a_model_path_with_only_a_config_json_trains_that_architecture_from_scratch(shards, tmp_path, capsys):
    """--model.path at a directory holding a config.json and no weights (the usual way to say "this architecture,
    fresh weights") builds the model from it with random weights, saying so once, at a fresh start (not on resume,
    not on `treadle export`), instead of failing on a missing model.safetensors. The config is eos-less and was
    written for a vocabulary 3x the data's tokenizer: the start line names the tokenizer, a warning names both
    remedies, and the export states the tokenizer's ids, so transformers' generate stops at its eos."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    arch = _config_json(tmp_path, "arch", vocab_size=1536, bos_token_id=None, eos_token_id=None)
    run = tmp_path / "run"
    argv = [a for a in args(shards, run, "--train.max_steps=2", "--checkpoint.every=2")
            if not a.startswith("--model.overrides=")] + [f"--model.path={arch}"]
    scratch = (f"treadle: model.path {arch} holds a config.json and no weights: a llama model built from it with "
               "random weights (training from scratch)")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count(scratch) == 1 and "no weights" not in err
    start = next(line for line in out.splitlines() if "trainable parameters" in line)
    assert f"tokenizer {shards / 'tok'} (512 tokens)" in start
    assert (f"treadle: warning: model.path {arch} (config.json) has vocab_size 1,536, 3.0x tokenizer {shards / 'tok'} "
            "(512 tokens): 67% of the embedding rows are never used; set data.tokenizer = the model's own tokenizer "
            "directory, or model.overrides = {vocab_size = 512}") in out.splitlines()
    assert (run / "hf" / "model.safetensors").is_file() and len(records(run)) == 2

    # The export states the tokenizer's ids (<|endoftext|> = 0 is its bos, eos and pad); config.json no pad that is
    # the eos (transformers would freeze that embedding row as padding_idx), generation_config.json all three.
    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 0, 0)
    config = json.loads((run / "hf" / "config.json").read_text())
    generation = json.loads((run / "hf" / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 0, None)
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, 0, 0)

    class EosAt(LogitsProcessor):
        """The model emits the eos as its ``k``-th new token (whatever it would have said): generate must stop."""

        def __init__(self, k, prompt_len):
            self.k, self.prompt_len = k, prompt_len

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - self.prompt_len == self.k - 1:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, tok.eos_token_id] = 0.0
            return scores

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    prompt = torch.tensor([tok.encode("def f(x):")])
    made = model.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt),
                          logits_processor=LogitsProcessorList([EosAt(3, prompt.shape[1])]))
    assert made.shape[1] == prompt.shape[1] + 3 and int(made[0, -1]) == tok.eos_token_id

    # A resume and `treadle export` load the checkpoint's weights: no "random weights" line from either.
    assert main([*[a for a in argv if not a.startswith("--train.max_steps=")], "--train.max_steps=3",
                 "--checkpoint.allow_schedule_change=true"]) == 0
    out, err = capsys.readouterr()
    assert "no weights" not in out + err and "resumed from" in out and len(records(run)) == 3
    assert main(["export", str(run), str(tmp_path / "again")]) == 0
    out, err = capsys.readouterr()
    assert "no weights" not in out + err
    assert json.loads((tmp_path / "again" / "config.json").read_text())["eos_token_id"] == 0
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["pad_token_id"] == 0

    # The exported model has weights: training on from it loads them, with no such line.
    assert main([*argv, f"--train.output_dir={tmp_path / 'again-run'}", f"--model.path={run / 'hf'}"]) == 0
    out, err = capsys.readouterr()
    assert "no weights" not in out + err


def test_a_model_smaller_than_the_tokenizer_is_refused_in_one_line(shards, tmp_path, capsys):
    arch = _config_json(tmp_path, "arch", vocab_size=256)
    argv = [a for a in args(shards, tmp_path / "run") if not a.startswith("--model.overrides=")]
    assert main(argv + [f"--model.path={arch}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"treadle: error: model.path {arch} (config.json) has vocab_size 256, smaller than tokenizer "
                   f"{shards / 'tok'} (512 tokens); accepted: a vocabulary that covers the tokenizer: data.tokenizer = "
                   "the model's own tokenizer directory, or model.overrides = {vocab_size = 512}")
    assert not (tmp_path / "run").exists()


def test_the_model_takes_the_tokenizers_ids_and_model_overrides_its_vocabulary(shards, tmp_path):
    """At build time: a config.json written for another tokenizer (Qwen3's eos 151645 past this vocabulary) gets
    the tokenizer's ids in its config and generation config, and model.overrides sets its vocab_size."""
    from treadle.config import ModelConfig
    from treadle.models.hf import build_model, vocabulary_fit
    from treadle.tokenizer import RunTokenizer

    tokenizer = RunTokenizer(512, shards / "tok")
    arch = _config_json(tmp_path, "arch", vocab_size=151_936, bos_token_id=151_643, eos_token_id=151_645,
                        pad_token_id=151_643, num_hidden_layers=1)
    cfg = ModelConfig(path=str(arch), overrides={"vocab_size": 512})
    model = build_model(cfg, 512, tokenizer=tokenizer)
    assert model.config.vocab_size == model.get_input_embeddings().num_embeddings == 512
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 0, None)
    assert model.get_input_embeddings().padding_idx is None  # the eos row learns
    g = model.generation_config
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id) == (0, 0, 0)
    assert vocabulary_fit(model.config.vocab_size, tokenizer, cfg) is None
    # A preset model too (its bos used to be set to the eos whatever the tokenizer said).
    preset = build_model(ModelConfig(overrides={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                "num_attention_heads": 4, "num_key_value_heads": 4}), 512,
                         tokenizer=tokenizer)
    assert (preset.config.eos_token_id, preset.generation_config.pad_token_id) == (0, 0)
