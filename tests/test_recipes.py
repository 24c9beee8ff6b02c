"""The shipped recipes (configs/*.toml) survive being shortened, the first thing a user does with them.

Every recipe loads and validates at a few short lengths; the SFT and draft recipes run a few steps against
the test fixtures (a tiny target, the test tokenizer's shards, small JSONL files) through the real CLI.
"""

import json
from pathlib import Path

import pytest

from tests.helpers import records, write_pairs
from treadle.cli import main
from treadle.config import load_config
from treadle.train.run import unreached_phases

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_validates_when_shortened_and_keeps_its_full_length_schedule(config):
    full = load_config(config)
    # The old explicit warmup: 20 of 200 (demo, draft, mixture), 10 of 100 (sft), so the demo keeps its results.
    assert full.warmup_steps() == full.train.max_steps // 10
    for steps in (1, 3, 10, 20):
        cfg = load_config(config, [f"--train.max_steps={steps}"])
        assert 0 <= cfg.warmup_steps() < steps


def test_a_phase_past_max_steps_is_named_in_a_warning():
    mixture = next(c for c in CONFIGS if c.name == "mixture.toml")
    assert unreached_phases(load_config(mixture)) == []
    assert unreached_phases(load_config(mixture, ["--train.max_steps=151"])) == []  # start_step 150 is step 151
    (line,) = unreached_phases(load_config(mixture, ["--train.max_steps=150"]))
    assert "data.phases[0]" in line and "start_step = 150" in line and "train.max_steps = 150" in line


def _chat(path, n=40):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]}) + "\n"
                            for i in range(n)))


SHORT = ["--data.seq_len=64", "--train.micro_batch_size=2", "--train.eval_batches=2", "--train.log_every=1",
         "--train.threads=1"]


def test_shortened_sft_recipe_runs_evaluates_held_out_examples_and_checkpoints_by_time(
        target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipe's data/ and runs/ paths are relative
    (tmp_path / "data").mkdir()
    _chat(tmp_path / "data" / "chat.jsonl")
    write_pairs(tmp_path / "data" / "pairs.jsonl")
    sft = next(c for c in CONFIGS if c.name == "sft.toml")
    code = main(["train", str(sft), "--train.max_steps=3", f"--model.path={target_dir}", *SHORT,
                 "--checkpoint.every_minutes=0.00001",  # due after every step: saved without checkpoint.every
                 "--data.phases=[{start_step=5,weights={pairs=0}}]"])
    out = capsys.readouterr().out
    assert code == 0
    run = tmp_path / "runs" / "sft"
    assert sorted(records(run, "eval_loss")) == [0, 3]  # the recipe evaluates: on the held-out 5% of its examples
    assert "held out for validation (data.val_fraction)" in out
    assert "data.phases[0] starts at start_step = 5, but the run ends at train.max_steps = 3" in out
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]  # keep_last 2


def test_shortened_draft_recipe_runs_without_the_start_evaluation(shards, target_dir, tmp_path):
    draft = next(c for c in CONFIGS if c.name == "demo-draft.toml")
    run = tmp_path / "draft"
    code = main(["train", str(draft), "--train.max_steps=3", f"--train.output_dir={run}", f"--draft.target={target_dir}",
                 f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}", *SHORT, "--draft.eval_prompts=2",
                 "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12", "--train.eval_at_start=false"])
    assert code == 0
    assert sorted(records(run, "eval_loss")) == [3] and sorted(records(run, "tau_sim")) == [3]  # both skip step 0
    assert sorted(records(run, "lr")) == [1, 2, 3]
