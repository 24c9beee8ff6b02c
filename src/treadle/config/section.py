"""``Section``: what every ``[section]`` of the config schema is (config/schema.py): unknown keys refused, and an
assignment from Python checked as a file's value would be."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from treadle.config.messages import config_error


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # The whole config's schema, which names a section in an error: set by config/schema.py once Config exists
    # (an import of it here would be a circle).
    config_root: ClassVar[type | None] = None

    def __setattr__(self, name: str, value: Any) -> None:
        """An assignment from Python (``cfg.train.max_steps = 0``) is checked as a file would be: a bad value is
        the same one-line UserError, naming section and key; a path object is taken as its string."""
        try:
            super().__setattr__(name, os.fspath(value) if isinstance(value, os.PathLike) else value)
        except ValidationError as err:
            root = Section.config_root
            section = next((k for k, f in root.model_fields.items() if f.annotation is type(self)), None)
            raise config_error(root, err, "", section=section) from None
