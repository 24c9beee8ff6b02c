"""Reading a config: built-in defaults < a TOML file < ``--section.key=value`` overrides, validated once.

Bad input of any kind (a missing or broken file, an unknown key, a bad value, a rule across keys) ends as one
``UserError`` line (``treadle.config.messages``); nothing is read from disk but the file itself.
"""

from __future__ import annotations

import difflib
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from treadle.config import messages
from treadle.config.doc import list_item
from treadle.config.render import show_value
from treadle.config.schema import Config
from treadle.errors import UserError


def _explain(err: ValidationError, source: str, tree: dict | None = None, section: str | None = None) -> UserError:
    """pydantic's report on a ``Config`` as one line (``messages.config_error``)."""
    return messages.config_error(Config, err, source, tree, section)


def nearest_key(key: str) -> str | None:
    """The config key a mistyped one most likely meant (``train.max_stps``, ``max_steps``, ``trian``), or None."""
    return messages.nearest_key(Config, key)


# What an override may write for "unset" (TOML has no null): an optional key (default: unset) goes back to unset.
# Only optional keys: for others "none" stays a word some keys take as a value (checkpoint.resume = "none").
UNSET_WORDS = ("none", "null", "")


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--section.key=value`` -> (["section", "key"], value), value read as a TOML literal.

    A bare word that is not valid TOML (``--model.dtype=bf16``) is taken as a string. ``none``, ``null`` or an
    empty value for a key that may be unset (``--schedule.warmup_proportion=none``) is None: the key unset.
    """
    body = arg.removeprefix("--")
    if "=" not in body or not body.split("=", 1)[0]:
        raise UserError(f"bad override {arg!r}; accepted form: --section.key=value (e.g. --train.max_steps=50)")
    key, raw = body.split("=", 1)
    bare = False
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value, bare = raw, True
    path = key.split(".")
    if isinstance(value, str) and value.strip().lower() in UNSET_WORDS and _may_be_unset(path):
        return path, None
    return path, _as_list(path, value, bare)


def _as_list(path: list[str], value: Any, bare: bool) -> Any:
    """A list key's value as PEFT, Axolotl and shells spell it: ``--lora.target_modules=q_proj,v_proj`` (a bare
    word, commas between the items) or one item alone (``--draft.feature_layers=3``) is that list. Items of a list
    of numbers are read as TOML literals, items of a list of strings stay strings. The TOML form (``=[...]``) and a
    quoted string (``='"a,b"'``: one item holding a comma) are taken as written; so is a choice the key takes
    instead of a list (``--lora.target_modules=all-linear``), and a word close to it."""
    field = messages.field_at(Config, path)
    item = list_item(field.annotation) if field is not None else None
    if item is None or isinstance(value, (list, dict)):
        return value
    instead = [c for c in messages.literal_values(field.annotation) if c not in messages.literal_values(item)]
    if value in instead:
        return value
    near = difflib.get_close_matches(value, instead, n=1, cutoff=0.6) if isinstance(value, str) else None
    if near and "," not in value:
        return value  # all-linearr: a typo of the choice the key takes instead of a list is refused as one
    if not bare:  # a TOML scalar (3, 0.9, true, "a,b"): one item
        return [value]
    if value.lstrip().startswith(("[", "{")):  # a TOML array or table that did not parse: refused as typed
        return value
    words = [w.strip() for w in value.split(",") if w.strip()]
    if messages.literal_values(item) or item is str:
        return words
    return [_literal(w) for w in words]


def _literal(word: str) -> Any:
    try:
        return tomllib.loads(f"v = {word}")["v"]
    except tomllib.TOMLDecodeError:
        return word


def _may_be_unset(path: list[str]) -> bool:
    field = messages.field_at(Config, path)
    return field is not None and not field.is_required() and field.get_default(call_default_factory=True) is None


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"config error: {'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


# Keys that say one thing two ways, so a config sets one of them. An override of one replaces the file's other
# (the command line beats the file, as for any key; Hugging Face's warmup_steps likewise overrides warmup_ratio);
# both on the command line stay an error. What "set" means, per key: a warmup of 0 steps is one, data.val = []
# is one (no validation), but data.val_fraction = 0 turns the held-out set off and stands beside data.val.
EXCLUSIVE = (("schedule.warmup_steps", "schedule.warmup_proportion"), ("data.val", "data.val_fraction"))
_IN_EFFECT = {"data.val_fraction": bool}  # the others: anything but unset (None)


def _not_none(value: Any) -> bool:
    return value is not None


def _drop_the_other_of_a_pair(tree: dict, keypath: list[str], value: Any, overridden: list[list[str]], arg: str,
                              source: str) -> str | None:
    """``--schedule.warmup_steps=5`` on a file that sets warmup_proportion: the file's warmup_proportion goes;
    returns the line that says so. An override that unsets its key (``=none``) leaves the other as it is."""
    key = ".".join(keypath)
    other = next((b if key == a else a for a, b in EXCLUSIVE if key in (a, b)), None)
    if other is None or other.split(".") in overridden:
        return None
    section, name = other.split(".")
    table = tree.get(section)
    if not isinstance(table, dict) or name not in table:
        return None
    if not _IN_EFFECT.get(key, _not_none)(value) or not _IN_EFFECT.get(other, _not_none)(table[name]):
        return None
    return f"treadle: {arg} replaces {other} = {show_value(table.pop(name))} of {source}"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then the overrides; raise UserError on any bad input."""
    tree: dict[str, Any] = {}
    source = ""
    if path is not None:
        p = Path(path) if isinstance(path, str) else path  # a Path, or a checkpoint's in an object store
        source = str(p)
        try:
            tree = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise UserError(f"config file {p} does not exist; accepted: a readable TOML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {p} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"config file {p} is not valid TOML: {exc}") from None
    parsed = [parse_override(arg) for arg in overrides]
    notes = []
    for arg, (keypath, value) in zip(overrides, parsed):
        notes.append(_drop_the_other_of_a_pair(tree, keypath, value, [p for p, _ in parsed], arg, source))
        _set_path(tree, keypath, value)
    if overrides:
        source = f"{source} + overrides" if source else "overrides"
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise _explain(err, source, tree) from None
    for note in notes:
        if note is not None and os.environ.get("RANK", "0") == "0":  # once under a launcher
            print(note, file=sys.stderr)
    return cfg


def explicit_tree(cfg: Config) -> dict[str, Any]:
    """The values that were set (by a file, an override or an assignment), section by section.

    Validating this tree again gives the same config with every rule re-run, also the rules that ask what was set
    (data.train beside data.sources), which a full dump would trip.
    """
    def explicit(value: Any) -> Any:  # a section, or a list of tables ([[callbacks]])
        return [explicit(v) for v in value] if isinstance(value, list) else value.model_dump(exclude_unset=True)

    return {name: explicit(getattr(cfg, name)) for name in type(cfg).model_fields}
