"""treadle from Python: ``from treadle import load_config, fit, export, spec_eval, generate``.

The same functions the commands run, with keyword arguments, for notebooks and scripts. Bad input raises
``treadle.UserError`` (one line, naming the key / file / value and what is accepted), never ``SystemExit``.

A run stays a treadle run: its ``config.toml`` is the whole truth and ``treadle train runs/x/config.toml``
resumes it. So objects passed to ``fit`` (a model, a tokenizer, a dataset) are written once to a
content-addressed directory of treadle's cache, ``$TREADLE_CACHE/objects/<kind>-<sha256 prefix>``, and the
config names that directory, as if the user had saved it there. The same object gives the same directory (a
second call stores nothing new, and the data's tokenization cache hits); the cache must keep it for as long
as the run may be resumed or exported.

Heavy modules (torch, transformers) are imported when a function is called, not by ``import treadle``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from pydantic import ValidationError

from treadle.config import Config, _explain, _set_path, explicit_tree, load_config, parse_override
from treadle.corpus import _publish_dir, cache_dir
from treadle.errors import UserError
from treadle.versions import check_versions

if TYPE_CHECKING:
    from treadle.data.generate import GenerateReport
    from treadle.train.callbacks import Callback
    from treadle.train.run import RunSummary

__all__ = ["Callback", "Config", "DraftTrainer", "RunSummary", "UserError", "export", "fit", "generate", "load_config",
           "spec_eval"]


def __getattr__(name: str):  # the names whose modules import torch: loaded when asked for
    if name == "Callback":
        from treadle.train.callbacks import Callback

        return Callback
    if name == "DraftTrainer":  # a draft kept fresh beside a target another loop trains (train/draft_trainer.py)
        from treadle.train.draft_trainer import DraftTrainer

        return DraftTrainer
    if name == "RunSummary":
        from treadle.train.run import RunSummary

        return RunSummary
    raise AttributeError(f"module 'treadle.api' has no attribute {name!r}")


# ---------------------------------------------------------------------------- fit (`treadle train`; `treadle.train` is the loop's package)


def fit(config: Config | str | os.PathLike | Mapping | None = None, *,
          overrides: Mapping[str, Any] | Sequence[str] = (),
          model: Any = None, tokenizer: Any = None, dataset: Any = None, val_dataset: Any = None,
          callbacks: Sequence[Callback] = (), live: bool | None = None) -> RunSummary:
    """Train a run to ``train.max_steps`` (or resume it: ``checkpoint.resume = "auto"``); returns its summary.

    config: a ``Config``, a TOML file, a dict of sections (``{"train": {"max_steps": 50}}``), or None (the
        built-in default). The caller's ``Config`` is not changed.
    overrides: ``{"train.max_steps": 50}`` (Python values) or ``["train.max_steps=50"]`` (TOML literals, as on
        the command line); applied on top of ``config``.
    model: the model to train, a ``transformers.PreTrainedModel`` (fresh or loaded) or a model directory; it
        becomes ``model.path`` (in a draft run, ``draft.target``: the frozen target).
    tokenizer: a ``transformers`` fast tokenizer or a tokenizer directory; it becomes ``data.tokenizer``.
    dataset: a ``datasets.Dataset``, a list of row dicts (text rows, or SFT ``messages`` / ``prompt`` +
        ``completion`` rows), or a data file / shard directory; it becomes ``data.train``. Without
        ``val_dataset``, a run whose ``data.val`` is the built-in default then evaluates nothing (``data.val =
        []``): the built-in corpus is not the dataset's held-out split.
    val_dataset: the same kinds; it becomes ``data.val``.
    callbacks: ``treadle.Callback`` instances; they run after treadle's evaluation and before its checkpoint
        (see ``build_trainer``). A resumed run gets the state they saved when they are passed again.
    live: a progress bar (True), plain log lines (False), or decided by the terminal (None).

    Everything the run opened (metrics file, prefetch thread, checkpoint writer, a process group it joined)
    is closed when this returns or raises.
    """
    check_versions()
    from treadle.train.run import run_training

    cfg = _config(config, overrides, model=model, tokenizer=tokenizer, dataset=dataset, val_dataset=val_dataset)
    return run_training(cfg, live=live, callbacks=callbacks)


def _config(config, overrides, **objects) -> Config:
    """config + overrides + the objects' directories, validated once as a whole (one UserError line)."""
    if config is None:
        tree, source = {}, ""
    elif isinstance(config, Config):
        tree, source = explicit_tree(config), ""
    elif isinstance(config, (str, os.PathLike)):
        tree, source = explicit_tree(load_config(config)), str(config)
    elif isinstance(config, Mapping):
        tree, source = copy.deepcopy(dict(config)), ""
    else:
        raise UserError(f"config: {type(config).__name__} is not a config; accepted: a treadle Config, a TOML file "
                        "path, a dict of sections, or None (the built-in default)")
    if isinstance(overrides, (str, bytes)):
        raise UserError(f"overrides {overrides!r}: a single string; accepted: a list of 'section.key=value' strings "
                        "or a dict {'section.key': value}")
    items = (overrides.items() if isinstance(overrides, Mapping)
             else (parse_override(str(o)) for o in overrides))
    changed = False
    for key, value in items:
        value = os.fspath(value) if isinstance(value, os.PathLike) else value  # a path object is its string
        _set_path(tree, key.split(".") if isinstance(key, str) else key, value)
        changed = True
    if changed:
        source = f"{source} + overrides" if source else "overrides"
    _point_at_objects(tree, **objects)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise _explain(err, source) from None


def _point_at_objects(tree: dict, model, tokenizer, dataset, val_dataset) -> None:
    """Store each object passed and set the config key that names it (the config stays the run's truth)."""
    data = tree.setdefault("data", {})
    if not isinstance(data, dict):
        raise UserError("config error: data is a value, not a section")
    if model is not None:
        section = tree.get("draft")
        draft = isinstance(section, dict) and section.get("kind") is not None and section.get("target") != "self"
        key = "draft.target" if draft else "model.path"  # a draft beside its model: the object is that model
        _set_path(tree, key.split("."), str(_model_dir(model, key)))
    if tokenizer is not None:
        data["tokenizer"] = str(_tokenizer_dir(tokenizer))
    if dataset is not None:
        if data.get("sources"):
            raise UserError("dataset= and data.sources are both set; accepted: one of them (for a mixture, name each "
                            "source's file in data.sources)")
        data["train"] = [str(_data_path(dataset, "dataset"))]
        if val_dataset is None and "val" not in data:
            data["val"] = []
    if val_dataset is not None:
        data["val"] = [str(_data_path(val_dataset, "val_dataset"))]


def _model_dir(model: Any, key: str) -> Path:
    if isinstance(model, (str, os.PathLike)):
        return Path(model)
    if not callable(getattr(model, "save_pretrained", None)):
        raise UserError(f"model: {type(model).__name__} has no save_pretrained; accepted: a transformers "
                        f"PreTrainedModel or a model directory (it becomes {key})")
    return _stored("model", lambda d: model.save_pretrained(d))


def _tokenizer_dir(tokenizer: Any) -> Path:
    if isinstance(tokenizer, (str, os.PathLike)):
        return Path(tokenizer)
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise UserError(f"tokenizer: {type(tokenizer).__name__} has no save_pretrained; accepted: a transformers "
                        "tokenizer or a tokenizer directory")

    def write(d: Path) -> None:
        tokenizer.save_pretrained(d)
        if not (d / "tokenizer.json").is_file():
            raise UserError(f"tokenizer: {type(tokenizer).__name__} saves no tokenizer.json; accepted: a fast "
                            "tokenizer (PreTrainedTokenizerFast, AutoTokenizer's default)")

    return _stored("tokenizer", write)


def _data_path(dataset: Any, name: str) -> Path:
    """A data file / shard directory as it is; a datasets.Dataset or a list of rows as a stored JSONL file."""
    if isinstance(dataset, (str, os.PathLike)):
        return Path(dataset)
    if callable(getattr(dataset, "to_json", None)) and hasattr(dataset, "column_names"):  # datasets.Dataset
        if len(dataset) == 0:
            raise UserError(f"{name}: the dataset has no rows")
        return _stored("data", lambda d: dataset.to_json(d / "rows.jsonl", lines=True, force_ascii=False)) / "rows.jsonl"
    if isinstance(dataset, Iterable) and not isinstance(dataset, (Mapping, bytes)):
        rows = list(dataset)
        if not rows or not all(isinstance(r, Mapping) for r in rows):
            raise UserError(f"{name}: {'no rows' if not rows else 'a row that is not a dict'}; accepted: a non-empty "
                            "list of row dicts ({'text': ...}, {'messages': [...]}, {'prompt': ..., 'completion': ...})")

        def write(d: Path) -> None:
            try:
                text = "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows)
            except (TypeError, ValueError) as exc:
                raise UserError(f"{name}: a row cannot be written as JSON: {exc}") from None
            (d / "rows.jsonl").write_text(text, encoding="utf-8")

        return _stored("data", write) / "rows.jsonl"
    raise UserError(f"{name}: {type(dataset).__name__} is not data; accepted: a datasets.Dataset, a list of row "
                    "dicts, or a data file / shard directory path")


def _stored(kind: str, write: Callable[[Path], None]) -> Path:
    """``write`` into a private directory, then publish it as ``objects/<kind>-<hash of its files>``, the
    cache's rename rule (``corpus._publish_dir``): the name is known only once the files are written."""
    root = cache_dir() / "objects"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-", dir=root))
    try:
        write(tmp)
        final = root / f"{kind}-{_digest(tmp)[:20]}"
        return final if final.is_dir() else _publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------- the other commands


def export(source: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32", to: str = "auto",
           merge: bool = False) -> Path:
    """``treadle export``: a checkpoint (or a run's latest) as a Hugging Face directory (``to="hf"``) or a
    draft export (``to="draft"``); ``"auto"``: what the checkpoint was trained as. ``dtype`` fp32 | bf16 | fp16.
    A LoRA run: its PEFT adapter directory, or with ``merge`` the merged model. Returns the directory written."""
    check_versions()
    from treadle.checkpoint.export import export_checkpoint

    source = source if isinstance(source, str) else Path(source)  # a string may be a URL (a checkpoint.dir)
    return export_checkpoint(source, Path(out), dtype=dtype, to=to, merge=merge)


def spec_eval(target: str | os.PathLike, draft: str | os.PathLike, **options: Any) -> dict:
    """``treadle spec-eval``: speculative decoding of ``target`` with ``draft``; returns the record that
    ``--json`` writes (tau, acceptance per position, tokens/s, lossless, ...); prints nothing.

    Options, as the command's flags: gamma=4, prompts=None (a JSONL file; None: the built-in held-out split),
    num_prompts=8, prompt_len=64, max_new_tokens=64, json_path=None (also write the record there), threads=0,
    repeats=3 (timed passes: the speeds are the median pass's, speedup_min / speedup_max their spread; the record's
    ``load`` says whether the machine was loaded while they ran).
    """
    check_versions()
    from treadle.speculative.evaluate import spec_eval as run

    return run(Path(target), str(draft), **_options(run, options))


def generate(model: str | os.PathLike, prompts: str | os.PathLike, out: str | os.PathLike,
             **options: Any) -> GenerateReport:
    """``treadle generate``: answer every row of ``prompts`` with ``model`` into ``out`` (an SFT JSONL file;
    an existing one is continued); returns the report (``succeeded``, ``failed``, ``skipped``, ``failed_path``).

    Options, as the command's flags: max_new_tokens=128, temperature=0.0, top_p=1.0, batch_size=8, seed=0,
    max_prompt_tokens=None, chat_template="auto", device="auto".
    """
    check_versions()
    from treadle.data.generate import generate as run

    return run(Path(model), Path(prompts), Path(out), **_options(run, options))


def _options(fn: Callable, options: dict) -> dict:
    """Refuse an unknown keyword with one line (not a TypeError), naming what is accepted."""
    import inspect

    accepted = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; accepted: {', '.join(accepted)}")
    return options
