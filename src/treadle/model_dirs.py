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


def check_model_paths(cfg) -> None:
    """The config's model directories exist (``model.path``, ``draft.target``), and what ``draft.init`` and
    ``draft.features`` name; one line naming the key if not (what they hold is the draft kind's to judge)."""
    if cfg.model.path is not None:
        resolve_model_dir(Path(cfg.model.path), "model.path")
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
