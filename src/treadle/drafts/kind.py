"""What a draft kind provides at run time; ``drafts/registry.py`` holds one ``DraftKind`` per kind by name.

Generic code (the run's assembly, export, spec-eval) asks the registry for the kind and calls these methods:
it never names a kind or imports one. A new kind is a folder ``drafts/<kind>/`` with a ``settings.py`` (its
config keys, see drafts/settings.py) and a ``kind.py`` defining a subclass of this (binding its layout's
``read_config``), listed in both registries.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def layout_config(draft_dir, is_layout, kind: str, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a draft in a kind's consumer layout (``is_layout(config)``), with ``treadle_draft_kind``
    added to one written elsewhere; None when ``draft_dir`` holds no such config. ``speculators``: the kind's
    speculators table (drafts/speculators_format.py), whose ``as_layout`` states a speculators-format config in the
    kind's layout first."""
    import json

    try:
        config = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and speculators is not None and speculators.is_layout(config):
        config = speculators.as_layout(config, draft_dir)
    if not isinstance(config, dict) or not is_layout(config):
        return None
    config.setdefault("treadle_draft_kind", kind)
    return config


def init_dir(path) -> Path:
    """``draft.init`` of any kind: a draft directory, or a treadle run directory holding one in draft/."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "draft" / "config.json").is_file():
        return path / "draft"
    return path


class DraftKind:
    settings: ModuleType  # the kind's settings.py: NAME, KEYS, TTT_STEPS, LAYOUTS, check, check_context_parallel
    # Its drafter cuts a proposal at a confidence threshold (spec-eval's --confidence-threshold; DSpark's head).
    confidence_head = False
    # Beside its model (draft.target = 'self'), its trained weights belong to the model's own checkpoint (mtp: the
    # layer DeepSeek-V3 / Qwen3-Next checkpoints ship): the model's export carries them (``write_into_model``).
    carried_by_model = False
    # Its table in the speculators format (drafts/speculators_format.py): export, is_layout, as_<layout>; None: none.
    speculators: ModuleType | None = None
    # Without one: what is missing, as ``treadle export --to speculators`` refuses the kind.
    speculators_missing = "speculators 0.9.0 defines no model of this kind"

    @property
    def name(self) -> str:
        return self.settings.NAME

    def read_config(self, draft_dir) -> dict | None:
        """The config.json of a draft in this kind's layout, with ``treadle_draft_kind`` added to one written
        elsewhere (``layout_config``), or None when ``draft_dir`` holds none; registry.read_draft_config asks the
        kinds in turn. None by default: a kind whose drafts another kind's reader recognises."""
        return None

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        """(model, target dir, target identity) for a ``DraftConfig``: the target loaded and checked (drafts/
        targets.py), the draft new or from ``draft.init``; ``empty``: built on meta, filled after sharding."""
        raise NotImplementedError

    def load(self, draft_dir, target):
        """The model a treadle export of this kind (or a draft in its consumers' layout) makes with ``target``."""
        raise NotImplementedError

    def setup(self, cfg, model, datasets):
        """A draft run's objective (the step's loss function, with ``evaluate`` and ``label``), after checking
        the run's loss settings against it; ``datasets``: the training sources' datasets."""
        raise NotImplementedError

    def drafter(self, model):
        """The model as a ``speculative.decode.Drafter`` for spec-eval."""
        raise NotImplementedError

    def max_gamma(self, config: dict) -> int | None:
        """The most drafts one proposal of an export with this ``config.json`` holds (what its drafter refuses
        beyond, at decode time), read off the config alone: spec-eval checks --gamma and a tree's depth against
        it before any weights load. None: no bound (a drafter that runs once per draft)."""
        return None

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """(weights, config.json) of the export in its consumers' layout, from the draft's weights in treadle's
        names and treadle's metadata (``meta``: target identity and config, training config); by default treadle's
        own names and config."""
        return weights, {**draft.export_config(), "dtype": dtype, **meta}

    def into_model(self, draft):
        """What puts ``draft``'s trained weights into its model's export as ``export_hf`` writes it (called with the
        directory and the export's dtype); None for a kind whose weights are not the model's."""
        if not self.carried_by_model:
            return None

        def put(model_dir: Path, dtype) -> None:
            weights = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                       for k, v in draft.state_dict().items()}
            self.write_into_model(model_dir, draft, weights)

        return put

    def write_into_model(self, model_dir: Path, draft, weights: dict) -> None:
        """Put ``draft``'s ``weights`` (treadle's names, the export's dtype) into a model export being written, in
        place (only kinds with ``carried_by_model``)."""
        raise NotImplementedError

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """Files beside model.safetensors and config.json that a consumer of this kind reads (none by default);
        ``weights`` and ``config`` are what ``export`` returned, ``target_dir`` the target's directory (the config
        names the target by what it is, not where it is)."""
