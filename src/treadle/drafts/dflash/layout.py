"""The DFlash draft on disk: z-lab's ``DFlashDraftModel`` layout, what vLLM (``qwen3_dflash.py``) and SGLang
(``models/dflash.py``) load (vllm-project/vllm ``vllm/model_executor/models/qwen3_dflash.py`` @036a00d1;
sgl-project/sglang ``python/sglang/srt/models/dflash.py`` @003b23d7; the released config, sgl-project/SpecForge
``configs/qwen3-8b-dflash.json``).

The one place where treadle's names, config keys and layer-index convention meet the consumers'. treadle writes
this layout (a run's ``draft/``, ``treadle export``) and reads it back (``spec-eval --draft``, ``draft.init``).

- ``config.json``: a Qwen3 config of the draft (``architectures = ["DFlashDraftModel"]``, ``model_type = "qwen3"``,
  ``num_hidden_layers`` = the draft's layers, the target's dimensions, rotary settings and vocabulary,
  ``layer_types`` all ``full_attention``: bidirectional inside the block in both engines), ``block_size`` both
  top-level (older readers) and in ``dflash_config`` (SGLang reads it there first), ``num_target_layers`` and
  ``dflash_config = {mask_token_id, target_layer_ids, block_size}``.
- **Layer ids** (a silent trap): ``dflash_config.target_layer_ids`` are z-lab's 0-based indices of
  the decoder layer whose output is read (z-lab reads ``hidden_states[id + 1]``; vLLM and SGLang add 1). treadle's
  one internal convention is the output_hidden_states index, so z-lab id = treadle index - 1, converted here only.
- ``model.safetensors``: ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
  ``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
  ``layers.{i}.{input,post_attention}_layernorm``, no embedding and no head (both engines use the target's).
- ``dflash.py``: the model code ``auto_map`` names (``remote_code.py``, written by ``DFlash.write_extra``), so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` opens the directory as z-lab's drafts open. vLLM,
  SGLang and treadle never import it.

Engines skip names they do not know without a word (SGLang), so every conversion is checked both ways: a name
left over or missing is refused, never written or loaded.
"""

from __future__ import annotations

from types import ModuleType

import re
from pathlib import Path

import torch

from treadle.drafts.kind import layout_config
from treadle.errors import UserError

ARCHITECTURE = "DFlashDraftModel"
TITLE = "DFlash"
MODEL_TYPE = "qwen3"
# transformers' remote code beside the weights, what ``auto_map`` names (z-lab's drafts ship theirs the same way).
REMOTE_CODE = "dflash.py"
AUTO_MAP = {"AutoModel": f"{Path(REMOTE_CODE).stem}.{ARCHITECTURE}"}


def remote_code() -> bytes:
    """The ``dflash.py`` an export carries: treadle's remote_code.py, which imports torch and transformers only."""
    return (Path(__file__).with_name("remote_code.py")).read_bytes()

# treadle's per-layer parameter (inside ``layers.{i}.``) -> z-lab's.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def names(num_layers: int) -> dict[str, str]:
    """Every treadle name of a ``num_layers`` draft -> its z-lab name."""
    out = dict(TOP_NAMES)
    for i in range(num_layers):
        out.update({f"layers.{i}.{k}": f"layers.{i}.{v}" for k, v in LAYER_NAMES.items()})
    return out


def is_layout(config: dict) -> bool:
    """A config.json of a DFlash draft in z-lab's layout (treadle's or one trained elsewhere)."""
    return ARCHITECTURE in (config.get("architectures") or ()) and "dflash_config" in config


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a DFlash draft in this layout (``treadle_draft_kind`` added to one trained elsewhere), or
    None if ``draft_dir`` holds none."""
    # ``speculators``: the kind's speculators table (its speculators.py, which reads this module: passed in,
    # not imported), so a speculators-format draft is read as this layout too.
    return layout_config(draft_dir, is_layout, "dflash", speculators)


def to_zlab(layers) -> list[int]:
    """treadle's output_hidden_states indices -> z-lab's decoder-layer ids (one less)."""
    return [int(i) - 1 for i in layers]


def from_zlab(ids) -> tuple[int, ...]:
    """z-lab's decoder-layer ids -> treadle's output_hidden_states indices (one more), what vLLM and SGLang capture."""
    return tuple(int(i) + 1 for i in ids)


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict,
           table: dict | None = None) -> tuple[dict, dict]:
    """(tensors, config) of ``draft`` in z-lab's layout. ``weights``: the draft's state dict on the CPU, in
    treadle's names and already in the export dtype; ``extra``: treadle's metadata keys for config.json;
    ``table``: treadle name -> layout name (``names``, or a kind's built on DFlash)."""
    table = table or names(draft.num_layers)
    unknown, missing = sorted(weights.keys() - table.keys()), sorted(table.keys() - weights.keys())
    if unknown or missing:
        raise UserError(f"{draft.kind} export: the draft's weights do not match z-lab's layout (no name for "
                        f"{unknown}, missing {missing}); nothing was written")
    tensors = {table[k]: v.contiguous() for k, v in weights.items()}
    return tensors, config_of(draft, target_config, dtype, extra)


def config_of(draft, target_config, dtype: torch.dtype, extra: dict) -> dict:
    from treadle.drafts.eagle3.layout import layer_keys

    s, t = draft.shape, target_config.to_dict()
    ids = to_zlab(draft.feature_layers)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        "num_hidden_layers": draft.num_layers,
        # the rotary the draft computes with (eagle3's draft_rotary: the target's theta and scaling over the whole
        # head); rope_theta is always written: vLLM assumes 1e6 for a DFlash config without one
        **layer_keys(s, target_config),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * draft.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": draft.target_vocab_size,
        "initializer_range": t.get("initializer_range", 0.02),
        **{k: t[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if t.get(k) is not None},
        "dtype": TORCH_DTYPE_NAMES[dtype],
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "block_size": draft.block_size,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": draft.mask_token_id, "target_layer_ids": ids,
                          "block_size": draft.block_size},
    }
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"dflash export: treadle's metadata keys {clash} would overwrite the layout's")
    return {**config, **extra}


def block_size(config: dict) -> int:
    """SGLang's reading: ``dflash_config.block_size``, else the top-level key, else 16."""
    return int((config.get("dflash_config") or {}).get("block_size", config.get("block_size") or 16))


def drafts_per_block(config: dict) -> int:
    """What one forward of a draft in this layout proposes: the block but its anchor (the kinds on DFlash's
    backbone that draft from slot 1: DFlash, DFlash2, LiLiCorr; ``DraftKind.max_gamma``)."""
    return block_size(config) - 1


def mask_token_id(config: dict, where) -> int:
    mask = (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise UserError(f"draft {where}: config.json dflash_config.mask_token_id = {mask!r}; accepted: the "
                        "non-negative target-embedding row the draft was trained with")
    return mask


def feature_layers(config: dict, num_target_layers: int, where) -> tuple[int, ...]:
    """The output_hidden_states indices a draft in this layout reads: ``dflash_config.target_layer_ids`` + 1, or,
    without them, z-lab's default picks for its layer count (``build_target_layer_ids``) + 1."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None:
        n, layers = num_target_layers, config["num_hidden_layers"]
        ids = [n // 2] if layers == 1 else [int(round(1 + i * (n - 4) / (layers - 1))) for i in range(layers)]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise UserError(f"draft {where}: config.json dflash_config.target_layer_ids = {ids!r}; accepted: a "
                        "non-empty list of decoder-layer ids")
    return from_zlab(ids)


def check_fits(config: dict, target_config, where) -> None:
    """A draft in this layout fits ``target``: the same dimensions and vocabulary, the layers treadle builds."""
    c = target_config
    heads = c.num_attention_heads
    want = {"hidden_size": c.hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads, "vocab_size": c.vocab_size,
            "num_target_layers": c.num_hidden_layers}
    for key, value in want.items():
        if key in config and config[key] is not None and config[key] != value:
            raise UserError(f"draft {where}: config.json {key} = {config[key]} does not fit the target ({value}); "
                            "accepted: a DFlash draft trained for this target")
    if config.get("attention_bias"):
        raise UserError(f"draft {where}: config.json has attention_bias; accepted: a bias-free DFlash draft")
    if config.get("hidden_act", "silu") != "silu":
        raise UserError(f"draft {where}: config.json hidden_act = {config['hidden_act']!r}; accepted: 'silu'")
    if any(t != "full_attention" for t in config.get("layer_types") or ()) or (config.get("dflash_config") or {}).get(
            "causal"):
        raise UserError(f"draft {where}: config.json has sliding-window or causal draft layers; accepted: "
                        "full_attention layers, bidirectional inside the block (what treadle trains)")


def import_weights(tensors: dict, draft, where, table: dict | None = None) -> dict:
    """The state dict of ``draft`` (a DFlashDraft) from the layout's tensors (``table`` as ``export``'s); any name
    left over or missing is refused. A ``model.`` prefix is dropped (vLLM accepts both); a shipped embedding or head
    is not the draft's."""
    tensors = {re.sub(r"^model\.", "", k): v for k, v in tensors.items()}
    for shared in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(shared, None)
    internal = {v: k for k, v in (table or names(draft.num_layers)).items()}
    unknown, missing = sorted(tensors.keys() - internal.keys()), sorted(internal.keys() - tensors.keys())
    if unknown or missing:
        raise UserError(f"draft {where}: model.safetensors does not match z-lab's {draft.layout.TITLE} layout for "
                        f"{draft.num_layers} layers (unknown {unknown[:6]}, missing {missing[:6]})")
    return {internal[k]: v for k, v in tensors.items()}
