"""Typed run configuration: built-in defaults < TOML file < ``--section.key=value``.

Every section is a pydantic model that forbids unknown keys, so a typo is an error with a "did you mean" hint
instead of a silently ignored setting. The resolved config is written into the run directory as TOML and can be
passed back to ``treadle train`` unchanged (``load_config(path)`` round-trips).

The parts, each readable on its own:

- ``schema``: the sections' models and ``Config`` (every key, its type, bounds, default and description);
- ``load``: the TOML file and the command line's overrides, validated into a ``Config``;
- ``messages``: what a config error says (the key as written, what is accepted, did you mean);
- ``render``: a ``Config`` written back as TOML (``--explain``), and two configs compared;
- ``doc``: a pydantic model's fields in words (what ``--explain``, errors and the reference say);
- ``reference``: docs/configuration.md (``treadle config --reference``), checked current by tests/test_config.py.

Everything is imported from here: ``from treadle.config import Config, load_config``.
"""

from treadle.config.load import _explain, _set_path, explicit_tree, load_config, nearest_key, parse_override
from treadle.config.messages import FOREIGN_NAMES, foreign_hint
from treadle.config.render import changed_keys, flatten, save_config, show_value, to_toml
from treadle.config.schema import (
    OWN_DATA_VAL_FRACTION,
    CallbackConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    DraftConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    PhaseConfig,
    ProfileConfig,
    ResilienceConfig,
    ScheduleConfig,
    Section,
    SourceConfig,
    TrainConfig,
    parse_duration,
)

__all__ = [
    "FOREIGN_NAMES", "foreign_hint", "CallbackConfig", "CheckpointConfig", "Config", "DataConfig", "DistributedConfig", "DraftConfig", "LoraConfig",
    "MetricsConfig", "ModelConfig", "OWN_DATA_VAL_FRACTION", "OptimConfig", "PhaseConfig", "ProfileConfig", "ResilienceConfig",
    "ScheduleConfig", "Section", "SourceConfig", "TrainConfig", "changed_keys", "explicit_tree", "flatten",
    "load_config", "nearest_key", "parse_duration", "parse_override", "save_config", "show_value", "to_toml",
]
