"""The CLI's own surface: light start-up, `treadle config [--explain]`, --version, and hints for mistyped overrides.

Start-up *time* is measured by bench/startup.py (timings do not belong in a test); here a fresh interpreter checks
the cause: the light commands do not import torch or the other heavy libraries.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

import treadle
from treadle.cli import main
from treadle.config import Config, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))
HEAVY = ["torch", "transformers", "datasets", "deepspeed"]

# Runs in a fresh interpreter: every light command, its output swallowed, then what got imported.
_LIGHT = """
import contextlib, io, json, sys
from treadle.cli import main
codes, errs = [], []
for argv in {argvs!r}:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            codes.append(main(argv))
        except SystemExit as exc:  # --help and --version exit through argparse
            codes.append(exc.code)
    errs.append(err.getvalue())
print(json.dumps({{"codes": codes, "errs": errs, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def test_help_version_config_and_config_errors_import_no_heavy_library(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\nmax_steps = 5\n")
    cases = {
        ("--help",): 0, ("--version",): 0, ("train", "--help"): 0, ("config", "--help"): 0,
        ("prepare", "--help"): 0, ("samples", "--help"): 0, ("export", "--help"): 0, ("spec-eval", "--help"): 0,
        ("generate", "--help"): 0, ("features", "--help"): 0,
        ("config",): 0, ("config", "--explain"): 0, ("config", str(CONFIGS[0]), "--train.max_steps=50"): 0,
        ("train", "--trian.x=1"): 2,  # unknown key
        ("train", "--train.max_steps=abc"): 2,  # bad value
        ("train", str(broken)): 2,  # broken TOML
        ("train", str(tmp_path / "missing.toml")): 2,  # no such file
        ("train", "--max_steps=5"): 2,  # no section
        ("config", "--optim.betas=[0.9]"): 2,
        ("train", "--model.path=gpt2"): 2,  # a Hub id: refused before the training stack loads
        ("train", "--draft.kind=glide", "--draft.target=Qwen/Qwen3-0.6B"): 2,
    }
    # Every path a config names is checked before the training stack loads too (it took ~10 s of imports to find a
    # missing data file, where a key typo takes a fraction of a second): one line naming the key, exit code 2.
    target = tmp_path / "target"  # a model directory, for the draft keys' checks to be reached
    target.mkdir()
    (target / "config.json").write_text("{}")
    missing = str(tmp_path / "nonexistent")
    draft = ("--draft.kind=glide", f"--draft.target={target}")
    paths = {
        ("train", f"--data.train={missing}"): "data.train = ",
        ("train", f"--data.val={missing}.jsonl"): "data.val = ",
        ("train", f"--data.sources=[{{name='web', path='{missing}/*.jsonl'}}]"): "data.sources[0] (web) = ",
        ("train", f"--data.tokenizer={missing}"): "data.tokenizer = ",
        ("train", f"--model.path={missing}"): "model.path ",
        ("train", *draft, f"--draft.init={missing}"): "draft.init ",
        ("train", *draft, f"--draft.features={missing}"): "draft.features ",
        # treadle features likewise (it imported torch with its arguments, before the paths were checked)
        ("features", *draft, f"--data.train={missing}", "--out", str(tmp_path / "store")): "data.train = ",
    }
    script = _LIGHT.format(argvs=[list(a) for a in [*cases, *paths]], heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["codes"] == [*cases.values(), *[2] * len(paths)], result
    assert result["heavy"] == []
    for err, named in zip(result["errs"][len(cases):], paths.values()):
        assert err.startswith(f"treadle: error: {named}") and err.count("\n") == 1 and missing in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"treadle {treadle.__version__}\n"


def test_train_help_says_where_the_keys_are(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "treadle config --explain" in out and "--section.key=value" in out


def _config_output(capsys, *argv: str) -> str:
    assert main(["config", *argv]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out


def test_config_prints_the_resolved_config_that_train_would_run(capsys, tmp_path):
    # an override holding a space (quoted in a shell) is an override, not the config file
    args = ["--optim.betas=[0.8, 0.99]", str(CONFIGS[0]), "--train.max_steps=70", "--train.max_steps=77"]
    text = _config_output(capsys, *args)
    assert "max_steps = 77" in text and "\nbetas = [0.8, 0.99]\n" in text  # a short list on its key's line
    (tmp_path / "resolved.toml").write_text(text)
    assert load_config(tmp_path / "resolved.toml") == load_config(args[1], [args[0], *args[2:]])


def test_config_refuses_what_train_refuses_in_the_same_words(capsys):
    for argv in (["--train.max_stps=5"], ["--schedule.warmup_steps=500"], ["--max_steps=5"], ["a.toml", "b.toml"],
                 ["-x"], ["--optim.betas=[0.9, 2]"]):
        codes = [main([command, *argv]) for command in ("train", "config")]
        err = capsys.readouterr().err.splitlines()
        assert codes == [2, 2] and len(err) == 2 and err[0] == err[1] and err[0].startswith("treadle: error: ")


# nested and quoted tables, an array of tables, a key set that is unset by default, an empty list
_UNUSUAL = ["--model.overrides={num_hidden_layers=2, rope_scaling={rope_type='linear', factor=2.0}}",
            "--data.sources=[{name='a.b', path='builtin'}, {name='c', path=['x.jsonl', 'y.jsonl'], weight=0.5}]",
            "--data.phases=[{start_step=5, weights={'a.b'=2.0}}]", "--train.time_limit=1h30m", "--data.val=[]",
            "--model.path=/models/m \"quoted\""]


@pytest.mark.parametrize("explain", [["--explain"], []], ids=["explained", "plain"])
@pytest.mark.parametrize("path, overrides", [(None, []), (None, _UNUSUAL), *((p, []) for p in CONFIGS)],
                         ids=["default", "unusual", *(p.name for p in CONFIGS)])
def test_explained_config_loads_back_to_the_same_config(capsys, tmp_path, path, overrides, explain):
    argv = [str(path)] if path else []
    text = _config_output(capsys, *argv, *overrides, *explain)
    (tmp_path / "explained.toml").write_text(text)
    assert load_config(tmp_path / "explained.toml") == load_config(path, overrides)


def test_a_long_list_takes_a_line_per_item():
    from treadle.config.doc import INLINE_ARRAY_CHARS, toml_value

    files = [f"data/part-{i:05d}.jsonl" for i in range(8)]
    assert len(", ".join(files)) > INLINE_ARRAY_CHARS
    assert toml_value(files) == "[\n" + "".join(f'    "{f}",\n' for f in files) + "]"
    assert toml_value(files[:2]) == '["data/part-00000.jsonl", "data/part-00001.jsonl"]'


def test_explain_covers_every_key_with_its_description_default_and_accepted_values(capsys):
    text = _config_output(capsys, "--explain")
    lines = text.splitlines()
    comments = " ".join(" ".join(line.lstrip("#").split()) for line in lines if line.startswith("#"))
    section = None
    seen = set()
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith(("#", " ", "]")) or line.startswith("# ") and line.endswith(" = (unset)"):
            name = line.removeprefix("# ").split(" = ")[0]
            seen.add(f"{section}.{name}" if section else name)  # before the first section: top-level ([[callbacks]])
            j = i - 1
            while lines[j].startswith("#   "):  # a wrapped comment's continuation lines
                j -= 1
            assert lines[j].startswith("# ") and "accepted: " in lines[j], (line, lines[j])
    fields = {f"{s}.{k}": f for s, sf in Config.model_fields.items() if hasattr(sf.annotation, "model_fields")
              for k, f in sf.annotation.model_fields.items()}
    fields |= {s: f for s, f in Config.model_fields.items() if not hasattr(f.annotation, "model_fields")}
    assert seen == set(fields)
    for key, field in fields.items():
        if field.description:
            assert " ".join(field.description.split()) in comments, key
    # unset keys (TOML has no null) are explained as commented-out lines
    assert "# default: unset; accepted: a number in [0, 1), or unset (leave the key out; on the command line: =none)\n# warmup_proportion = (unset)" in text
    assert '# default: "cosine"; accepted: one of "cosine", "linear", "constant", "wsd"\ndecay = "cosine"' in text
    assert "# default: [0.9, 0.95]; accepted: two numbers, each in [0, 1)\nbetas = [0.9, 0.95]" in text
    assert "#   name: short identifier" in text  # the keys of a [[data.sources]] entry


def test_accepted_values_are_read_off_the_annotation():
    from treadle.config import doc as config_doc

    class Table(BaseModel):
        n: int = Field(3, ge=2, lt=5)
        x: float | None = Field(None, gt=0.0)
        flag: bool = True
        mode: Literal["a", "b"] = "a"
        pair: tuple[Annotated[float, Field(ge=0.0, le=1.0)], Annotated[float, Field(ge=0.0, le=1.0)]] = (0.0, 1.0)
        steps: list[int] = []
        weights: dict[str, float] = {}

    said = {name: config_doc.field_accepted(f) for name, f in Table.model_fields.items()}
    assert said == {
        "n": "an integer in [2, 5)", "x": "a number > 0, or unset (leave the key out; on the command line: =none)", "flag": "true or false",
        "mode": 'one of "a", "b"', "pair": "two numbers, each in [0, 1]", "steps": "a list of integers",
        "weights": "a table of numbers",
    }


@pytest.mark.parametrize("argv, expected", [
    (["--max_steps=5"], "--max_steps=5 names no section; did you mean --train.max_steps=5?"),
    (["--max_steps", "5"], "--max_steps names no section; did you mean --train.max_steps=VALUE?"),
    (["--lr=3e-4"], "did you mean --optim.lr=3e-4?"),
    (["--train.max_steps", "5"], "--train.max_steps has no value; accepted: --train.max_steps=VALUE"),
])
def test_an_override_without_its_section_or_value_gets_a_hint(capsys, argv, expected):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


@pytest.mark.parametrize("override, expected", [
    ("--optim.betas=[0.9]", "optim.betas = [0.9] is invalid: item 2 is missing; accepted: two numbers, each in [0, 1)"),
    ("--optim.betas=[0.9, 1.5]", "optim.betas = [0.9, 1.5] is invalid: item 2 = 1.5 is out of range; accepted: two numbers, each in [0, 1)"),
    ("--resilience.inject_nan_steps=[1, 'a']", "resilience.inject_nan_steps = [1, 'a'] is invalid: item 2 = 'a' is not accepted; accepted: a list of integers"),
    ("--data.train=[1]", "data.train = [1] is invalid: item 1 = 1 is not accepted; accepted: a list of strings"),
    ("--data.sources=[{path='builtin'}]", "data.sources[0].name is missing; accepted: a string"),
    ("--data.sources={name='a'}", "data.sources = {'name': 'a'} is invalid: accepted: a list of tables"),
    ("--data.sources=[{name='a', path='builtin', wieght=1}]", "unknown key data.sources[0].wieght; did you mean data.sources[0].weight?"),
    ("--data.phases=[{start_step=1, weights={train='x'}}]", "data.phases[0].weights = {'train': 'x'} is invalid: 'train' = 'x' is not accepted; accepted: a table of numbers"),
    ("--data.phases=[{lr_scale=0.5}]", "data.phases[0].start_step is missing; accepted: an integer >= 0"),
    ("--train.max_steps=abc", "train.max_steps = 'abc' is invalid: accepted: an integer >= 1"),
    ("--train.max_steps.x=3", "train.max_steps = {'x': 3} is invalid: accepted: an integer >= 1"),
])
def test_errors_inside_a_value_name_the_key_the_user_typed(capsys, override, expected):
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"treadle: error: config error (overrides): {expected}") and err.count("\n") == 1


def test_summary_progress_shows_one_value_when_the_run_measured_once():
    from treadle.cli import _progress

    last = {"step": 3, "tau_sim": 2.5}
    assert _progress({"step": 3, "tau_sim": 2.5}, last, "tau_sim", 3) == "2.500 at step 3"
    assert _progress(None, last, "tau_sim", 3) == "2.500 at step 3"
    assert _progress({"step": 0, "tau_sim": 1.0}, last, "tau_sim", 3) == "1.000 at step 0 -> 2.500 at step 3"
