"""The XPress draft in speculators' ``XPressSpeculator`` layout: its table in the speculators format
(drafts/speculators_format.py: ``treadle export --to speculators`` writes it; ``draft.init`` and spec-eval read it,
xpress/layout.py dispatching).

Read for this: speculators 0.9.0 (PyPI wheel built 2026-10-15, the package ``make test-oldest`` unpacks):
``speculators/models/xpress/config.py`` (``XPressSpeculatorConfig``: DFlash's fields plus ``sample_from_anchor``
false = slot 0 the anchor, ``xpress_rank``, ``xpress_mlp_ratio``, ``num_jacobi_passes``), ``models/xpress/core.py``
(``XPressDraftModel``: DFlash's model plus ``refiner_head``), ``models/xpress/model_definitions.py``
(``XPressRefinerHead``: ``token_embed``, ``down_h``, ``down_g``, ``in_proj``, ``mix_l``, ``mlp_{gate,up,down}``,
``readout``), ``models/dflash/{config,core,model_definitions}.py`` (``transformer_layer_config`` a Qwen3 config of the
draft layers, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``block_size``, ``draft_vocab_size``; tensors
``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj`` / ``{q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``: z-lab's DFlash names,
drafts/dflash/layout.py).

- ``config.json``: ``speculators_model_type = "xpress"``, ``architectures = ["XPressSpeculator"]``, the draft layers'
  Qwen3 config in ``transformer_layer_config`` (treadle's DFlash export config minus its z-lab keys: the rotary the
  draft computes with, the target's dimensions and vocabulary), ``draft_vocab_size`` = the target's vocabulary (no
  reduced vocabulary: no ``d2t`` / ``t2d``), ``aux_hidden_state_layer_ids`` = treadle's output_hidden_states
  indices (vLLM's aux-layer convention: the input of decoder layer i; the verifier's layer count itself is the last
  layer's output), and ``speculators_config`` (one greedy proposal of block_size - 1 drafts, the verifier).
- ``model.safetensors``: the backbone under z-lab's names and ``refiner_head.*`` under speculators'. No embedding
  and no head: speculators' ``from_pretrained`` (DFlash's ``load_verifier_weights``) takes the verifier's.

Every name is checked both ways, as for DFlash: a name left over or missing is refused.
"""

from __future__ import annotations

from treadle.drafts import speculators_format
from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dflash.model import check_feature_layers
from treadle.errors import UserError

MODEL_TYPE = "xpress"
ARCHITECTURE = "XPressSpeculator"  # XPressSpeculatorConfig's default architectures
TITLE = "XPress"
# treadle's DFlash export keys that are z-lab's spelling, not the draft layers' config (the speculators keys say it)
ZLAB_KEYS = ("architectures", "auto_map", "block_size", "num_target_layers", "dflash_config", "dtype", "torch_dtype")
SHARED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
REFINER = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")


def names(draft) -> dict[str, str]:
    """Every treadle name of an XPress draft -> its name in the layout (the refiner's are the same)."""
    return {**dflash_layout.names(draft.num_layers),
            **{f"refiner_head.{k}": f"refiner_head.{k}" for k in draft.refiner_head.state_dict()}}


def is_layout(config: dict) -> bool:
    return speculators_format.is_format(config) and config["speculators_model_type"] == MODEL_TYPE


def layout_export(draft, weights: dict, target_config, dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config.json) of ``draft`` in the layout, from its state dict in treadle's names (export dtype)."""
    tensors, zlab = dflash_layout.export(draft, weights, target_config, dtype, {}, table=names(draft))
    training = extra.get("training") or {}
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": speculators_format.VERSION,
        "transformer_layer_config": {k: v for k, v in zlab.items() if k not in ZLAB_KEYS},
        "draft_vocab_size": draft.target_vocab_size,
        "block_size": draft.block_size,
        "aux_hidden_state_layer_ids": list(draft.feature_layers),
        "mask_token_id": draft.mask_token_id,
        "sample_from_anchor": False,  # slot 0 is the anchor, slot k guesses anchor + k (treadle's and XPress's)
        **draft.refiner_keys(),
        "dtype": zlab["dtype"],
        "torch_dtype": zlab["torch_dtype"],
        "speculators_config": speculators_format.speculators_config(MODEL_TYPE, draft.block_size - 1, target_config,
                                                                    training),
    }
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"xpress export: treadle's metadata keys {clash} would overwrite the layout's")
    return tensors, {**config, **extra}


def export(draft, weights: dict, target, dtype, extra: dict) -> tuple[dict, dict]:
    """The speculators table's writer (``treadle export --to speculators``): the layout itself."""
    return layout_export(draft, weights, target.config, dtype, extra)


def positive(config: dict, key: str, default: int, where) -> int:
    """``config[key]`` (``default`` when absent or null), refused in one line unless a positive integer."""
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"draft {where}: config.json {key} = {value!r}; accepted: a positive integer")
    return value


def read_spec(config: dict, target_config, where) -> dict:
    """The ``XPressDraft`` keywords a config in this layout describes, checked against the target."""
    from treadle.drafts.xpress import settings

    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"draft {where}: config.json has no transformer_layer_config; accepted: an XPress draft in "
                        "speculators' layout")
    if config.get("sample_from_anchor"):
        raise UserError(f"draft {where}: config.json sample_from_anchor = true (every slot drafts); accepted: an "
                        "XPress draft with sample_from_anchor = false (slot 0 the anchor, as vLLM serves XPress)")
    vocab = target_config.vocab_size
    if config.get("draft_vocab_size", vocab) != vocab:
        raise UserError(f"draft {where}: config.json draft_vocab_size = {config['draft_vocab_size']} but the target's "
                        f"vocabulary is {vocab}; accepted: an XPress draft over the target's whole vocabulary")
    dflash_layout.check_fits({**layer, "num_target_layers": None}, target_config, where)
    n = target_config.num_hidden_layers
    layers = config.get("aux_hidden_state_layer_ids") or [2, n // 2, n - 3]  # speculators' default picks
    check_feature_layers(layers, n, f"{where}/config.json aux_hidden_state_layer_ids")
    mask = config.get("mask_token_id")
    if mask is None:
        raise UserError(f"draft {where}: config.json has no mask_token_id; accepted: the target-embedding row the "
                        "draft was trained with")
    return {"feature_layers": tuple(layers), "num_layers": positive(layer, "num_hidden_layers", 1, where),
            "block_size": positive(config, "block_size", 8, where),
            "mask_token_id": dflash_layout.mask_token_id({"mask_token_id": mask}, where),
            "rank": positive(config, "xpress_rank", settings.RANK, where),
            "mlp_ratio": positive(config, "xpress_mlp_ratio", settings.MLP_RATIO, where),
            "jacobi_passes": positive(config, "num_jacobi_passes", settings.JACOBI_PASSES, where)}


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of ``draft`` from the layout's tensors; shipped copies of the verifier's embedding, head and
    norm are not the draft's, and a reduced vocabulary map is refused."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    for shared in SHARED:
        tensors.pop(shared, None)
    if "d2t" in tensors or "t2d" in tensors:
        raise UserError(f"draft {where}: model.safetensors maps a reduced draft vocabulary (d2t / t2d); accepted: an "
                        "XPress draft over the target's whole vocabulary")
    return dflash_layout.import_weights(tensors, draft, where, table=names(draft))


def drafts_per_block(config: dict) -> int:
    """What one forward proposes: the block but its anchor."""
    return int(config.get("block_size") or 8) - 1
