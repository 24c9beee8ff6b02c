"""The MTP module in the speculators format (drafts/speculators_format.py): its table, both ways.

Read for this: speculators 0.9.0 (PyPI wheel) ``speculators/models/mtp/config.py`` (``MTPSpeculatorConfig``:
``transformer_layer_config`` = the verifier's config, ``num_nextn_predict_layers`` = 1, the replay depth as the
proposal's ``speculative_tokens``), ``models/mtp/model_definitions.py`` (``mtp_model_classes``: qwen3, qwen3_next,
qwen3_5_text, qwen3_5_moe_text; ``MTPLayerMixin``: ``input_proj(cat[token_layernorm(embed), hidden_layernorm(h)])``,
the decoder layer of the verifier's class at its last full-attention index, then ``final_layernorm``, whose output the
next step reads), ``models/mtp/core.py`` (``MTPDraftModel``: ``mtp_layers.0.*``, no embedding or head: the
verifier's) and ``convert/mtp/converter.py`` (Qwen3-Next's ``mtp.*`` names to these, experts fused).

treadle's module is transformers' decoder layer under ``mtp_block.`` with the four fusion weights beside it, so the
names map one to one. Only the Qwen families are expressible: speculators has no DeepSeek-V3 / GLM MTP layer, and its
layer embeds first, never zeroes a position-0 embedding and replays the normed output (the Qwen layout's switches).
"""

from __future__ import annotations

import torch

from treadle.drafts import speculators_format
from treadle.drafts.mtp import settings
from treadle.drafts.mtp.layout import BLOCK
from treadle.errors import UserError

MODEL_TYPE = "mtp"
ARCHITECTURE = "MTPDraftModel"  # MTPSpeculatorConfig's default architectures
LAYER_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # speculators' mtp_model_classes
PREFIX = "mtp_layers.0."
FUSION = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
          "eh_proj.weight": "input_proj.weight", "post_norm.weight": "final_layernorm.weight"}
VERIFIER = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")  # speculators fills these


def name(internal: str) -> str | None:
    """speculators' name of one of treadle's MtpDraft tensors (None: it has none)."""
    if internal in FUSION:
        return PREFIX + FUSION[internal]
    return PREFIX + internal[len(BLOCK):] if internal.startswith(BLOCK) else None


def refusal(draft, target_config) -> str | None:
    model_type = getattr(target_config, "model_type", None)
    if model_type not in LAYER_TYPES:
        return (f"speculators 0.9.0's MTPDraftModel has no {model_type!r} layer (accepted: a target of model_type "
                f"{', '.join(map(repr, LAYER_TYPES))})")
    if draft.hidden_first or draft.zero_first_embedding or not draft.family.chain_normed:
        return "the module's fusion order, position-0 embedding or replay differs from speculators' MTP layer"
    with torch.device("meta"):  # speculators builds its layer at the verifier's last full-attention index
        types = list(getattr(target_config, "layer_types", None) or ["full_attention"])
        index = max(i for i, t in enumerate(types) if t == "full_attention")
        theirs = type(draft.mtp_block)(target_config, index)
    if type(theirs.mlp) is not type(draft.mtp_block.mlp):
        return (f"the target's layer {index} (where speculators builds the MTP layer) has a {type(theirs.mlp).__name__}"
                f" MLP, the module a {type(draft.mtp_block.mlp).__name__}")
    return None


def export(draft, weights: dict, target, dtype, extra: dict) -> tuple[dict, dict]:
    reason = refusal(draft, target.config)
    if reason:
        raise UserError(f"mtp export to speculators: {reason}; nothing was written (accepted: --to draft, the "
                        "family's own layout)")
    unnamed = sorted(k for k in weights if name(k) is None)
    if unnamed:
        raise UserError(f"mtp export to speculators: no speculators name for {unnamed}; nothing was written")
    tensors = {name(k): v.contiguous() for k, v in weights.items()}
    speculators_format.check_names(tensors, {name(k) for k in draft.state_dict()}, MODEL_TYPE)
    training = extra.get("training") or {}
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": speculators_format.VERSION,
        "transformer_layer_config": target.config.to_dict(),  # the verifier's, as speculators' converter writes it
        "num_nextn_predict_layers": 1,
        "dtype": str(dtype).removeprefix("torch."),
        "speculators_config": speculators_format.speculators_config(
            MODEL_TYPE, training.get("ttt_steps") or settings.TTT_STEPS, target.config, training),
    }
    return tensors, speculators_format.with_metadata(config, extra, MODEL_TYPE)


def is_layout(config: dict) -> bool:
    return speculators_format.is_format(config) and config["speculators_model_type"] == MODEL_TYPE


def import_weights(tensors: dict, where) -> dict:
    """treadle's MtpDraft names of a speculators-format module's tensors (the verifier's copies dropped); a name
    outside ``mtp_layers.0.`` is refused (draft_from_dir checks the rest against the module)."""
    back = {PREFIX + v: k for k, v in FUSION.items()}
    out, unknown = {}, []
    for key, value in tensors.items():
        if key in VERIFIER:
            continue
        if key in back:
            out[back[key]] = value
        elif key.startswith(PREFIX):
            out[BLOCK + key[len(PREFIX):]] = value
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"draft {where}: model.safetensors holds {sorted(unknown)[:6]}, not speculators' MTP layer "
                        f"({PREFIX}*); accepted: a speculators MTP draft with num_nextn_predict_layers = 1")
    return out
