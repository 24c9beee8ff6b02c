"""The Python API (``from treadle import fit, export, ...``; docs/python.md's example runs in tests/test_docs.py):
objects become stored directories the run's config.toml names, a config built in Python gets every check the CLI
makes, resources are closed also on failure, bad input is a ``UserError``, and importing treadle changes nothing in
its host."""

import argparse
import inspect
import json
import os
import subprocess
import sys
import threading
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.helpers import SMALL_MODEL, TARGET

DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _small(cfg, shards, out):
    """A tiny run on the test shards (the same sizes as tests/helpers.args)."""
    cfg.train.output_dir = str(out)
    cfg.data.train, cfg.data.val = [str(shards / "train")], [str(shards / "val")]
    cfg.model.overrides = tomllib.loads(f"o = {SMALL_MODEL}")["o"]
    cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.eval_batches, cfg.train.log_every = 32, 4, 2, 1
    cfg.train.max_steps = 2
    return cfg


def test_import_treadle_is_cheap_and_changes_nothing():
    """``import treadle`` loads neither torch nor transformers and leaves the warnings filters alone; the API's
    names are listed by ``dir`` and load on first use."""
    code = ("import sys, warnings; before = list(warnings.filters); import treadle; "
            "assert warnings.filters == before, 'filters changed'; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy imports'; "
            "assert set(treadle.__all__) <= set(dir(treadle)); "
            "from treadle import Config, UserError, load_config, fit; assert 'torch' not in sys.modules; "
            "print(sorted(treadle.__all__))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fit" in proc.stdout and "Callback" in proc.stdout


def test_cross_field_rules_checked_where_a_run_starts(tmp_path, capsys):
    """Assigning to a section checks that field only; the rules across sections run when the run starts, from
    Python as from the CLI, with the same message, before anything is written."""
    from treadle import Config, UserError, cli, fit
    from treadle.train.run import run_training

    out = tmp_path / "run"
    cfg = Config()
    cfg.train.output_dir = str(out)
    cfg.draft.eval_new_tokens = 3  # allowed alone; draft.gamma is 4
    for start in (run_training, fit):
        with pytest.raises(UserError) as err:
            start(cfg)
        assert "draft.eval_new_tokens=3 must exceed draft.gamma=4" in str(err.value)
    assert not out.exists()
    assert cfg.draft.eval_new_tokens == 3  # the caller's config is not changed

    assert cli.main(["train", f"--train.output_dir={out}", "--draft.eval_new_tokens=3"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == f"treadle: error: {str(err.value).replace('config error', 'config error (overrides)', 1)}"

    cfg = Config()
    cfg.data.train = []
    with pytest.raises(UserError, match="data.train is empty"):
        fit(cfg)
    assert not out.exists()


def test_a_bad_assignment_is_the_same_line_as_a_bad_file_key():
    from treadle import Config, UserError

    cfg = Config()
    for section, key, value, expect in [
        ("train", "max_steps", 0, "config error: train.max_steps = 0 is invalid: out of range; accepted: an integer >= 1"),
        ("train", "max_stps", 3, "config error: unknown key train.max_stps; did you mean train.max_steps?"),
        ("schedule", "decay", "cosin", "config error: schedule.decay = 'cosin' is invalid: accepted: one of \"cosine\", "
                                       "\"linear\", \"constant\", \"wsd\"; did you mean 'cosine'?"),
    ]:
        with pytest.raises(UserError) as err:
            setattr(getattr(cfg, section), key, value)
        assert str(err.value) == expect
    cfg.train.output_dir = tmp = Path("runs") / "x"  # a path object is its string
    assert cfg.train.output_dir == str(tmp)


def test_fit_takes_objects_and_the_run_resumes_from_its_config(shards, tmp_path, monkeypatch):
    """A fresh HF model, a tokenizer and a list of rows are stored once in the cache; config.toml names them,
    so the CLI runs the same config again; a user callback sees each step's eval and its state is checkpointed."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treadle import Callback, cli, fit, load_config

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TARGET))
    tokenizer = AutoTokenizer.from_pretrained(shards / "tok")
    rows = [{"text": (shards / "tok" / "tokenizer.json").read_text()[i * 400:(i + 1) * 400]} for i in range(40)]

    class Seen(Callback):
        def __init__(self):
            self.evals = []

        def on_step_end(self, trainer, result):
            evaluation = next(cb for cb in trainer.callbacks if type(cb).__name__ == "EvalCallback")
            self.evals.append(evaluation.last["step"])

        def state_dict(self):
            return {"steps_seen": len(self.evals)}

    import datasets
    from transformers.utils import logging as hf_logging

    host = lambda: (hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(),  # noqa: E731
                    datasets.logging.get_verbosity())
    before = host()
    seen = Seen()
    out = tmp_path / "run"
    overrides = {"train.output_dir": str(out), "train.max_steps": 2, "train.eval_every": 1, "data.seq_len": 32,
                 "train.micro_batch_size": 2, "train.eval_batches": 1, "train.log_every": 1}
    summary = fit(overrides=overrides, model=model, tokenizer=tokenizer, dataset=rows, val_dataset=rows[:8],
                  callbacks=[seen])
    assert summary.steps == 2 and summary.last_eval is not None
    saved = load_config(out / "config.toml")
    objects = tmp_path / "cache" / "objects"
    assert Path(saved.model.path).parent == objects and Path(saved.model.path).name.startswith("model-")
    assert Path(saved.data.tokenizer).name.startswith("tokenizer-")
    assert Path(saved.data.train[0]).name == "rows.jsonl" and Path(saved.data.val[0]).parent.parent == objects
    assert host() == before  # the host's progress bars and datasets verbosity are as they were
    assert seen.evals == [1, 2]  # the step's evaluation ran before the callback
    state = json.loads((out / "checkpoints" / "latest" / "train_state.json").read_text())
    assert state["callbacks"]["Seen"] == {"steps_seen": 2}

    stored = sorted(p.name for p in objects.iterdir())
    fit(overrides=overrides, model=model, tokenizer=tokenizer, dataset=rows, val_dataset=rows[:8])  # resumes: done
    assert sorted(p.name for p in objects.iterdir()) == stored  # the same objects, the same directories
    assert cli.main(["train", str(out / "config.toml")]) == 0  # config.toml alone runs the run again


def test_resources_are_closed_when_a_run_fails(shards, tmp_path, monkeypatch):
    """Under a (one-rank) launcher: a failure inside build_trainer, and one inside fit, leave no process group,
    no prefetch thread and no open metrics file behind; a user callback named like treadle's own is refused."""
    from treadle import Callback, Config, UserError, fit
    from treadle.train.run import build_trainer

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOCAL_RANK", "0")

    cfg = _small(Config(), shards, tmp_path / "a")
    cfg.data.train = [str(tmp_path / "missing")]  # found out after the process group is joined
    with pytest.raises(UserError, match="missing"):
        build_trainer(cfg, live=False)
    assert not torch.distributed.is_initialized()

    class Boom(Callback):
        def on_step_end(self, trainer, result):
            self.metrics = trainer.metrics
            raise RuntimeError("boom")

    class MetricsCallback(Callback):  # a checkpoint keeps callback state by class name
        pass

    with pytest.raises(UserError, match="two callbacks of a run are named MetricsCallback"):
        fit(_small(Config(), shards, tmp_path / "c"), callbacks=[MetricsCallback()])
    assert not (tmp_path / "c").exists()

    boom = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        fit(_small(Config(), shards, tmp_path / "b"), callbacks=[boom], live=False)
    assert not torch.distributed.is_initialized()
    assert not [t for t in threading.enumerate() if t.name.startswith(("treadle-prefetch", "treadle-save"))]
    assert boom.metrics.jsonl._fh is None  # closed


def test_no_warnings_filter_and_no_dcp_warning_after_a_run(shards, tmp_path):
    """A run (save and resume: DCP both ways) shows no DCP single-process warning, even with every warning
    shown, and leaves the warnings filters as it found them."""
    from treadle import Config, fit

    cfg = _small(Config(), shards, tmp_path / "run")
    cfg.schedule.decay = "constant"  # so a longer max_steps continues the same schedule
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        fit(cfg, live=False)
        cfg.train.max_steps = 3
        fit(cfg, live=False)  # resumes from step 2: a DCP load
        assert warnings.filters == before
    assert not [w for w in seen if DCP_WARNING in str(w.message)]


def test_bad_input_from_python_is_one_user_error(tmp_path):
    from treadle import UserError, export, fit, generate, spec_eval

    cases = [
        (lambda: fit(42), "is not a config"),
        (lambda: fit(overrides={"train.max_stps": 3}), "unknown key train.max_stps; did you mean train.max_steps?"),
        (lambda: fit(overrides="train.max_steps=3"), "a single string"),
        (lambda: fit(tmp_path / "missing.toml"), "does not exist"),
        (lambda: fit(callbacks=[object()]), "is not a treadle Callback"),
        (lambda: fit(model=object()), "has no save_pretrained"),
        (lambda: fit(dataset=[]), "no rows"),
        (lambda: fit(dataset=[{"text": "a"}], overrides={"data.sources": [{"name": "a", "path": "builtin"}]}),
         "dataset= and data.sources are both set"),
        (lambda: spec_eval(tmp_path, "prompt-lookup", gamma=0), "--gamma 0: must be >= 1"),
        (lambda: generate(tmp_path, tmp_path / "p.jsonl", tmp_path / "o.jsonl", colour=1), "unknown option 'colour'"),
        (lambda: generate(tmp_path, tmp_path / "p.jsonl", tmp_path / "o.jsonl", chat_template="x"), "--chat-template"),
        (lambda: export(tmp_path / "nothing", tmp_path / "out"), "nothing"),
    ]
    for call, expect in cases:
        with pytest.raises(UserError) as err:
            call()
        assert expect in str(err.value) and "\n" not in str(err.value), (expect, str(err.value))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["treadle.data.generate", "treadle.speculative.evaluate"])
def test_command_flags_and_python_keywords_agree(module):
    """generate / spec-eval: one function serves the command and the API, so each flag's default is the keyword's."""
    import importlib

    mod = importlib.import_module(module)
    fn = mod.generate if module.endswith("generate") else mod.spec_eval
    parser = argparse.ArgumentParser()
    mod.add_arguments(parser)
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    params = inspect.signature(fn).parameters
    for dest, default in defaults.items():
        name = "json_path" if dest == "json" else dest
        assert name in params, name
        if params[name].default is not inspect.Parameter.empty:
            assert params[name].default == default, name


def test_a_directory_named_treadle_beside_a_script_does_not_shadow_the_package(tmp_path):
    """src layout: an empty ``treadle/`` in the script's directory (a clone, say) is not imported instead."""
    (tmp_path / "treadle").mkdir()
    (tmp_path / "script.py").write_text(
        "import treadle.data.loader\nfrom treadle import Config, fit\nprint(treadle.__file__)\n")
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(os.path.join("src", "treadle", "__init__.py"))
