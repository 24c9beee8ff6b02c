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

from treadle.compat import require_model_type
from treadle.config import ModelConfig
from treadle.corpus import cache_dir
from treadle.errors import UserError, first_line
from treadle.models.finite import check_module
from treadle.model_dirs import check_overrides_apply, has_weights, resolve_model_dir
from treadle.tokenizer import ID_KEYS, RunTokenizer, stated_ids


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("treadle.presets").iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> dict:
    if name not in preset_names():
        raise UserError(f"model.preset = {name!r} is unknown; accepted: {', '.join(preset_names())}")
    return json.loads(resources.files("treadle.presets").joinpath(f"{name}.json").read_text())


def build_model(cfg: ModelConfig, vocab_size: int, empty: bool = False,
                tokenizer: RunTokenizer | None = None) -> PreTrainedModel:
    """An fp32 model on CPU; the caller moves it and seeds torch beforehand (init is random).

    ``tokenizer``: the run's (``vocab_size`` tokens): a model whose vocabulary is smaller is refused, and its
    bos / eos / pad ids are written into the model's config and generation config, before the model is built
    where it is built from a config, so a model and its tokenizer never disagree (an export writes both). None: a
    tokenizer of ``vocab_size`` tokens whose ids are not known (tests, models built in Python).
    ``empty``: a model from ``model.path`` is built on the meta device, its weights read later, shard by shard
    (``sharded_load.materialize``), where the files allow it. Says nothing: the run prints ``vocabulary_fit``'s and
    ``from_scratch_line``'s lines, once, where it should.
    """
    tokenizer = tokenizer or RunTokenizer(vocab_size)
    scratch = config_only_dir(cfg)
    if cfg.path is not None and scratch is None:
        check_overrides_apply(cfg, resolve_model_dir(Path(cfg.path), "model.path"))  # the CLI checked; fit() not
        model = load_causal_lm(Path(cfg.path), "model.path", empty)
        vocabulary_fit(model.config.vocab_size, tokenizer, cfg)
    else:
        hf_config = _config_json(scratch, cfg) if scratch is not None else _preset_config(cfg, vocab_size)
        vocabulary_fit(hf_config.vocab_size, tokenizer, cfg)  # before a large embedding is allocated
        for key, value in stated_ids(hf_config.to_dict(), tokenizer.ids, generation=False).items():
            setattr(hf_config, key, value)  # before the build: the embedding's padding_idx is read from it
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    state_tokenizer_ids(model, tokenizer.ids)
    # Packed sequences only stay isolated on CPU sdpa/eager without a KV cache (PLATFORM.md).
    model.config.use_cache = False
    return model


def _preset_config(cfg: ModelConfig, vocab_size: int):
    fields = load_preset(cfg.preset) | {"vocab_size": vocab_size} | cfg.overrides
    model_type = fields.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.overrides / preset {cfg.preset!r} give an invalid HF config: {exc}") from None
    check_overrides(hf_config, cfg.overrides)
    return hf_config


def _config_json(path: Path, cfg: ModelConfig):
    """The HF config of a ``model.path`` that holds a config.json and no weights, ``model.overrides`` on top (its
    vocab_size above all: a config written for another tokenizer)."""
    from treadle.quiet import hf_quiet

    require_model_type(path, "model.path")
    try:
        with hf_quiet():
            read = AutoConfig.from_pretrained(path)
        hf_config = type(read)(**(read.to_dict() | cfg.overrides))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model.path {path}: its config.json (with model.overrides) cannot build an "
                        f"AutoModelForCausalLM: {first_line(exc)}") from None
    if type(hf_config) not in AutoModelForCausalLM._model_mapping:  # a config with no causal LM (a multimodal one)
        raise UserError(f"model.path {path}: model_type {hf_config.model_type!r} has no AutoModelForCausalLM in "
                        "the installed transformers; accepted: a decoder-only language model's config.json")
    check_overrides(hf_config, cfg.overrides)
    return hf_config


def state_tokenizer_ids(model: PreTrainedModel, ids: dict) -> None:
    """The tokenizer's bos / eos / pad ids (``ids``: the keys known) in ``model``'s config and generation config,
    as ``tokenizer.stated_ids`` says each file states them."""
    for target, generation in ((model.config, False), (getattr(model, "generation_config", None), True)):
        if target is None:  # a model that cannot generate has no generation config
            continue
        current = {key: getattr(target, key, None) for key in ID_KEYS}
        for key, value in stated_ids(current, ids, generation).items():
            setattr(target, key, value)


# Twice the tokenizer's size: models round their embedding up to a multiple of 64 or 128 rows (Qwen3 keeps 151,669
# tokens in 151,936 rows, Phi-3 32,011 in 32,064: well under 1% spare), so more than twice is another tokenizer's
# vocabulary, not padding; over half the embedding and head rows would then take parameters, optimizer state and
# head FLOPs and never see a token.
FAR_LARGER = 2.0


def _vocabulary_remedy(cfg: ModelConfig, size: int) -> tuple[str, str]:
    """(what gave the model its vocabulary, what would make it fit a tokenizer of ``size`` tokens), for lines."""
    own = "data.tokenizer = the model's own tokenizer directory"
    if cfg.path is None:  # the preset takes the tokenizer's size: only model.overrides changes it
        return (f"model.preset {cfg.preset!r} with model.overrides",
                f"model.overrides without vocab_size (the tokenizer's), or vocab_size = {size}")
    if config_only_dir(cfg) is not None:
        return f"model.path {cfg.path} (config.json)", f"{own}, or model.overrides = {{vocab_size = {size}}}"
    return f"model.path {cfg.path}", own


def vocabulary_fit(vocab: int, tokenizer: RunTokenizer, cfg: ModelConfig) -> str | None:
    """Refuse a model vocabulary smaller than the tokenizer's (its ids would index past the embedding); a warning
    line (for the run's console) when it is more than FAR_LARGER times the tokenizer's, else None."""
    source, remedy = _vocabulary_remedy(cfg, tokenizer.size)
    if vocab < tokenizer.size:
        raise UserError(f"{source} has vocab_size {vocab:,}, smaller than {tokenizer.describe()}; accepted: a "
                        f"vocabulary that covers the tokenizer: {remedy}")
    if vocab > FAR_LARGER * tokenizer.size:
        return (f"treadle: warning: {source} has vocab_size {vocab:,}, {vocab / tokenizer.size:.1f}x "
                f"{tokenizer.describe()}: {1 - tokenizer.size / vocab:.0%} of the embedding rows are never used; "
                f"set {remedy}")
    return None


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


def config_only_dir(cfg: ModelConfig) -> Path | None:
    """The directory of a ``model.path`` that holds a config.json and no weights (the usual way to say "train this
    architecture from scratch"), else None."""
    if cfg.path is None:
        return None
    model_dir = resolve_model_dir(Path(cfg.path), "model.path")
    return None if has_weights(model_dir) else model_dir


def from_scratch_line(cfg: ModelConfig) -> str | None:
    """The line a fresh run from a config.json without weights starts with (a resumed run's weights are its
    checkpoint's, an export's are the checkpoint's: neither says it)."""
    path = config_only_dir(cfg)
    if path is None:
        return None
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    return (f"treadle: model.path {path} holds a config.json and no weights: a {model_type} model built from it "
            "with random weights (training from scratch)")


def load_causal_lm(path: Path, key: str, empty: bool = False) -> PreTrainedModel:
    """An fp32 ``AutoModelForCausalLM`` from a local directory, in eval mode; bad input is one line.

    ``empty``: on the meta device, to be filled by ``sharded_load.materialize`` once sharded; loaded whole (with a
    line saying why) when its files cannot be read part by part. Weights that are not all finite are refused
    (models/finite.py): here when loaded whole, as they are read when filled later.
    """
    from treadle.quiet import hf_quiet

    path = resolve_model_dir(path, key)
    require_model_type(path, key)
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
