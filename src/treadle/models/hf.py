"""Build or load any Hugging Face ``AutoModelForCausalLM``.

Models know nothing about parallelism or the loop: this module only turns a
``[model]`` config section into an ``nn.Module``. Presets are data
(``treadle/presets/<name>.json``, HF config fields), so adding one is adding a file.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from importlib import resources
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

from treadle.config import ModelConfig
from treadle.corpus import cache_dir
from treadle.errors import UserError, first_line
from treadle.models.finite import check_module
from treadle.model_dirs import resolve_model_dir


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("treadle.presets").iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> dict:
    if name not in preset_names():
        raise UserError(f"model.preset = {name!r} is unknown; accepted: {', '.join(preset_names())}")
    return json.loads(resources.files("treadle.presets").joinpath(f"{name}.json").read_text())


def build_model(cfg: ModelConfig, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
                empty: bool = False) -> PreTrainedModel:
    """An fp32 model on CPU; the caller moves it and seeds torch beforehand (init is random).

    ``empty``: a model from ``model.path`` is built on the meta device, its weights read later, shard by shard
    (``sharded_load.materialize``), where the files allow it.
    """
    if cfg.path is not None and not has_weights(resolve_model_dir(Path(cfg.path), "model.path")):
        model = _from_config_json(resolve_model_dir(Path(cfg.path), "model.path"))
    elif cfg.path is not None:
        model = load_causal_lm(Path(cfg.path), "model.path", empty)
        if model.config.vocab_size < vocab_size:
            raise UserError(
                f"model.path {cfg.path} has vocab_size {model.config.vocab_size}, smaller than the data's "
                f"{vocab_size}; accepted: a model whose vocabulary covers the tokenizer"
            )
    else:
        fields = load_preset(cfg.preset) | {"vocab_size": vocab_size, "bos_token_id": bos_id, "eos_token_id": eos_id}
        fields |= cfg.overrides
        model_type = fields.pop("model_type")
        try:
            hf_config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, TypeError) as exc:
            raise UserError(f"model.overrides / preset {cfg.preset!r} give an invalid HF config: {exc}") from None
        check_overrides(hf_config, cfg.overrides)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # Packed sequences only stay isolated on CPU sdpa/eager without a KV cache (PLATFORM.md).
    model.config.use_cache = False
    return model


def check_overrides(hf_config, overrides: dict) -> None:
    """A Hugging Face config keeps any keyword it does not take as a plain attribute, so a misspelt
    ``model.overrides`` key (``hiden_size``) would build the preset's model silently. A key the config class takes,
    or one it consumed (transformers 5 folds ``rope_theta`` into ``rope_parameters``), is fine. Another one close
    to a field the class takes is a typo: refused, unless the model's own code reads it (Qwen3-MoE's modeling reads
    ``head_dim``, which its config class does not declare). Any other is kept, with one line saying so."""
    import difflib

    cls = type(hf_config)
    known = (set(inspect.signature(cls.__init__).parameters) | set(cls().to_dict()) | set(cls.attribute_map)) - {
        "self", "kwargs"}
    model_source = inspect.getsource(sys.modules[AutoModelForCausalLM._model_mapping[cls].__module__])
    for key in overrides:
        if key in known or not hasattr(hf_config, key) or f"config.{key}" in model_source or f'"{key}"' in model_source:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        if close:
            raise UserError(f"model.overrides.{key} is not a field of transformers' {cls.__name__} (it would be "
                            f"kept and ignored); did you mean {close[0]}? accepted: the fields of {cls.__name__}")
        print(f"treadle: model.overrides.{key} is not a field {cls.__name__} declares: kept as a config attribute, "
              "which only model code that looks for it reads", file=sys.stderr)


# What a Hugging Face directory keeps its weights in (one file, or shards and their index).
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def has_weights(model_dir: Path) -> bool:
    return any(next(model_dir.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


def _from_config_json(path: Path) -> PreTrainedModel:
    """model.path at a directory that holds a config.json and no weights: that architecture, random weights (the
    usual way to say "train this model from scratch"), with one line saying so."""
    from treadle.quiet import hf_quiet

    try:
        with hf_quiet():
            hf_config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model.path {path}: its config.json cannot build an AutoModelForCausalLM: {first_line(exc)}") from None
    print(f"treadle: model.path {path} holds a config.json and no weights: a {hf_config.model_type} model built from "
          "it with random weights (training from scratch)", file=sys.stderr)
    return model


def load_causal_lm(path: Path, key: str, empty: bool = False) -> PreTrainedModel:
    """An fp32 ``AutoModelForCausalLM`` from a local directory, in eval mode; bad input is one line.

    ``empty``: on the meta device, to be filled by ``sharded_load.materialize`` once sharded; loaded whole (with a
    line saying why) when its files cannot be read part by part. Weights that are not all finite are refused
    (models/finite.py): here when loaded whole, as they are read when filled later.
    """
    from treadle.quiet import hf_quiet

    path = resolve_model_dir(path, key)
    if empty:
        from treadle.models.sharded_load import empty_causal_lm

        model, why = empty_causal_lm(path, key)
        if model is not None:
            return model
        print(f"treadle: {key} {path} is loaded whole on every rank: {why}", file=sys.stderr)
    try:
        with hf_quiet():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{key} {path} cannot be loaded as an AutoModelForCausalLM: {first_line(exc)}") from None
    check_module(model, path, key)  # NaN / inf weights: refused here, not read later as a diverging run
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of decoder blocks: the unit we compile (and, later, shard)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not candidates:
        raise UserError(f"{type(model).__name__} has no list of decoder layers to compile; set model.compile = false")
    return max(candidates, key=len)


def persistent_compile_cache() -> None:
    """torch.compile's on-disk caches (inductor's FX graphs and kernels) in treadle's cache directory rather than
    /tmp, so a later run of the same shapes skips code generation; an explicit TORCHINDUCTOR_CACHE_DIR wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def compile_layers(model: nn.Module) -> None:
    # In-place Module.compile keeps parameter names, so checkpoints and HF export are unchanged.
    for layer in decoder_layers(model):
        layer.compile()


def _numel(p: nn.Parameter) -> int:
    return getattr(p, "ds_numel", p.numel())  # DeepSpeed ZeRO-3 leaves an empty tensor in a partitioned parameter


def count_parameters(model: nn.Module) -> int:
    return sum(_numel(p) for p in model.parameters())


def trainable_parameters(model: nn.Module) -> int:
    return sum(_numel(p) for p in model.parameters() if p.requires_grad)


def cache_kwargs(model: nn.Module, cache: DynamicCache) -> dict:
    """How ``model``'s forward takes a KV cache: ``cache=`` from transformers 5.24 on, where ``past_key_values=``
    warns (FutureWarning) and goes in 5.40; ``past_key_values=`` in 5.23 (which would silently ignore ``cache=``),
    and in remote-code models or wrappers whose forward does not name ``cache``."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def empty_cache(model: nn.Module) -> DynamicCache:
    """A cache for a decode that is never cropped. A hybrid model's linear-attention (Gated-DeltaNet) layers keep
    their conv and recurrent state in layers a bare ``DynamicCache`` does not have, so they get the config's; other
    models keep the bare one they always had (full, croppable layers)."""
    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        return DynamicCache(config=model.config)
    return DynamicCache()


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[N, P] prompts of one length -> [N, P + new_tokens], continued greedily by the target."""
    was_training = target.training
    target.eval()
    cache = empty_cache(target)
    out = target(input_ids=prompts, use_cache=True, **cache_kwargs(target, cache))
    tokens = [prompts]
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = target(input_ids=nxt, use_cache=True, **cache_kwargs(target, cache))
    target.train(was_training)
    return torch.cat(tokens, dim=1)
