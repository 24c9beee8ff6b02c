"""The DFlash2 draft on disk: z-lab's ``DFlash2DraftModel`` layout, what vLLM's DFlash2 loader reads
(vllm-project/vllm ``vllm/model_executor/models/qwen3_dflash2.py`` @030da62, registered as ``"DFlash2DraftModel":
("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")``; z-lab/dflash ``tests/fixtures/dflash2-config.json`` and
``dflash2-safetensors-header.json``, a released draft's config and tensor table).

DFlash's layout (drafts/dflash/layout.py: the Qwen3 config, ``dflash_config.{target_layer_ids, mask_token_id,
block_size}`` in z-lab's layer convention, the same tensor names, no embedding or head), with:

- ``architectures = ["DFlash2DraftModel"]``, ``is_causal = false``, no ``auto_map`` (z-lab's DFlash2 config has
  none; transformers' remote code for it is not written);
- ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}``: vLLM reads all four with
  ``[]`` (required);
- the target's logit transform, which vLLM applies to the candidates' logits only: ``final_logit_softcapping``
  (Gemma 2/3's cap) and ``output_multiplier`` (1 / Granite's ``logits_scaling``), written when the target has one;
  ``input_embedding_scale`` (vLLM: default 1) is never written and refused on import unless 1;
- per layer ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, taps, d] and ``.kernel_projection.weight``
  [2 * taps * d / conv_group_size, d]; ``candidate_selector.{predecessor,successor}_codebook`` [V, rank] and
  ``candidate_selector.hidden_projection.weight`` [rank, d]: treadle's own names.
"""

from __future__ import annotations

from types import ModuleType

import math

import torch

from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.kind import layout_config
from treadle.errors import UserError

ARCHITECTURE = "DFlash2DraftModel"
TITLE = "DFlash2"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # dflash_config, vLLM: required
SELECTOR = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight")
CONV = ("base_kernel", "kernel_projection.weight")


def names(num_layers: int, selector: bool = True) -> dict[str, str]:
    """Every treadle name of a ``num_layers`` DFlash2 draft (without its selector: ``selector = False``) -> its name
    in the layout."""
    out = dflash_layout.names(num_layers)
    for i in range(num_layers):
        out.update({n: n for conv in ("attention_conv", "mlp_conv") for n in (f"layers.{i}.{conv}.{c}" for c in CONV)})
    return out | ({n: n for n in SELECTOR} if selector else {})


def is_layout(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or ()) and "dflash_config" in config


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a DFlash2 draft in this layout (``treadle_draft_kind`` added to one trained elsewhere), or
    None."""
    # ``speculators``: the kind's speculators table (its speculators.py, which reads this module: passed in,
    # not imported), so a speculators-format draft is read as this layout too.
    return layout_config(draft_dir, is_layout, "dflash2", speculators)


def logit_keys(target_config) -> dict:
    """The ``dflash_config`` keys vLLM applies to the candidates' logits for ``target_config``'s logit transform."""
    from treadle.models.chunked_ce import _logit_transform

    transform = _logit_transform(target_config)
    keys = {}
    if "softcap" in transform:
        keys["final_logit_softcapping"] = transform["softcap"]
    if "scale" in transform:
        keys["output_multiplier"] = 1.0 / transform["scale"]
    return keys


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of ``draft`` (a DFlash2Draft) in this layout (``dflash_layout.export``'s arguments); a
    draft without its selector has no selector keys or tensors (the backbone of another head)."""
    selector = draft.selector
    tensors, config = dflash_layout.export(draft, weights, target_config, dtype, extra,
                                           names(draft.num_layers, selector is not None))
    del config["auto_map"]
    taps, group = draft.conv_shape
    config["dflash_config"] |= {"conv_kernel_size": taps, "conv_group_size": group, **logit_keys(target_config)}
    if selector is not None:
        config["dflash_config"] |= {"selector_rank": selector.hidden_projection.out_features,
                                    "selector_top_k": selector.top_k}
    return tensors, {**config, "architectures": [ARCHITECTURE], "is_causal": False}


def options(config: dict, target_config, where) -> dict:
    """The DFlash2Draft keywords of a config.json in this layout, its logit transform checked against the target's."""
    dc = config.get("dflash_config") or {}
    values = {}
    for key in KEYS:
        value = dc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"draft {where}: config.json dflash_config.{key} = {value!r}; accepted: a positive "
                            "integer (vLLM's DFlash2 loader requires it)")
        values[key] = value
    want = logit_keys(target_config)
    # As vLLM reads them: a cap of 0 / none is no cap, a missing multiplier is 1.
    cap = dc.get("final_logit_softcapping") or None
    for key, have, neutral in (("final_logit_softcapping", cap, None),
                               ("output_multiplier", dc.get("output_multiplier", 1.0), 1.0)):
        if not _same(have, want.get(key, neutral)):
            raise UserError(f"draft {where}: config.json dflash_config.{key} = {have!r} but the target's logit "
                            f"transform gives {want.get(key, neutral)!r}; accepted: a DFlash2 draft for this target")
    if not _same(dc.get("input_embedding_scale", 1.0), 1.0):
        raise UserError(f"draft {where}: config.json dflash_config.input_embedding_scale = "
                        f"{dc['input_embedding_scale']!r}; accepted: 1 (treadle feeds the target's own embedding)")
    return values


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=1e-6)


def import_weights(tensors: dict, draft, where) -> dict:
    return dflash_layout.import_weights(tensors, draft, where, names(draft.num_layers, draft.selector is not None))
