"""The XPress draft on disk as vLLM loads it: the ``Qwen3XPressModel`` layout (vllm-project/vllm PR #54448, open:
``vllm/model_executor/models/qwen3_xpress.py`` @15ba199f, ``Qwen3XPressForCausalLM.load_weights`` on
``DFlashQwen3Model``; ``vllm/v1/worker/gpu/spec_decode/xpress/speculator.py`` @0008616e; the layout of the released
``UIUC-SSAIL/Qwen3-8B-XPress-b16``). A run's ``draft/`` and ``treadle export`` write it; ``--to speculators`` writes
speculators' ``XPressSpeculator`` layout instead (xpress/speculators.py), and ``draft.init`` / spec-eval read both.

- ``config.json``: treadle's DFlash export config (drafts/dflash/layout.py: a Qwen3 config of the draft layers,
  ``dflash_config`` with the mask token and z-lab's decoder-layer ids = output_hidden_states index - 1) under
  ``architectures = ["Qwen3XPressModel"]``, without ``auto_map`` (no remote code opens the head), plus the head's
  keys vLLM reads: ``xpress_block_size``, ``xpress_rank``, ``xpress_mlp_hidden`` (the SwiGLU width, rank x ratio)
  and ``xpress_num_passes`` (its Jacobi passes, the engine's default 6).
- ``model.safetensors``: the backbone under z-lab's names and the refiner under ``xpress_head.``: ``w1`` (the
  previous token's embedding), ``down_h``, ``down_g``, ``in_proj``, ``mix.L`` (the raw mixer: vLLM folds in the
  causal mask and the residual, ``tril(L) + I``, after loading), ``mlp.{gate,up,down}_proj`` and ``w2`` (the
  readout). No embedding, head or ``d2t``: vLLM refuses a reduced vocabulary and shares the target's.
"""

from __future__ import annotations

from types import ModuleType

from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dflash.model import check_feature_layers
from treadle.drafts.kind import layout_config
from treadle.drafts.xpress import speculators
from treadle.errors import UserError

ARCHITECTURE = "Qwen3XPressModel"
TITLE = "XPress"
PREFIX = "xpress_head."
# treadle's refiner names (speculators' XPressRefinerHead's) -> vLLM's under xpress_head.
HEAD = {"token_embed.weight": "w1.weight", "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight",
        "in_proj.weight": "in_proj.weight", "mix_l": "mix.L", "mlp_gate.weight": "mlp.gate_proj.weight",
        "mlp_up.weight": "mlp.up_proj.weight", "mlp_down.weight": "mlp.down_proj.weight", "readout.weight": "w2.weight"}


def names(draft) -> dict[str, str]:
    """Every treadle name of an XPress draft -> its name in this layout."""
    return {**dflash_layout.names(draft.num_layers), **{f"refiner_head.{k}": PREFIX + v for k, v in HEAD.items()}}


def is_layout(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or ()) and "dflash_config" in config


def read_config(draft_dir, table: ModuleType | None = None) -> dict | None:
    """config.json of an XPress draft in either layout (vLLM's or speculators'), or None. ``table``: as the other
    block layouts' (drafts/kind.py ``layout_config``), None here: this layout reads speculators' config itself."""
    return layout_config(draft_dir, lambda c: is_layout(c) or speculators.is_layout(c), "xpress", table)


def layout_name() -> str:
    return (f"{TITLE} draft (config.json with architectures = [{ARCHITECTURE!r}], or speculators_model_type = "
            f"{speculators.MODEL_TYPE!r})")


def export(draft, weights: dict, target_config, dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config.json) of ``draft`` in this layout, from its state dict in treadle's names (export dtype)."""
    tensors, config = dflash_layout.export(draft, weights, target_config, dtype, {}, table=names(draft))
    config.pop("auto_map")
    head = draft.refiner_keys()
    config.update({"architectures": [ARCHITECTURE], "xpress_block_size": draft.block_size,
                   "xpress_rank": head["xpress_rank"],
                   "xpress_mlp_hidden": head["xpress_rank"] * head["xpress_mlp_ratio"],
                   "xpress_num_passes": head["num_jacobi_passes"]})
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"xpress export: treadle's metadata keys {clash} would overwrite the layout's")
    return tensors, {**config, **extra}


def read_spec(config: dict, target_config, where) -> dict:
    """The ``XPressDraft`` keywords a config in either layout describes, checked against the target."""
    from treadle.drafts.xpress import settings

    if speculators.is_layout(config):
        return speculators.read_spec(config, target_config, where)
    dflash_layout.check_fits(config, target_config, where)
    n = target_config.num_hidden_layers
    layers = dflash_layout.feature_layers(config, n, where)
    check_feature_layers(layers, n, f"{where}/config.json target_layer_ids + 1")
    block = speculators.positive(config, "xpress_block_size", dflash_layout.block_size(config), where)
    rank = speculators.positive(config, "xpress_rank", settings.RANK, where)
    hidden = speculators.positive(config, "xpress_mlp_hidden", rank * settings.MLP_RATIO, where)
    if hidden % rank:
        raise UserError(f"draft {where}: config.json xpress_mlp_hidden = {hidden} is not a multiple of xpress_rank = "
                        f"{rank}; accepted: an XPress head whose SwiGLU width is rank x an integer ratio")
    return {"feature_layers": layers, "num_layers": config["num_hidden_layers"], "block_size": block,
            "mask_token_id": dflash_layout.mask_token_id(config, where), "rank": rank, "mlp_ratio": hidden // rank,
            "jacobi_passes": speculators.positive(config, "xpress_num_passes", settings.JACOBI_PASSES, where)}


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of ``draft`` from either layout's tensors (speculators' by its ``refiner_head.`` names)."""
    if any(k.removeprefix("model.").startswith("refiner_head.") for k in tensors):
        return speculators.import_weights(tensors, draft, where)
    if "d2t" in tensors or "t2d" in tensors:
        raise UserError(f"draft {where}: model.safetensors maps a reduced draft vocabulary (d2t / t2d); accepted: an "
                        "XPress draft over the target's whole vocabulary (vLLM's XPress refuses another)")
    return dflash_layout.import_weights(tensors, draft, where, table=names(draft))


def drafts_per_block(config: dict) -> int:
    """What one forward proposes: the block but its anchor."""
    if speculators.is_layout(config):
        return speculators.drafts_per_block(config)
    return int(config.get("xpress_block_size") or dflash_layout.block_size(config)) - 1
