"""``[[callbacks]]``: a user's Callback classes, imported and constructed when a run is built.

``path`` is ``package.module:ClassName`` (importable, the working directory included) or
``path/to/file.py:ClassName`` (a file, relative to the working directory); ``args`` are the constructor's keyword
arguments. Every rank constructs its own; a bad path, a class that is not a ``treadle.Callback`` or a constructor
that raises is one line naming the entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from treadle.config import CallbackConfig
from treadle.errors import UserError, first_line
from treadle.train.callbacks import Callback

_ACCEPTED = "accepted: 'package.module:ClassName' (importable) or 'path/to/file.py:ClassName', a treadle.Callback subclass"


def _import(module: str) -> ModuleType:
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path.resolve()}")
        name = f"treadle_user_callbacks.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # dataclasses and pickling look a class's module up by name
        spec.loader.exec_module(loaded)
        return loaded
    if "" not in sys.path and str(Path.cwd()) not in sys.path:  # the `treadle` script's sys.path lacks the cwd
        sys.path.append(str(Path.cwd()))
    return importlib.import_module(module)


def load_callbacks(entries: list[CallbackConfig]) -> list[Callback]:
    callbacks = []
    for i, entry in enumerate(entries):
        key = f"callbacks[{i}]"
        module, _, name = entry.path.rpartition(":")
        try:
            cls = getattr(_import(module), name)
        except Exception as exc:  # noqa: BLE001 - whatever a user's module raises on import is reported, in one line
            raise UserError(f"{key}.path = {entry.path!r} cannot be loaded ({type(exc).__name__}: {first_line(exc)}); "
                            f"{_ACCEPTED}") from None
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise UserError(f"{key}.path = {entry.path!r} is not a treadle.Callback subclass; {_ACCEPTED}")
        try:
            callbacks.append(cls(**entry.args))
        except Exception as exc:  # noqa: BLE001
            said = f"{key}: {name}(**{entry.args!r}) raised {type(exc).__name__}: {first_line(exc)}"
            raise UserError(said if "accepted:" in said else f"{said}; accepted: the keyword arguments {name}'s "
                            f"constructor takes, in {key}.args") from None
    return callbacks
