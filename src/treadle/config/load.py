"""Reading a config: built-in defaults < a TOML file < ``--section.key=value`` overrides, validated once.

Bad input of any kind (a missing or broken file, an unknown key, a bad value, a rule across keys) ends as one
``UserError`` line (``treadle.config.messages``); nothing is read from disk but the file itself.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from treadle.config import messages
from treadle.config.schema import Config
from treadle.errors import UserError


def _explain(err: ValidationError, source: str, tree: dict | None = None, section: str | None = None) -> UserError:
    """pydantic's report on a ``Config`` as one line (``messages.config_error``)."""
    return messages.config_error(Config, err, source, tree, section)


def nearest_key(key: str) -> str | None:
    """The config key a mistyped one most likely meant (``train.max_stps``, ``max_steps``, ``trian``), or None."""
    return messages.nearest_key(Config, key)


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--section.key=value`` -> (["section", "key"], value), value read as a TOML literal.

    A bare word that is not valid TOML (``--model.dtype=bf16``) is taken as a string.
    """
    body = arg.removeprefix("--")
    if "=" not in body or not body.split("=", 1)[0]:
        raise UserError(f"bad override {arg!r}; accepted form: --section.key=value (e.g. --train.max_steps=50)")
    key, raw = body.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"config error: {'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then the overrides; raise UserError on any bad input."""
    tree: dict[str, Any] = {}
    source = ""
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            tree = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise UserError(f"config file {p} does not exist; accepted: a readable TOML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {p} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"config file {p} is not valid TOML: {exc}") from None
    for arg in overrides:
        keypath, value = parse_override(arg)
        _set_path(tree, keypath, value)
    if overrides:
        source = f"{source} + overrides" if source else "overrides"
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise _explain(err, source, tree) from None


def explicit_tree(cfg: Config) -> dict[str, Any]:
    """The values that were set (by a file, an override or an assignment), section by section.

    Validating this tree again gives the same config with every rule re-run, also the rules that ask what was set
    (data.train beside data.sources), which a full dump would trip.
    """
    def explicit(value: Any) -> Any:  # a section, or a list of tables ([[callbacks]])
        return [explicit(v) for v in value] if isinstance(value, list) else value.model_dump(exclude_unset=True)

    return {name: explicit(getattr(cfg, name)) for name in type(cfg).model_fields}
