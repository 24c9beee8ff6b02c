"""The GLIDE draft on disk in LongSpec's layout (``draft.layout = "longspec"``).

The one place where treadle's GLIDE parameter names meet LongSpec's (sail-sg/LongSpec ``longspec/test/llama_glide.py``
and ``qwen2_glide.py``, ``LlamaGlideDecoderLayer`` / ``Qwen2GlideDecoderLayer``; its trainer's ``save_model``;
read at sail-sg/LongSpec @15e4998). treadle writes this layout (a run's ``draft/``, ``treadle export``)
and reads it back (``spec-eval --draft``, ``draft.init``), as it reads a LongSpec draft trained elsewhere.

- ``config.json``: the target's own Hugging Face config (``LlamaConfig`` / ``Qwen2Config``: LongSpec's layer reads
  ``hidden_size``, the head counts, ``intermediate_size``, ``hidden_act``, ``rms_norm_eps``, ``rope_theta``,
  ``max_position_embeddings``, ``attention_dropout``, ``initializer_range``), one layer, ``architectures`` naming
  LongSpec's class, torch dtype names, and the rotary settings also under transformers 4's keys (LongSpec pins
  4.46). treadle's metadata rides along as extra keys (``treadle_draft_kind``, ``layout``, ``window``, ``shape``,
  ``target``, ``target_config``, ``training``).
- ``model.safetensors`` (what ``from_pretrained`` loads) and ``draft_model_weights.pth`` (what LongSpec's trainer
  reloads with a strict ``load_state_dict``): the same tensors under LongSpec's names. LongSpec's cross-attention
  also builds k/v projections its forward never uses (it reads the target's K/V cache); they are written as zeros
  so a strict load finds every parameter and nothing is left to a random initialization.

Every conversion is checked both ways: a name left over or missing is refused, never written or loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treadle.errors import UserError
from treadle.model_dirs import resolve_model_dir
from treadle.drafts.glide.model import (ARCHITECTURES, KIND, GlideDraft, GlideModel, checked_export, is_layout,
                                  read_draft_config)
from treadle.drafts.targets import checked_target

# treadle's GlideDraft parameter (layout "longspec") -> LongSpec's name.
NAMES = {
    "self_norm.weight": "input_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "q_proj.bias": "self_attn.q_proj.bias",
    "k_proj.weight": "self_attn.k_proj.weight",
    "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.weight": "self_attn.v_proj.weight",
    "v_proj.bias": "self_attn.v_proj.bias",
    "o_proj.weight": "self_attn.o_proj.weight",
    "cross_norm.weight": "post_self_attention_layernorm.weight",
    "cross_q_proj.weight": "cross_attn.q_proj.weight",
    "cross_q_proj.bias": "cross_attn.q_proj.bias",
    "cross_o_proj.weight": "cross_attn.o_proj.weight",
    "mlp_norm.weight": "post_cross_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
INTERNAL = {v: k for k, v in NAMES.items()}
# Built by LongSpec, never read by its forward: written as zeros, dropped on import.
UNUSED = ("cross_attn.k_proj.weight", "cross_attn.k_proj.bias", "cross_attn.v_proj.weight", "cross_attn.v_proj.bias")


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of ``draft`` (a longspec-layout GlideDraft) in LongSpec's layout. ``weights``: the draft's
    state dict on the CPU in treadle's names and the export dtype; ``extra``: treadle's metadata keys."""
    unknown, missing = sorted(weights.keys() - NAMES.keys()), sorted(NAMES.keys() - weights.keys())
    if unknown or missing:
        raise UserError(f"glide export: the draft's weights do not match LongSpec's layout (no name for {unknown}, "
                        f"missing {missing}); nothing was written")
    tensors = {NAMES[k]: v.contiguous() for k, v in weights.items()}
    kv_out = draft.shape.num_key_value_heads * draft.shape.head_dim
    for name in UNUSED:
        shape = (kv_out, draft.shape.hidden_size) if name.endswith("weight") else (kv_out,)
        tensors[name] = torch.zeros(shape, dtype=dtype)
    return tensors, config_of(target_config, dtype, extra)


def config_of(target_config, dtype: torch.dtype, extra: dict) -> dict:
    from treadle.drafts.eagle3.layout import TORCH_DTYPE_NAMES, rope_keys

    t = target_config.to_dict()
    config = {k: v for k, v in t.items() if k not in ("_name_or_path", "transformers_version")}
    config.update({
        "architectures": [ARCHITECTURES[target_config.model_type]],
        "num_hidden_layers": 1,
        **rope_keys(t),
        "dtype": TORCH_DTYPE_NAMES[dtype],
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "use_cache": True,
    })
    if isinstance(config.get("layer_types"), list):  # one entry per layer: the draft's one layer
        config["layer_types"] = config["layer_types"][-1:]
    config.setdefault("attention_dropout", 0.0)
    config.setdefault("initializer_range", 0.02)
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"glide export: treadle's metadata keys {clash} would overwrite the layout's")
    return {**config, **extra}


def import_weights(tensors: dict, where) -> dict:
    """The state dict of a longspec-layout GlideDraft from LongSpec-named tensors (a ``model.`` / ``draft_model.``
    prefix, as a whole model's state dict has it, is taken off); a name left over or missing is refused."""
    for prefix in ("draft_model.", "glide."):
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if k not in UNUSED}
    unknown, missing = sorted(tensors.keys() - INTERNAL.keys()), sorted(INTERNAL.keys() - tensors.keys())
    if unknown or missing:
        raise UserError(f"draft {where}: its weights do not match LongSpec's GLIDE layout (unknown {unknown}, "
                        f"missing {missing})")
    return {INTERNAL[k]: v for k, v in tensors.items()}


def check_fits(config: dict, target_config, where) -> None:
    """A LongSpec-layout config.json fits ``target``: its family and dimensions."""
    want = {"model_type": target_config.model_type, "hidden_size": target_config.hidden_size,
            "num_attention_heads": target_config.num_attention_heads,
            "num_key_value_heads": getattr(target_config, "num_key_value_heads", None)
            or target_config.num_attention_heads,
            "intermediate_size": target_config.intermediate_size}
    for key, value in want.items():
        if key in config and config[key] != value:
            raise UserError(f"draft {where}: config.json {key} = {config[key]!r} does not fit the target ({value!r}); "
                            "accepted: a LongSpec GLIDE draft trained for this target")


def read_tensors(path: Path, where: str) -> dict:
    """The tensors of a LongSpec-layout draft: a directory's model.safetensors (else pytorch_model.bin, else
    draft_model_weights.pth), or a ``.pth`` / ``.bin`` / ``.safetensors`` file itself; checked finite."""
    from safetensors.torch import load_file

    from treadle.models.finite import check_tensors

    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin", "draft_model_weights.pth"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise UserError(f"draft {path}: no model.safetensors, pytorch_model.bin or draft_model_weights.pth")
    if path.suffix == ".safetensors":
        return check_tensors(load_file(str(path)), path, where)
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
        raise UserError(f"draft {path}: not a readable state dict ({str(exc).splitlines()[0]})") from None
    if isinstance(tensors, dict):  # anything else: import_weights names what is wrong with it
        check_tensors({k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}, path, where)
    return tensors


def read_draft(path, target, where: str):
    """The GlideDraft in ``path`` attached to nothing yet: a treadle GLIDE export of either layout, a LongSpec draft
    directory, or LongSpec's ``draft_model_weights.pth`` alone; checked against ``target``, and finite."""
    from safetensors.torch import load_file

    from treadle.models.finite import check_tensors

    path = Path(path)
    if path.is_file():  # LongSpec's trainer output alone: its names are the whole contract
        draft = GlideDraft(target.config, layout="longspec")
        draft.load_state_dict(import_weights(read_tensors(path, where), path))
        return draft
    config = read_draft_config(path)
    if config is None or config["treadle_draft_kind"] != KIND:
        raise UserError(f"{where} {path} is not a GLIDE draft: accepted: a treadle GLIDE export, a LongSpec draft "
                        f"directory (config.json with architectures {list(ARCHITECTURES.values())}) or its "
                        "draft_model_weights.pth")
    if "target" in config:  # treadle's own: also checked by its target's config fingerprint
        checked_export(path, target, KIND, "a GLIDE")
    layout = config.get("layout") or ("longspec" if is_layout(config) else "treadle")
    if layout == "treadle":
        draft = GlideDraft(target.config, window=config["window"])
        draft.load_state_dict(check_tensors(load_file(str(path / "model.safetensors")), path / "model.safetensors",
                                            where))
        return draft
    check_fits(config, target.config, path)
    draft = GlideDraft(target.config, layout="longspec")
    draft.load_state_dict(import_weights(read_tensors(path, where), path))
    return draft


def init_draft(cfg, target):
    """``draft.init`` of a GLIDE run: the draft it names (``read_draft``, or a treadle run directory's draft/), in
    the run's ``draft.layout``."""
    path = Path(cfg.init)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "draft" / "config.json").is_file():
        path = path / "draft"
    if not path.exists():
        raise UserError(f"draft.init {cfg.init} does not exist; accepted: a GLIDE draft directory, LongSpec's "
                        "draft_model_weights.pth, or a treadle run directory")
    draft = read_draft(path, target, "draft.init")
    if draft.layout != cfg.layout:
        raise UserError(f"draft.init {cfg.init} is a {draft.layout!r}-layout GLIDE draft but draft.layout = "
                        f"{cfg.layout!r}; accepted: draft.layout = {draft.layout!r}")
    if cfg.window and cfg.window != draft.window:
        raise UserError(f"draft.window = {cfg.window} but draft.init {cfg.init} has {draft.window}; accepted: "
                        "draft.window = 0 (the initial draft's) or equal to it")
    return draft


def load_glide(draft_dir, target) -> GlideModel:
    """An exported GLIDE draft (either layout; a LongSpec draft directory or its ``draft_model_weights.pth``)
    attached to ``target``, which must be the architecture it was trained for."""
    return GlideModel(target, read_draft(draft_dir, target, "draft")).eval()


def build_glide(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(GlideModel, target dir, target identity) for a ``DraftConfig``, checked against the data. Seed torch first.

    ``empty``: the target is built on the meta device (see ``load_causal_lm``); the draft is built whole.
    """
    target_dir = resolve_model_dir(Path(cfg.target), "draft.target")
    target, ident = checked_target(target_dir, data_vocab, data_tokenizer_fingerprint, empty)
    if cfg.init is not None:
        draft = init_draft(cfg, target)
    else:
        draft = GlideDraft(target.config, window=cfg.window, layout=cfg.layout)
    return GlideModel(target, draft), target_dir, ident
