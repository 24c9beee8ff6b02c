"""The EAGLE-3 draft in the speculators format (drafts/speculators_format.py): its table, both ways.

Read for this: speculators 0.9.0 (PyPI wheel) ``speculators/models/eagle3/config.py`` (``Eagle3SpeculatorConfig``:
``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``
as ``output_hidden_states`` indices, the norm variants ``norm_before_fc`` / ``fc_norm`` / ``norm_output``),
``models/eagle3/core.py`` (``Eagle3DraftModel``: ``fc``, ``layers.N``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; the
embedding and the verifier's head and norm come from the verifier) and ``models/eagle3/model_definitions.py`` (the
first layer is a Llama or Qwen3 decoder layer with 2 x hidden q/k/v and a ``hidden_norm``).

The format is the EAGLE layout (eagle3/layout.py) regrouped: the draft layer's Llama keys move into
``transformer_layer_config``, ``midlayer.*`` is ``layers.0.*``. Writing goes through the EAGLE layout's own export and
reading back through its import, so the two formats cannot drift apart.
"""

from __future__ import annotations

from treadle.drafts import speculators_format
from treadle.drafts.eagle3 import layout
from treadle.drafts.eagle3.settings import TTT_STEPS
from treadle.errors import UserError

MODEL_TYPE = "eagle3"
ARCHITECTURE = "Eagle3Speculator"  # Eagle3SpeculatorConfig's default architectures
# The EAGLE layout's top-level keys that stay top-level in Eagle3SpeculatorConfig; the rest of its Llama keys are the
# draft layer's (transformer_layer_config).
TOP = ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "dtype", "torch_dtype")
DROP = ("architectures", "eagle_config")  # the EAGLE layout's own spelling of what TOP and the class say
# speculators' variants treadle's Eagle3Draft does not compute: a draft trained with one is refused, not misread.
VARIANTS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
# Eagle3DraftModel's state dict as from_pretrained fills it from the file (the verifier's head and norm come from
# the verifier). d2t and t2d are written for a full vocabulary too (what vLLM's EAGLE-3 reads): speculators' model
# has no buffers then and reports them as unexpected, harmlessly.
NAMES = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    "layers.0." + k for k in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                              "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                              "mlp.down_proj.weight")}


def export(draft, weights: dict, target, dtype, extra: dict) -> tuple[dict, dict]:
    target_config = target.config
    tensors, eagle = layout.export(draft, weights, target_config, dtype, {})
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    tensors.update(speculators_format.embedding(target, dtype))
    speculators_format.check_names(tensors, NAMES, "eagle3")
    training = extra.get("training") or {}
    steps = training.get("ttt_steps") or TTT_STEPS  # the drafts one proposal holds, as trained
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": speculators_format.VERSION,
        "transformer_layer_config": {k: v for k, v in eagle.items() if k not in TOP + DROP},
        **{k: eagle[k] for k in TOP},
        "speculators_config": speculators_format.speculators_config(MODEL_TYPE, steps, target_config, training),
    }
    return tensors, speculators_format.with_metadata(config, extra, MODEL_TYPE)


def is_layout(config: dict) -> bool:
    return speculators_format.is_format(config) and config["speculators_model_type"] == MODEL_TYPE


def as_eagle_layout(config: dict, where) -> dict:
    """The EAGLE-layout config.json (eagle3/layout.py) a speculators-format EAGLE-3 config.json states; its tensors
    read as they are (``layout.import_weights`` takes ``layers.0.*``)."""
    layer = dict(config.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise UserError(f"draft {where}: config.json transformer_layer_config.model_type = {layer['model_type']!r}; "
                        "accepted: 'llama' (the draft layer treadle's EAGLE-3 computes)")
    variants = [k for k in VARIANTS if config.get(k)]
    if variants:
        raise UserError(f"draft {where}: config.json sets {variants}; accepted: a speculators EAGLE-3 draft without "
                        "these variants (treadle's EAGLE-3 computes the plain one)")
    rest = {k: v for k, v in config.items() if k not in ("transformer_layer_config", "speculators_config",
                                                         "speculators_model_type", "speculators_version")}
    return {**layer, "num_hidden_layers": layer.get("num_hidden_layers", 1), **rest,
            "architectures": [layout.ARCHITECTURE]}
