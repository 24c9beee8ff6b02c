import re
import subprocess
import sys

import pytest

from treadle.config import load_config, parse_override, save_config
from treadle.errors import UserError


def test_defaults_are_valid_and_documented_names_exist():
    cfg = load_config()
    for dotted in [
        "train.micro_batch_size", "train.grad_accum_steps", "train.max_steps", "train.seed", "train.output_dir",
        "train.log_every", "train.eval_every", "train.grad_clip", "optim.lr", "optim.weight_decay", "optim.betas",
        "schedule.warmup_steps", "schedule.warmup_proportion", "schedule.decay", "schedule.min_lr_ratio",
        "checkpoint.every", "checkpoint.keep_last", "checkpoint.resume", "model.preset", "model.path",
        "model.dtype", "model.compile", "data.seq_len", "data.train", "data.val",
    ]:
        section, key = dotted.split(".")
        assert hasattr(getattr(cfg, section), key), dotted
    assert cfg.model.dtype == "auto" and cfg.model.compile == "auto" and cfg.schedule.decay == "cosine"


def test_file_then_overrides(tmp_path):
    f = tmp_path / "my.toml"
    f.write_text('[train]\nmax_steps = 10\nseed = 3\n[optim]\nlr = 1e-2\n')
    cfg = load_config(f, ["--train.max_steps=50", "--optim.lr=3e-4", "--model.dtype=bf16", '--data.train=["a","b"]'])
    assert cfg.train.max_steps == 50  # override beats file
    assert cfg.train.seed == 3  # file beats default
    assert cfg.optim.lr == 3e-4
    assert cfg.model.dtype == "bf16"  # a bare word is a string
    assert cfg.data.train == ["a", "b"]  # TOML literal list
    assert load_config(None, ["--data.train=x"]).data.train == ["x"]  # one path is a list of one


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--train.max_stps=5", "unknown key train.max_stps; did you mean train.max_steps?"),
        ("--optim.learning_rate=1", "unknown key optim.learning_rate"),
        ("--lr=1", "did you mean optim.lr?"),
        ("--train.max_steps=abc", "train.max_steps = 'abc' is invalid"),
        ("--model.dtype=fp16", 'model.dtype = \'fp16\' is invalid: accepted: one of "auto", "fp32", "bf16", "bf16-weights", "fp8"'),
        ("--model.compile=maybe", "model.compile = 'maybe' is invalid: accepted: 'auto', true or false"),
        ("--schedule.decay=step", '"cosine", "linear", "constant", "wsd"'),
        ("--train.grad_clip=-1", "train.grad_clip = -1 is invalid: out of range; accepted: a number >= 0"),
        ("--schedule.warmup_steps=500", "schedule.warmup_steps=500 is not shorter than train.max_steps=200"),
        ("--schedule.warmup_steps=200", "(e.g. --schedule.warmup_steps=20), or schedule.warmup_proportion"),
        ("--data.val_fraction=1", "data.val_fraction = 1 is invalid"),
        ("--checkpoint.every_minutes=-1", "checkpoint.every_minutes = -1 is invalid"),
        ("--checkpoint.keep_last=0", "checkpoint.keep_last = 0 is invalid"),
        ("train.max_steps", "accepted form: --section.key=value"),
    ],
)
def test_bad_values_name_key_value_and_what_is_accepted(override, expected):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_both_warmups_is_a_cross_field_error():
    with pytest.raises(UserError, match="warmup_steps or schedule.warmup_proportion, not both"):
        load_config(None, ["--schedule.warmup_steps=5", "--schedule.warmup_proportion=0.1"])


def test_val_fraction_replaces_the_default_val_but_not_an_explicit_one():
    assert load_config(None, ["--data.val_fraction=0.1"]).data.val_fraction == 0.1
    assert load_config(None, ["--data.val_fraction=0.1", "--data.val=[]"]).data.val == []
    with pytest.raises(UserError, match=r"data.val = \['v'\] and data.val_fraction = 0.1 are both set; accepted: one"):
        load_config(None, ["--data.val_fraction=0.1", "--data.val=v"])


def test_bad_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 1\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[trian]\nmax_steps = 1\n")
    with pytest.raises(UserError, match=r"typo.toml\): unknown key trian; did you mean train\?"):
        load_config(typo)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--optim.betas=[0.8,0.99]", "--schedule.warmup_proportion=0.1", "--model.overrides={num_hidden_layers=2}"])
    path = tmp_path / "config.toml"
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert again.schedule.warmup_steps is None and again.model.path is None  # None survives TOML, which has no null
    assert cfg.warmup_steps() == 20
    # data.val_fraction replaces the default data.val: the saved config leaves it out, so it loads again.
    held = load_config(None, ["--data.val_fraction=0.05", "--train.eval_at_start=false", "--checkpoint.every_minutes=0"])
    save_config(held, path)
    assert load_config(path) == held and "val =" not in path.read_text()
    # A proportion is floored without float noise: 0.29 * 100 = 28.999999999999996.
    assert load_config(None, ["--schedule.warmup_proportion=0.29", "--train.max_steps=100"]).warmup_steps() == 29


def test_parse_override_literals():
    assert parse_override("--a.b=1") == (["a", "b"], 1)
    assert parse_override("--a.b=true") == (["a", "b"], True)
    assert parse_override("--a.b=runs/x") == (["a", "b"], "runs/x")
    assert parse_override('--a.b="1"') == (["a", "b"], "1")


def test_cli_reports_config_errors_in_one_line_with_exit_code_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "treadle", "train", "--train.max_stps=5", f"--train.output_dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "treadle: error: config error (overrides): unknown key train.max_stps; did you mean train.max_steps?"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written for bad input


def test_deepspeed_json_is_read_and_bad_ones_are_one_line(tmp_path):
    from treadle.engine import read_deepspeed_config

    good = tmp_path / "ds.json"
    good.write_text('{"zero_optimization": {"stage3_param_persistence_threshold": 0}}')
    assert read_deepspeed_config(str(good)) == {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    assert read_deepspeed_config(None) is None
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{not json")
    for name, expected in (("missing.json", "does not exist"), ("list.json", "holds a list"),
                           ("broken.json", "is not readable JSON")):
        with pytest.raises(UserError) as err:
            read_deepspeed_config(str(tmp_path / name))
        assert expected in str(err.value) and "distributed.deepspeed_config" in str(err.value)
        assert "\n" not in str(err.value)


def _literal_keys():
    """(key, choices, is a list) of every config key whose value is, or holds, a Literal's choice."""
    from typing import get_origin

    from treadle.config import Config
    from treadle.config.messages import all_keys, field_at, literal_values

    for key in all_keys(Config):
        field = field_at(Config, key.split("."))
        choices = literal_values(field.annotation)
        if choices:
            yield key, choices, get_origin(field.annotation) is list


def test_every_mistyped_choice_gets_the_choice_it_meant():
    """Issue 39: a key typo got "did you mean", a value typo (--draft.kind=eagel3) did not. Every Literal of the
    config, each choice with its last letter doubled, and a few typos as users make them."""
    keys = list(_literal_keys())
    assert {"draft.kind", "model.dtype", "model.compile", "metrics.sinks", "schedule.decay"} <= {k for k, _, _ in keys}
    for key, choices, is_list in keys:
        for choice in choices:
            typo = choice + choice[-1]
            with pytest.raises(UserError) as err:
                load_config(None, [f"--{key}=" + (f'["{typo}"]' if is_list else typo)])
            assert str(err.value).endswith(f"; did you mean {choice!r}?"), (key, str(err.value))
    for override, meant in (("--draft.kind=eagel3", "eagle3"), ("--draft.kind=EAGLE3", "eagle3"),
                            ("--schedule.decay=cosin", "cosine"), ("--model.compile=auot", "auto"),
                            ("--metrics.sinks=[\"jsonl\", \"tensorbord\"]", "tensorboard"),
                            ('--data.sources=[{name="a", path="x", format="txt"}]', "text")):  # in a table's entry
        with pytest.raises(UserError, match=f"did you mean '{meant}'"):
            load_config(None, [override])
    with pytest.raises(UserError) as err:  # nothing close: no guess
        load_config(None, ["--schedule.decay=step"])
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--optim.learning_rate=1e-4", "unknown key optim.learning_rate; treadle calls it optim.lr"),
        ("--train.per_device_train_batch_size=4", "treadle calls it train.micro_batch_size (sequences per micro-batch per rank)"),
        ("--train.gradient_accumulation_steps=4", "treadle calls it train.grad_accum_steps"),
        ("--train.num_train_epochs=3", "treadle calls it train.max_steps (treadle counts optimizer steps, not epochs)"),
        ("--schedule.warmup_ratio=0.1", "treadle calls it schedule.warmup_proportion"),
        ("--schedule.lr_scheduler_type=linear", "treadle calls it schedule.decay"),
        ("--model.bf16=true", 'treadle calls it model.dtype (model.dtype = "bf16")'),
        ("--model.dtype=bfloat16", "treadle spells 'bfloat16' as 'bf16'"),
        ("--train.max_grad_norm=1", "treadle calls it train.grad_clip"),
    ],
)
def test_hugging_face_names_are_refused_naming_treadles_key(override, expected):
    """Names users bring from transformers' TrainingArguments are not accepted (one name per setting), but the
    error names the treadle key instead of a look-alike (optim.learning_rate once got 'did you mean weight_decay')."""
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert expected in str(err.value) and "did you mean" not in str(err.value)


def test_hugging_face_names_without_a_section_on_the_command_line():
    for arg, expected in [("--learning_rate=3e-4", "--learning_rate=3e-4 is not a treadle key; treadle calls it optim.lr: --optim.lr=3e-4"),
                          ("--bfloat16=true", 'treadle calls it model.dtype (model.dtype = "bf16")'),
                          ("--weight_decay=0", "did you mean --optim.weight_decay=0?")]:
        proc = subprocess.run([sys.executable, "-m", "treadle", "config", arg], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


def test_every_foreign_name_points_at_a_real_key():
    from treadle.config import FOREIGN_NAMES, Config
    from treadle.config.messages import all_keys

    keys = set(all_keys(Config))
    assert {key for key, _ in FOREIGN_NAMES.values()} <= keys
    # draft.block_size is DFlash's (z-lab's name); an unknown block_size elsewhere is still Hugging Face's seq_len.
    assert not {name for name in FOREIGN_NAMES if any(k.endswith("." + name) for k in keys)} - {"dtype", "steps",
                                                                                              "block_size"}


@pytest.mark.parametrize("word", ["none", "null", "None", '""', ""])
def test_an_optional_key_is_unset_from_the_command_line(tmp_path, word):
    f = tmp_path / "c.toml"
    f.write_text('[schedule]\nwarmup_proportion = 0.1\n[train]\ntime_limit = "1h"\n')
    cfg = load_config(f, [f"--schedule.warmup_proportion={word}", f"--train.time_limit={word}"])
    assert cfg.schedule.warmup_proportion is None and cfg.train.time_limit is None and cfg.warmup_steps() == 0
    assert parse_override(f"--model.path={word}") == (["model", "path"], None)


def test_none_stays_a_value_for_keys_that_take_it():
    """Only keys whose default is unset can be unset: elsewhere 'none' is a value (checkpoint.resume = 'none')."""
    cfg = load_config(None, ["--checkpoint.resume=none", "--model.activation_checkpointing=none"])
    assert cfg.checkpoint.resume == "none" and cfg.model.activation_checkpointing == "none"
    with pytest.raises(UserError, match=r"train.max_steps = 'none' is invalid"):
        load_config(None, ["--train.max_steps=none"])


def test_the_accepted_words_say_how_to_unset():
    with pytest.raises(UserError, match=r"accepted: an integer >= 0, or unset \(leave the key out; on the command line: =none\)"):
        load_config(None, ["--schedule.warmup_steps=abc"])


def test_an_override_of_one_of_two_exclusive_keys_replaces_the_files_other(tmp_path, capsys):
    """Hugging Face's warmup_steps overrides warmup_ratio, and the command line beats the file: an override of one
    of a pair drops the file's other, saying so in one line. Both on the command line stay an error."""
    f = tmp_path / "c.toml"
    f.write_text('[schedule]\nwarmup_proportion = 0.1\n[data]\nval_fraction = 0.05\n')
    cfg = load_config(f, ["--schedule.warmup_steps=5", "--data.val=[]"])
    assert cfg.schedule.warmup_steps == 5 and cfg.schedule.warmup_proportion is None and cfg.warmup_steps() == 5
    assert cfg.data.val == [] and cfg.data.val_fraction == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"treadle: --schedule.warmup_steps=5 replaces schedule.warmup_proportion = 0.1 of {f}",
                   f"treadle: --data.val=[] replaces data.val_fraction = 0.05 of {f}"]
    g = tmp_path / "g.toml"
    g.write_text('[schedule]\nwarmup_steps = 5\n')
    assert load_config(g, ["--schedule.warmup_proportion=0.2"]).warmup_steps() == 40
    assert "replaces schedule.warmup_steps = 5" in capsys.readouterr().err
    # Unsetting one of a pair, or turning the held-out set off, keeps the file's other key.
    assert load_config(g, ["--schedule.warmup_proportion=none"]).warmup_steps() == 5
    v = tmp_path / "v.toml"
    v.write_text('[data]\nval = ["mine.jsonl"]\n')
    assert load_config(v, ["--data.val_fraction=0"]).data.val == ["mine.jsonl"]
    assert load_config(f, ["--schedule.warmup_steps=0"]).warmup_steps() == 0  # no warmup: replaces the proportion
    assert capsys.readouterr().err == f"treadle: --schedule.warmup_steps=0 replaces schedule.warmup_proportion = 0.1 of {f}\n"
    with pytest.raises(UserError, match=r"not both; accepted: one of them \(an override of one replaces the file's "
                                         r"other; --schedule.warmup_steps=none unsets it\)"):
        load_config(f, ["--schedule.warmup_steps=5", "--schedule.warmup_proportion=0.2"])
    assert capsys.readouterr().err == ""  # nothing said about a config that is refused


def test_the_configuration_reference_is_generated_from_the_models():
    """docs/configuration.md is what the models say today: a key added, renamed or re-described without
    regenerating the page fails here, with the command that regenerates it."""
    from pathlib import Path

    from treadle.config.reference import COMMAND, reference

    page = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert page.is_file() and page.read_text() == reference(), f"docs/configuration.md is out of date; run: {COMMAND}"
    text = reference()
    for line in ("| `max_steps` | `200` | an integer >= 1 | optimizer steps of the whole run |",
                 "### [[data.sources]]",
                 "| `learning_rate` | `optim.lr` |  |"):
        assert line in text


def test_the_reference_catches_a_changed_key(monkeypatch):
    """The comparison above can fail: a description changed in the models changes the page."""
    from treadle.config import TrainConfig
    from treadle.config.reference import reference

    before = reference()
    monkeypatch.setattr(TrainConfig.model_fields["max_steps"], "description", "optimizer steps, said otherwise")
    assert reference() != before and "optimizer steps, said otherwise" in reference()


def test_treadle_config_reference_prints_the_page():
    from treadle.config.reference import reference

    proc = subprocess.run([sys.executable, "-m", "treadle", "config", "--reference"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == reference()


def test_data_train_beside_a_files_sources_says_how_to_drop_them(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[[data.sources]]\nname = "a"\npath = "builtin"\n[[data.phases]]\nstart_step = 5\nweights = { a = 1.0 }\n')
    with pytest.raises(UserError, match=r"--data.sources=\[\] drops a file's sources, and --data.phases=\[\] its phases"):
        load_config(f, ["--data.train=x.jsonl"])
    assert load_config(f, ["--data.train=x.jsonl", "--data.sources=[]", "--data.phases=[]"]).data.train == ["x.jsonl"]


def _list_keys() -> list[str]:
    from treadle.config.doc import list_item
    from treadle.config.messages import all_keys, field_at
    from treadle.config.schema import Config

    return [k for k in all_keys(Config) if list_item(field_at(Config, k.split(".")).annotation) is not None]


def _outcome(overrides: list[str]):
    """The resolved config's dump, or the error's line with the value as it was typed taken out."""
    try:
        return load_config(None, overrides).model_dump()
    except UserError as exc:
        return str(exc).split(" is invalid")[-1]


@pytest.mark.parametrize("key", _list_keys())
def test_every_list_key_takes_a_comma_list_as_its_toml_array(key):
    """--key=a,b is the TOML array --key=[a, b] (numbers read as numbers, words as strings), for every key that
    takes a list: the same config, or the same refusal."""
    from treadle.config.doc import list_item
    from treadle.config.messages import field_at, literal_values
    from treadle.config.schema import Config

    item = list_item(field_at(Config, key.split(".")).annotation)
    words = (literal_values(item) or ["a", "b"])[:2] if literal_values(item) or item is str else ["1", "2"]
    array = "[" + ", ".join(f'"{w}"' if literal_values(item) or item is str else w for w in words) + "]"
    assert _outcome([f"--{key}={','.join(words)}"]) == _outcome([f"--{key}={array}"])
    assert _outcome([f"--{key}={words[0]}"]) == _outcome([f"--{key}={array.split(',')[0].rstrip(']')}]"])


def test_comma_lists_as_peft_users_type_them():
    cfg = load_config(None, ["--lora.target_modules=q_proj,v_proj", "--optim.betas=0.85, 0.9",
                             "--metrics.sinks=console,jsonl", "--lora.modules_to_save=lm_head"])
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.optim.betas == (0.85, 0.9)
    assert cfg.metrics.sinks == ["console", "jsonl"] and cfg.lora.modules_to_save == ["lm_head"]
    assert load_config(None, ["--lora.target_modules=all-linear"]).lora.target_modules == "all-linear"
    assert load_config(None, ['--data.train="a,b.jsonl"']).data.train == ["a,b.jsonl"]  # quoted: one item
    with pytest.raises(UserError) as err:  # the TOML form of a string list wants its strings quoted
        load_config(None, ["--lora.target_modules=[q_proj]"])
    assert "--lora.target_modules=a,b" in str(err.value) and "literal" not in str(err.value)


# What pydantic says in its own words, naming Python's types: never in a config error.
_PYDANTIC_WORDS = re.compile(r"Input should|literal\[|list\[|tuple\[|dict\[|valid (list|tuple|integer|number|string|"
                             r"dictionary|boolean)|Value error|pydantic|unable to (parse|interpret)|instance of|type=|"
                             r"NoneType|\b(int|float|str|bool)\b")
_BAD_VALUES = ["zzz-bad", "{ x = 1 }", "[{ x = 1 }]", "-5", "1.5", '[1, "a"]', "a,b", "true", "[]"]


def test_no_config_error_speaks_pydantic():
    """Every key of the schema fed values of every wrong kind: each refusal is one line in the user's words
    (the accepted forms), never pydantic's type names, and never a crash."""
    from treadle.config.messages import all_keys
    from treadle.config.schema import Config

    refused = 0
    for key in all_keys(Config):
        for value in _BAD_VALUES:
            try:
                load_config(None, [f"--{key}={value}"])
            except UserError as exc:
                refused += 1
                line = str(exc)
                assert "\n" not in line and "accepted" in line or "did you mean" in line or "both set" in line, line
                assert not _PYDANTIC_WORDS.search(line), (key, value, line)
    assert refused > 5 * len(all_keys(Config))
