"""Writing a config back out: TOML that ``load_config`` reads to the same config, with ``--explain`` comments, and
the keys of two configs compared (what a resume says changed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.config.doc import explained_toml
from treadle.config.schema import Config


def to_toml(cfg: Config, explain: bool = False) -> str:
    """The config as TOML that ``load_config`` reads back to the same config; ``explain``: a comment above each key
    (description, default, accepted values) and unset keys as commented-out lines (``treadle config --explain``)."""
    # TOML has no null: unset optional keys are left out and come back as None. data.sources replaces data.train,
    # and a file that sets both is refused: the default data.train is left out, so the file loads again.
    tree = cfg.model_dump(mode="json", exclude_none=True)
    if cfg.data.sources:
        del tree["data"]["train"]
    if cfg.data.val_fraction:  # likewise data.val, which data.val_fraction replaces
        del tree["data"]["val"]
    # Written by treadle's own writer, not tomli_w's, whose arrays take a line per item (betas over four lines).
    return explained_toml(Config, tree, explain=explain) + "\n"


def save_config(cfg: Config, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"overrides": {"a": 1}}}`` -> ``{"model.overrides.a": 1}``: one entry per leaf key.

    An empty table has no leaves, so ``overrides = {}`` and an unset override compare per key.
    """
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_keys(then: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every leaf key whose value differs between two config trees (None: unset), sorted."""
    a, b = flatten(then), flatten(now)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def show_value(v: Any) -> str:
    return "unset" if v is None else repr(v) if isinstance(v, str) else str(v)
