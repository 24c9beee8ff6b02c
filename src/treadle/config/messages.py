"""What a config error says: one line naming the key as the user wrote it, the value, and what is accepted.

pydantic reports an error at a location (``("data", "sources", 0, "weight")``) in its own words; ``config_error``
turns that into ``config error (my.toml): data.sources[0].weight = -1 is invalid: ...; accepted: ...``. An
unknown key gets the key it most likely meant (``nearest_key``): a typo's closest spelling, a right key in the
wrong section, or, for a name users bring from Hugging Face transformers or torchtitan (``learning_rate``,
``per_device_train_batch_size``), treadle's own name for that setting (``FOREIGN_NAMES``). A mistyped choice of a
``Literal`` (``draft.kind = "eagel3"``) likewise gets the choice it most likely meant (``nearest_value``).

Everything is read off the models passed in (``root``: the whole config's model), so this module does not
import the schema, and the schema's assignment check can use it.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from treadle.config.doc import field_accepted, item_model, list_item, model_of, toml_value
from treadle.errors import UserError

# Names from Hugging Face transformers' TrainingArguments / model configs and torchtitan's job config, with the
# treadle key that holds the same setting and, where the meaning differs, how. They are suggested, not accepted:
# one name per setting keeps the resolved config, the docs and resume's comparison of configs unambiguous, and
# several of them do not mean quite what treadle's key means (a per-device batch, epochs, a value spelt otherwise).
FOREIGN_NAMES: dict[str, tuple[str, str]] = {
    "learning_rate": ("optim.lr", ""),
    "adam_beta1": ("optim.betas", "one list: betas = [beta1, beta2]"),
    "adam_beta2": ("optim.betas", "one list: betas = [beta1, beta2]"),
    "adam_epsilon": ("optim.eps", ""),
    "max_grad_norm": ("train.grad_clip", ""),
    "max_norm": ("train.grad_clip", ""),
    "per_device_train_batch_size": ("train.micro_batch_size", "sequences per micro-batch per rank"),
    "local_batch_size": ("train.micro_batch_size", "sequences per micro-batch per rank"),
    "batch_size": ("train.micro_batch_size", "sequences per micro-batch per rank"),
    "gradient_accumulation_steps": ("train.grad_accum_steps", ""),
    "num_train_epochs": ("train.max_steps", "treadle counts optimizer steps, not epochs"),
    "epochs": ("train.max_steps", "treadle counts optimizer steps, not epochs"),
    "steps": ("train.max_steps", ""),
    "training_steps": ("train.max_steps", ""),
    "logging_steps": ("train.log_every", ""),
    "eval_steps": ("train.eval_every", ""),
    "save_steps": ("checkpoint.every", ""),
    "interval": ("checkpoint.every", ""),
    "save_total_limit": ("checkpoint.keep_last", ""),
    "keep_latest_k": ("checkpoint.keep_last", ""),
    "resume_from_checkpoint": ("checkpoint.resume", ""),
    "metric_for_best_model": ("checkpoint.best_metric", ""),
    "warmup_ratio": ("schedule.warmup_proportion", ""),
    "lr_scheduler_type": ("schedule.decay", ""),
    "lr_scheduler": ("schedule.decay", ""),
    "bf16": ("model.dtype", 'model.dtype = "bf16"'),
    "bfloat16": ("model.dtype", 'model.dtype = "bf16"'),
    "fp16": ("model.dtype", 'no fp16: model.dtype = "bf16" or "fp32"'),
    "torch_dtype": ("model.dtype", '"bf16" for bfloat16, "fp32" for float32'),
    "dtype": ("model.dtype", '"bf16" for bfloat16, "fp32" for float32'),
    "mixed_precision_param": ("model.dtype", '"bf16" for bfloat16, "fp32" for float32'),
    "torch_compile": ("model.compile", ""),
    "gradient_checkpointing": ("model.activation_checkpointing", '"full" for true'),
    "model_name_or_path": ("model.path", "a local directory"),
    "max_seq_length": ("data.seq_len", ""),
    "max_length": ("data.seq_len", ""),
    "block_size": ("data.seq_len", ""),
    "model_max_length": ("data.seq_len", ""),
    "train_file": ("data.train", ""),
    "dataset": ("data.train", ""),
    "validation_file": ("data.val", ""),
    "report_to": ("metrics.sinks", ""),
    "deepspeed": ("distributed.deepspeed_config", "a JSON file"),
}

# Values spelt as torch or Hugging Face spell them, and treadle's spelling (model.dtype = "bfloat16").
FOREIGN_VALUES = {"bfloat16": "bf16", "float32": "fp32", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of a model, dotted (``train.max_steps``, ``data.sources``)."""
    keys = []
    for name, field in model.model_fields.items():
        section = model_of(field.annotation)
        if section is not None:
            keys += all_keys(section, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def field_at(root: type[BaseModel], path: list[str]) -> FieldInfo | None:
    """The field a dotted key names (``["schedule", "warmup_steps"]``), or None."""
    model, field = root, None
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = model_of(field.annotation)
    return field


def foreign_name(key: str) -> tuple[str, str] | None:
    """(treadle's key, a note) for a name from Hugging Face or torchtitan (``optim.learning_rate``), or None."""
    return FOREIGN_NAMES.get(key.rsplit(".", 1)[-1].lstrip("-").lower())


def foreign_hint(key: str, value: str | None = None) -> str | None:
    """For a foreign name on the command line (``--learning_rate=3e-4``): 'treadle calls it optim.lr:
    --optim.lr=3e-4', or with the note where the value is spelt otherwise; None for any other name."""
    foreign = foreign_name(key)
    if foreign is None:
        return None
    near, note = foreign
    return f"treadle calls it {near} ({note})" if note else f"treadle calls it {near}: --{near}={value or 'VALUE'}"


def nearest_key(root: type[BaseModel], key: str) -> str | None:
    """The config key a mistyped one most likely meant (``train.max_stps``, ``max_steps``, ``trian``), or None."""
    foreign = foreign_name(key)
    if foreign is not None:
        return foreign[0]
    keys = all_keys(root)
    leaf = key.rsplit(".", 1)[-1]
    if "." not in key:  # a bare key that is some section's key exactly (--lr: optim.lr, not the section lora)
        exact = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
        if exact:
            return exact[0]
    sections = sorted({k.split(".")[0] for k in keys})
    pool = keys if "." in key else sections + keys
    near = difflib.get_close_matches(key, pool, n=1, cutoff=0.5)
    if not near:  # a right key in the wrong section: match on the last part alone
        near = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    return near[0] if near else None


def literal_values(annotation: Any) -> list[str]:
    """Every string a ``Literal`` anywhere in ``annotation`` allows (``Literal["auto"] | bool``, ``list[Literal[...]]``,
    ``Literal[...] | None``)."""
    if get_origin(annotation) is Literal:
        return [a for a in get_args(annotation) if isinstance(a, str)]
    return [v for arg in get_args(annotation) for v in literal_values(arg)]


def nearest_value(annotation: Any, value: str) -> str | None:
    """The choice a mistyped value most likely meant (``eagel3``, ``EAGLE3``, ``tensorbord``), or None."""
    choices = literal_values(annotation)
    lowered = {c.lower(): c for c in choices}
    near = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[near[0]] if near and lowered[near[0]] != value else None


def suggest(root: type[BaseModel], key: str, names: list[str] | None = None) -> str:
    """'; did you mean ...?' for an unknown key: among all keys, or among ``names`` (the keys of one table).

    A foreign name says what treadle calls it: '; treadle calls it optim.lr (Hugging Face: learning_rate)'.
    """
    foreign = foreign_name(key) if names is None else None
    if foreign is not None:
        near, note = foreign
        return f"; treadle calls it {near}" + (f" ({note})" if note else "")
    if names is None:
        near = nearest_key(root, key)
    else:
        near = next(iter(difflib.get_close_matches(key, names, n=1, cutoff=0.5)), None)
    return f"; did you mean {near}?" if near else ""


def _locate(root: type[BaseModel], loc: tuple) -> tuple[str, FieldInfo | None, type[BaseModel] | None, int]:
    """Where an error is, as the user wrote it: (key, its field, the table it names if any, parts of loc used).

    Sections and entries of arrays of tables are walked (``data.sources.0.weight`` -> ``data.sources[0].weight``);
    the walk stops at a plain field, so an error inside its value (``optim.betas.1``) names the key itself.
    """
    key, field, table = "", None, root
    for used, part in enumerate(loc):
        if table is None:
            entry = item_model(field.annotation) if field is not None else None
            if entry is None or not isinstance(part, int):
                return key, field, None, used
            key, table = f"{key}[{part}]", entry
            continue
        field = table.model_fields.get(str(part))
        key = f"{key}.{part}" if key else str(part)
        if field is None:
            return key, None, None, used + 1
        table = model_of(field.annotation)
    return key, field, table, len(loc)


def _lookup(tree: Any, loc: tuple, fallback: Any) -> Any:
    """The value the user gave at ``loc`` (``fallback`` if a validator reshaped it on the way)."""
    try:
        for part in loc:
            tree = tree[part]
    except (KeyError, IndexError, TypeError):
        return fallback
    return tree


# pydantic's own checks, in words: what was wrong with a value (its bound; else the "accepted: ..." says it all).
# pydantic's message itself is never shown: it speaks of Python types ("Input should be a valid list",
# "literal['all-linear']"), which a config's author did not write. A validator's ValueError is treadle's words.
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_OURS = {"value_error", "assertion_error"}


def _user_parts(value: Any, inner: tuple) -> tuple:
    """The parts of an error's location inside a value that the user wrote (an item's index, a table's key),
    without the tags pydantic adds for a union's members and validators (``literal['all-linear']``, ``list[str]``,
    ``function-after[...]``)."""
    kept = []
    for part in inner:
        if isinstance(value, (list, tuple)) and isinstance(part, int):
            kept.append(part)
            if part >= len(value):  # an item missing past the end (a tuple's)
                break
            value = value[part]
        elif isinstance(value, dict) and part in value:
            kept.append(part)
            value = value[part]
    return tuple(kept)


def _forms(field: FieldInfo, key: str) -> str:
    """How a key that takes a list of plain values is written, in a file and on the command line (its default as
    the example when it has items); '' for any other key."""
    item = list_item(field.annotation)
    if item is None:
        return ""
    default = field.get_default(call_default_factory=True)
    example = list(default) if isinstance(default, (list, tuple)) and default else None
    if example is None:
        choices = literal_values(item)
        example = choices[:2] if choices else ["a", "b"] if item is str else [1, 2]
    name = key.rsplit(".", 1)[-1]
    words = ",".join(str(x) for x in example)
    array = toml_value(example)
    return f" (in a file: {name} = {array}; on the command line: --{key}={words} or '--{key}={array}')"


def config_error(root: type[BaseModel], err: ValidationError, source: str, tree: dict | None = None,
                 section: str | None = None) -> UserError:
    """Turn pydantic's report into one line naming the key the user wrote, its value and what is accepted.

    ``tree``: what the user gave (the value is quoted from it); ``section``: the section of an assignment
    (``cfg.train.max_steps = 0``), whose report names the field alone.
    """
    e = err.errors()[0]
    loc = ((section,) if section else ()) + tuple(e["loc"])
    where = f" ({source})" if source else ""
    key, field, table, used = _locate(root, loc)
    msg = re.sub(r" or instance of \w+$", "", e["msg"].removeprefix("Value error, "))
    if e["type"] in ("extra_forbidden", "no_such_attribute"):  # a key in a file; an attribute assigned
        table_key, _, entry, _ = _locate(root, loc[:-1])
        names = [f"{table_key}.{n}" for n in entry.model_fields] if "[" in key else None
        return UserError(f"config error{where}: unknown key {key}{suggest(root, key, names)}")
    if field is None or (table is not None and e["type"] == "value_error"):
        return UserError(f"config error{where}: {msg}")  # a check across keys names its keys itself
    what = "a table" if table is not None else field_accepted(field)
    if e["type"] == "missing" and used == len(loc):
        return UserError(f"config error{where}: {key} is missing; accepted: {what}")
    value = _lookup(tree, loc[:used], e["input"]) if tree is not None else e["input"]
    ours = e["type"] in _OURS
    reason = msg if ours else "out of range" if e["type"] in _BOUND_ERRORS else ""
    inner = _user_parts(value, loc[used:])
    if inner:  # inside the value (a tuple's, list's or table's item): the key is what the user typed
        at = ", ".join(f"item {p + 1}" if isinstance(p, int) else repr(p) for p in inner)
        reason = f"{at} is missing" if e["type"] == "missing" else f"{at} = {e['input']!r}" + (
            f" is {reason}" if reason == "out of range" else f": {reason}" if reason else " is not accepted")
    if "accepted:" not in reason:
        accepted = f"accepted: {what}{_forms(field, key)}"
        reason = f"{reason}; {accepted}" if reason else accepted
    msg = reason
    spelt = FOREIGN_VALUES.get(e["input"]) if e["type"] == "literal_error" and isinstance(e["input"], str) else None
    if spelt is not None and toml_value(spelt) in msg:  # model.dtype = "bfloat16": treadle spells it "bf16"
        msg = f"{msg}; treadle spells {e['input']!r} as {spelt!r}"
    elif isinstance(e["input"], str):  # draft.kind = "eagel3", as a key typo gets one
        near = nearest_value(field.annotation, e["input"])
        msg = f"{msg}; did you mean {near!r}?" if near else msg
    return UserError(f"config error{where}: {key} = {value!r} is invalid: {msg}")
