"""The EAGLE-3 draft on disk: the original EAGLE layout that vLLM, SGLang, SpecForge and TensorRT-LLM load.

The one place where treadle's parameter names, config keys and layer-index convention meet the consumers'
(SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``; vllm-project/vllm ``vllm/model_executor/models/llama_eagle3.py``
@00bd1493 and ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` @0cfdd2e1; sgl-project/sglang
``python/sglang/srt/models/llama_eagle3.py`` @d737979; sgl-project/SpecForge ``configs/llama3-8B-eagle3.json``;
NVIDIA/Model-Optimizer ``modelopt/torch/export/plugins/hf_spec_export.py``). treadle writes this layout (a run's
``draft/``, ``treadle export``) and reads it back (``spec-eval --draft``, ``draft.init``): one format, not two.

- ``config.json``: a Hugging Face Llama config (``architectures = ["LlamaForCausalLMEagle3"]``, ``model_type =
  "llama"``, one layer, the target's dimensions, rotary settings and ``max_position_embeddings``,
  ``tie_word_embeddings = false``), ``vocab_size`` = the target's, ``draft_vocab_size`` = the head's rows,
  ``norm_before_residual = false``, and the three feature layers twice: top-level
  ``eagle_aux_hidden_state_layer_ids`` as ``output_hidden_states`` indices (vLLM's reading, and treadle's one
  internal convention) and ``eagle_config.eagle_aux_hidden_state_layer_ids`` as decoder-output indices, one less
  (SGLang's and SpecForge's). treadle's own metadata rides along as extra keys (``treadle_draft_kind``,
  ``target``, ``target_config``, ``training``), which Hugging Face configs keep and engines ignore.
- ``model.safetensors``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (int64 offsets: target id = draft
  id + d2t[draft id]) and ``t2d`` (bool over the target vocabulary), no prefix, no biases. A full-vocabulary draft
  gets zero offsets and an all-true ``t2d`` (SpecForge's defaults), so every engine finds what it requires.

Engines skip names they do not know without a word (SGLang) or leave a missing ``d2t`` at zero (vLLM), so
every conversion here is checked both ways: a name left over or missing is refused, never written or loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from treadle.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Other names the engines register for the same checkpoint (vLLM, llama.cpp's converter).
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")

# treadle's Eagle3Draft parameter -> the consumers' name (vLLM also accepts layers.0.* for midlayer.*).
NAMES = {
    "fc.weight": "fc.weight",
    "embed_norm.weight": "midlayer.input_layernorm.weight",
    "feature_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "mlp_norm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "final_norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
INTERNAL = {v: k for k, v in NAMES.items()}
MAP = ("d2t", "t2d")

TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Rotary and position settings copied from the target: the engines build the draft's rotary from its own config,
# and treadle trained it with the target's (serving-formats.md §6.4).
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_position_embeddings")


def is_layout(config: dict) -> bool:
    """A config.json of an EAGLE-3 draft in this layout (treadle's or one trained elsewhere)."""
    return any(a in ARCHITECTURES for a in config.get("architectures") or ())


def check_feature_layers(layers, num_layers: int, key: str) -> None:
    """What every engine can serve: exactly three strictly increasing ``output_hidden_states`` indices in 1..N-1
    (vLLM's and SGLang's fc are 3d wide, SpecForge validates three; index 0 would be decoder output -1 in SGLang's
    convention, index N is a normalized state no engine captures)."""
    layers = list(layers)
    if (len(layers) != 3 or any(not 1 <= i < num_layers for i in layers)
            or not layers[0] < layers[1] < layers[2]):
        shallow = "" if num_layers >= 4 else f"; a target with {num_layers} decoder layers has no three such layers"
        raise UserError(f"{key} = {layers}: accepted: three strictly increasing output_hidden_states indices in "
                        f"1..{num_layers - 1} (i = decoder layer i's output), what vLLM and SGLang serve{shallow}")


def layer_keys(shape, target_config) -> dict:
    """A draft layer's dimensions and rotary as a Hugging Face config states them (EAGLE-3's and DFlash's exports):
    the rotary the draft computes with (``draft_rope_parameters``), not the target's layer types' or partial
    rotation, so that a layer built from the config rotates as the trained draft did."""
    s = shape
    return {"hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "hidden_act": s.hidden_act, "rms_norm_eps": s.rms_norm_eps,
            **rope_keys({"rope_parameters": draft_rope_parameters(target_config),
                         "max_position_embeddings": target_config.to_dict().get("max_position_embeddings")})}


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of ``draft`` in the consumers' layout. ``weights``: the draft's state dict on the CPU, in
    treadle's names and already in the export dtype; ``extra``: treadle's metadata keys for config.json."""
    weights = dict(weights)
    if not draft.reduced:  # zero offsets and an all-true t2d: the identity map every engine accepts
        weights["d2t"] = torch.zeros(draft.vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(draft.target_vocab_size, dtype=torch.bool)
    unknown, missing = sorted(weights.keys() - NAMES.keys()), sorted(NAMES.keys() - weights.keys())
    if unknown or missing:
        raise UserError(f"eagle3 export: the draft's weights do not match the EAGLE-3 layout (no name for "
                        f"{unknown}, missing {missing}); nothing was written")
    tensors = {NAMES[k]: v.contiguous() for k, v in weights.items()}
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].to(torch.long), tensors["t2d"].to(torch.bool)
    return tensors, config_of(draft, target_config, dtype, extra)


def config_of(draft, target_config, dtype: torch.dtype, extra: dict) -> dict:
    check_feature_layers(draft.feature_layers, target_config.num_hidden_layers, "eagle3 export feature layers")
    s, t = draft.shape, target_config.to_dict()
    layers = list(draft.feature_layers)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **layer_keys(s, target_config),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": draft.target_vocab_size,
        "draft_vocab_size": draft.vocab_size,
        "initializer_range": t.get("initializer_range", 0.02),
        **{k: t[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if t.get(k) is not None},
        "dtype": TORCH_DTYPE_NAMES[dtype],
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
    }
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"eagle3 export: treadle's metadata keys {clash} would overwrite the layout's")
    return {**config, **extra}


def draft_rope_parameters(target_config) -> dict:
    """The rotary parameters of the draft's Llama layer (``eagle3.draft_rotary`` builds its rotary from them, the export
    writes them): the target's theta and scaling over the whole head (a ``partial_rotary_factor`` dropped: GLM-4's
    draft layer rotates every dim of its own heads), Gemma 3's ``full_attention`` set where the target has one per
    layer type (its draft layer attends over the whole context, as a full-attention layer does)."""
    rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    rope.pop("partial_rotary_factor", None)
    return rope


def rope_keys(target: dict) -> dict:
    """The target's rotary settings as both generations of readers want them: transformers 5's ``rope_parameters``
    and, mirrored from it, transformers 4's ``rope_theta`` / ``rope_scaling`` (which engines pinned to it read, as
    SpecForge's ``apply_legacy_rope_scaling`` writes them). Without them a reader falls back to theta 10000."""
    keys = {k: target[k] for k in ROPE_KEYS if target.get(k) is not None}
    params = target.get("rope_parameters")
    if isinstance(params, dict):
        keys.setdefault("rope_theta", params.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            keys.setdefault("rope_scaling", scaling)
    return {k: v for k, v in keys.items() if v is not None}


def feature_layers(config: dict, num_layers: int, where) -> tuple[int, ...]:
    """The ``output_hidden_states`` indices a draft in this layout reads: the top-level ids (vLLM's reading), else
    the nested decoder-output ids + 1 (SGLang's, SpecForge's), else the engines' default (2, N/2, N - 3)."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        layers = tuple(config["eagle_aux_hidden_state_layer_ids"])
    elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        layers = tuple(i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    else:
        layers = (2, num_layers // 2, num_layers - 3)
    check_feature_layers(layers, num_layers, f"{where}/config.json eagle_aux_hidden_state_layer_ids")
    return layers


def check_fits(config: dict, target_config, where) -> None:
    """A draft in this layout fits ``target``: the same dimensions and vocabulary (a treadle draft is also checked
    by its target's fingerprint; one trained elsewhere has only these)."""
    c = target_config  # read here, not through glide.GlideShape: glide reads this layout (no import circle)
    heads = c.num_attention_heads
    want = {"hidden_size": c.hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
            "vocab_size": c.vocab_size, "num_hidden_layers": 1}
    for key, value in want.items():
        if key in config and config[key] != value:
            raise UserError(f"draft {where}: config.json {key} = {config[key]} does not fit the target ({value}); "
                            "accepted: an EAGLE-3 draft trained for this target")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UserError(f"draft {where}: config.json has attention_bias / mlp_bias; accepted: a bias-free EAGLE-3 "
                        "draft layer (what the engines serve)")


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of ``draft`` (an Eagle3Draft) from a layout's tensors; any name left over or missing is
    refused. ``layers.0.*`` (vLLM / speculators spelling) reads as ``midlayer.*``; the target's embedding, if
    shipped, is not the draft's; a missing ``t2d`` is rebuilt from ``d2t`` (the engines never read it)."""
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    tensors.pop("embed_tokens.weight", None)
    if "d2t" in tensors and "t2d" not in tensors:
        t2d = torch.zeros(draft.target_vocab_size, dtype=torch.bool)
        t2d[tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))] = True
        tensors["t2d"] = t2d
    unknown, missing = sorted(tensors.keys() - INTERNAL.keys()), sorted(INTERNAL.keys() - tensors.keys())
    if draft.reduced and missing:
        raise UserError(f"draft {where} scores a reduced vocabulary of {draft.vocab_size} tokens but its "
                        f"model.safetensors lacks {missing}; accepted: an EAGLE-3 export with its d2t vocabulary map "
                        "(its proposals would be wrong token ids without it)")
    if unknown or missing:
        raise UserError(f"draft {where}: model.safetensors does not match the EAGLE-3 layout (unknown {unknown}, "
                        f"missing {missing})")
    state = {INTERNAL[k]: v for k, v in tensors.items()}
    if not draft.reduced:
        d2t, t2d = state.pop("d2t"), state.pop("t2d")
        if d2t.any() or not t2d.all():
            raise UserError(f"draft {where}: draft_vocab_size equals the target's vocabulary but d2t is not the "
                            "identity; accepted: zero d2t offsets for a full-vocabulary draft")
    return state


def read_config(draft_dir) -> dict:
    return json.loads((Path(draft_dir) / "config.json").read_text())
