"""docs/configuration.md, written from the config models so it cannot drift from what validation accepts.

``treadle config --reference > docs/configuration.md`` regenerates it; tests/test_config.py fails while the
committed page and ``reference()`` differ. The prose here states the rules ``load`` implements (precedence,
overrides, unsetting, exclusive keys); every table is read off the models (``doc.markdown_tables``) and off
``messages.FOREIGN_NAMES``.
"""

from __future__ import annotations

from treadle.config.doc import markdown_tables
from treadle.config.load import EXCLUSIVE, UNSET_WORDS
from treadle.config.messages import FOREIGN_NAMES
from treadle.config.schema import OWN_DATA_VAL_FRACTION, Config

COMMAND = "treadle config --reference > docs/configuration.md"


def _foreign_table() -> str:
    rows = [f"| `{name}` | `{key}` | {note} |" for name, (key, note) in sorted(FOREIGN_NAMES.items())]
    return "\n".join(["| name elsewhere | treadle's key | note |", "|---|---|---|", *rows])


def reference() -> str:
    """The whole page, Markdown, ending in one newline."""
    pairs = ", ".join(f"`{a}` / `{b}`" for a, b in EXCLUSIVE)
    first, *others = (f"`={w}`" if w else "an empty value" for w in UNSET_WORDS)
    unset = f"{first} (also {' or '.join(others)})"
    return f"""# Configuration reference

<!-- Generated from treadle's config models (src/treadle/config/schema.py) by `{COMMAND}`.
     Do not edit by hand: tests/test_config.py fails while this page and the models differ. -->

A run is configured by one TOML file, one table per section below, and `--section.key=value` overrides on
the command line. Each key takes its built-in default, unless the file sets it, unless an override does.

- `treadle config [config.toml] [overrides]` prints the resolved config a run would use, as TOML that
  `treadle train` reads back; `treadle config --explain` adds every key's meaning as comments. A run writes
  its resolved config to `<train.output_dir>/config.toml`.
- An override's value is read as a TOML literal (`--optim.betas=[0.9,0.95]`, `--data.train='["my.jsonl"]'`,
  `--train.eval_at_start=false`); a bare word is a string (`--model.dtype=bf16`).
- A key that takes a list takes it on the command line in either form: comma-separated words
  (`--lora.target_modules=q_proj,v_proj`, `--optim.betas=0.9,0.95`, `--data.train=a.jsonl,b.jsonl`; one word is
  a list of one) or the TOML array (`'--lora.target_modules=["q_proj", "v_proj"]'`). In a file, lists are TOML
  arrays. An item that holds a comma is written in the TOML form, or as a quoted string (`--data.train='"a,b.jsonl"'`).
- An unknown key is an error that names the key it most likely meant. Names from Hugging Face transformers
  and torchtitan are not accepted, one name per setting, but the error names treadle's key (table below).
- A key whose default is *unset* is unset again from the command line with {unset},
  e.g. `--schedule.warmup_proportion=none`; in a file, leave the key out. Other keys keep `none` as a
  word: `checkpoint.resume = "none"` and `model.activation_checkpointing = "none"` are values.
- Two keys of a pair say one thing two ways, so a config sets one of each:
  {pairs}.
  An override of one replaces the file's other, and says so in one line. Likewise `data.sources` replaces
  `data.train`.
- Training data of your own (`data.train` or `data.sources` naming anything but `builtin`) with neither
  `data.val` nor `data.val_fraction` set holds out `data.val_fraction = {OWN_DATA_VAL_FRACTION}` of it for
  validation; the run's start line names the validation set. `data.val = []` evaluates nothing.

{markdown_tables(Config)}

## Names from other trainers

What each of these names is called in treadle: an error suggests it when a config or an override uses the
name (`--optim.learning_rate=1e-4`: "treadle calls it optim.lr").

{_foreign_table()}
"""
