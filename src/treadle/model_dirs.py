"""Where a model lives on disk: a Hugging Face model directory, or a treadle run's exported ``hf/``.

Light on purpose (no torch): the CLI checks ``model.path``, ``draft.target``, ``draft.init`` and
``draft.features`` here before it imports the training stack, so a Hub id given as a path (``--model.path=gpt2``)
is one line at once, not after seconds.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from treadle.errors import UserError


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def download_hint(path: Path, key: str) -> str:
    """What to do when ``path`` does not exist but reads like a Hub id (``gpt2``, ``Qwen/Qwen3-0.6B``)."""
    text = str(path)
    if path.exists() or not _HUB_ID.fullmatch(text) or path.parent.name and path.parent.is_dir():
        return ""  # a local path (runs/dmeo: runs/ is here) mistyped, not a Hub id
    local = f"models/{text.rsplit('/', 1)[-1]}"
    use = f"{key} {local}" if key.startswith("--") else f'{key} = "{local}"'
    return (f"; treadle loads models from local directories and never downloads: if {text!r} is a Hugging Face Hub "
            f"id, fetch it first (hf download {text} --local-dir {local}) and set {use}")


def resolve_model_dir(path: Path, key: str) -> Path:
    """A Hugging Face model directory as given, or a treadle run directory's exported ``hf/``."""
    path = Path(path)
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise UserError(f"{key} {path} is neither a Hugging Face model directory (config.json) nor a treadle run "
                    f"directory with an exported hf/; accepted: e.g. runs/demo or runs/demo/hf{download_hint(path, key)}")


_SAMPLE = 1 << 20


def model_fingerprint(model_dir: Path) -> str:
    """Which model a directory holds, cheaply: a hash over each file's name and size, small files whole
    (config, tokenizer), big ones (weights) by their first and last MiB, which tells other or retrained
    weights apart without reading gigabytes. Hidden files (treadle's marker) do not count."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(-_SAMPLE, 2)
            digest.update(f.read())
    return digest.hexdigest()[:16]


_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def has_weights(model_dir: Path) -> bool:
    return any(next(model_dir.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


_UNSET = object()


def check_overrides_apply(model_cfg, model_dir: Path) -> None:
    """``model.overrides`` beside a ``model.path`` with weights: the weights were trained with their config.json,
    which a model loaded from them keeps, so an override that says otherwise would be silently ignored (or, were
    it applied, break the load or change what the weights compute: another hidden_size, rope_theta, head count).
    Refused in one line; an override that agrees with the config.json is what it says already (a recipe's shape
    keys run against the model they describe), so it stands."""
    import json

    if not model_cfg.overrides or not has_weights(model_dir):
        return
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # resolve_model_dir and the load say what is wrong with it
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for key, value in model_cfg.overrides.items():
        have = config.get(key, text.get(key, _UNSET))
        if have != value:
            states = f"sets no {key}" if have is _UNSET else f"has {key} = {have!r}"
            raise UserError(f"model.overrides.{key} = {value!r} with model.path {model_dir}, whose weights' "
                            f"config.json {states}: a model with weights keeps its config.json, so the "
                            "override would be ignored; accepted: model.overrides unset (or agreeing with the "
                            "config.json), or a model.path holding only a config.json (a new model built from it)")


def check_model_paths(cfg) -> None:
    """The config's model directories exist (``model.path``, ``draft.target``), and what ``draft.init`` and
    ``draft.features`` name; one line naming the key if not (what they hold is the draft kind's to judge). Also
    ``model.overrides`` that a model.path with weights would ignore (``check_overrides_apply``)."""
    if cfg.model.path is not None:
        check_overrides_apply(cfg.model, resolve_model_dir(Path(cfg.model.path), "model.path"))
    if cfg.draft.target is not None and cfg.draft.target != "self":  # 'self': the run's own model
        resolve_model_dir(Path(cfg.draft.target), "draft.target")
    if cfg.draft.init is not None and not Path(cfg.draft.init).exists():
        raise UserError(f"draft.init {cfg.draft.init}: no such file or directory; accepted: a draft directory (a "
                        "treadle export, or one of the kind's layout trained elsewhere), a draft run directory, or "
                        f"a checkpoint that ships the draft{download_hint(Path(cfg.draft.init), 'draft.init')}")
    if cfg.draft.features is not None and not Path(cfg.draft.features).is_dir():
        raise UserError(f"draft.features {cfg.draft.features}: no such directory; accepted: a feature store written "
                        "by `treadle features CONFIG --out DIR`, or speculators' offline data (vLLM "
                        "extract_hidden_states)")
