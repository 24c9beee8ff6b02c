"""Whether a checkpoint fits this run: the same model, data and tokenizer (config and meta), the same tensors."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from treadle.checkpoint.remote import as_path
from treadle.config import flatten, show_value
from treadle.errors import UserError

# [model] keys a resumed run may change: weights are fp32 either way; in-place compile, activation checkpointing
# and the chunked loss keep parameters and their names; the router coefficients are training choices, like the lr.
_HARMLESS_MODEL_KEYS = {"model.dtype", "model.compile", "model.loss_chunk_tokens", "model.activation_checkpointing",
                        "model.activation_checkpointing_every", "model.activation_checkpointing_save_ops",
                        "model.router_aux_loss_coef", "model.router_z_loss_coef"}
# [draft] keys that shape the trained module; the rest (objective, lag, offsets, eval) are training choices.
_DRAFT_ARCH_KEYS = {"draft.kind", "draft.window", "draft.layout", "draft.feature_layers", "draft.vocab_size",
                    "draft.init", "draft.block_size", "draft.num_layers", "draft.mask_token_id"}
# Keys added after checkpoints were written without them: the value those runs had.
_DRAFT_ARCH_DEFAULTS = {"draft.layout": "treadle"}
_META_KEYS = ("vocab_size", "tokenizer_fingerprint", "target_fingerprint")


def _architecture(config: dict) -> dict[str, Any]:
    """The config keys that decide which tensors a checkpoint holds (and what its adapters compute: lora.alpha)."""
    model = {k: v for k, v in flatten(config.get("model", {}), "model.").items() if k not in _HARMLESS_MODEL_KEYS}
    draft = {k: v for k, v in flatten(config.get("draft", {}), "draft.").items() if k in _DRAFT_ARCH_KEYS}
    draft = _DRAFT_ARCH_DEFAULTS | draft
    # [lora] (older checkpoints have none: no adapters); the adapters' dropout is a training choice, base_name how
    # the export names the base
    lora = {k: v for k, v in flatten(config.get("lora", {}), "lora.").items()
            if k not in ("lora.dropout", "lora.base_name")}
    return model | draft | (lora if lora.get("lora.rank") is not None else {})


def check_compatible(path: Path, config_toml_now: str | None, meta_now: dict | None) -> None:
    """UserError if the checkpoint at ``path`` was trained as another model or on other data.

    Compares the checkpoint's ``config.toml`` ``[model]`` section (except ``_HARMLESS_MODEL_KEYS``) and the draft's kind and
    window with ``config_toml_now``, and ``vocab_size`` / ``tokenizer_fingerprint`` /
    ``target_fingerprint`` of its train_state.json ``meta`` with ``meta_now``. Everything else (steps, lr, logging, eval, data paths) may change.
    Either argument may be None to skip that half.
    """
    path = as_path(path)
    if config_toml_now is not None:
        try:
            then = _architecture(tomllib.loads((path / "config.toml").read_text()))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UserError(f"checkpoint {path}: config.toml is unreadable ({str(exc).splitlines()[0]})") from None
        now = _architecture(tomllib.loads(config_toml_now))
        for key in sorted(then.keys() | now.keys()):
            if then.get(key) != now.get(key):
                raise UserError(
                    f"checkpoint {path} was trained with {key} = {show_value(then.get(key))}, this run has "
                    f"{show_value(now.get(key))}; resume with the same model or start a new output_dir"
                )
    if meta_now is not None:
        try:
            meta_then = json.loads((path / "train_state.json").read_text()).get("meta") or {}
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise UserError(f"checkpoint {path}: train_state.json is unreadable ({str(exc).splitlines()[0]})") from None
        if meta_now.get("base_fingerprint") != meta_then.get("base_fingerprint") and "base" in meta_now:
            from treadle.models.lora import check_same_base  # a LoRA run's frozen base: the adapters fit only it

            check_same_base(meta_then.get("base"), meta_now["base"], f"checkpoint {path}")
        for key in _META_KEYS:
            if key in meta_then and key in meta_now and meta_then[key] != meta_now[key]:
                raise UserError(
                    f"checkpoint {path} was trained with {key} = {show_value(meta_then[key])}, this run has "
                    f"{show_value(meta_now[key])}; resume with the same data and tokenizer or start a new output_dir"
                )


def _tensor_shapes(obj: Any, key: tuple = ()) -> dict[tuple, tuple]:
    if isinstance(obj, torch.Tensor):
        return {key: tuple(obj.shape)}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[tuple, tuple] = {}
    for k, v in items:
        out |= _tensor_shapes(v, key + (k,))
    return out


def check_fit(path: Path, md: Metadata, state: dict, partial: bool = False) -> None:
    """One-line UserError for a tensor this model has and the checkpoint lacks (or the reverse) or a shape change.

    ``partial``: ``state`` is one pipeline stage's part of the model, so the checkpoint holding more is expected.

    DCP would report these as a multi-line CheckpointException (or, for a checkpoint
    holding more layers, not at all); the check uses the vetted metadata only.
    """
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    saved = {tuple(paths[fqn]): tuple(entry.size) for fqn, entry in md.state_dict_metadata.items()
             if isinstance(entry, TensorStorageMetadata) and fqn in paths}
    if not saved:
        return  # written by a planner that records no paths: leave it to DCP's own checks
    ours = _tensor_shapes(state)
    name = lambda k: ".".join(map(str, k))  # noqa: E731
    hint = "resume with the same model or start a new output_dir"
    for k, shape in ours.items():
        if k not in saved:
            raise UserError(f"checkpoint {path} does not fit this model: it has no {name(k)} {list(shape)}; {hint}")
        if saved[k] != shape:
            raise UserError(f"checkpoint {path} does not fit this model: {name(k)} is {list(saved[k])} there, "
                            f"{list(shape)} here; {hint}")
    for k, shape in saved.items():
        if k not in ours and not partial:
            raise UserError(f"checkpoint {path} does not fit this model: it holds {name(k)} {list(shape)}, "
                            f"which this model lacks; {hint}")
