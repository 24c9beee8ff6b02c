"""The LiLiCorr draft on disk: the ``LiLiCorrDraftModel`` layout vLLM's loader reads (vllm-project/vllm
``vllm/model_executor/models/lilicorr.py`` @08f95fe5, ``LiLiCorrForCausalLM`` on ``DFlashQwen3Model``; SGLang's
PR #37462 and TensorRT-LLM's ``modeling_lilicorr.py`` read the same names), which ModelOpt PR #2342's
``LiLiCorrExporter`` writes: the backbone's own layout (z-lab's DFlash one, drafts/dflash/layout.py, or for a
convolving backbone DFlash2's without the selector, drafts/dflash2/layout.py: ``backbone.layout`` writes and reads
it) plus

- ``config.json``: ``architectures = ["LiLiCorrDraftModel"]`` (what selects the correlator: a ``DFlashDraftModel``
  config would load as a plain DFlash draft and drop the head), and in ``dflash_config`` ``projector_type =
  "lilicorr"``, ``lilicorr_enabled`` and every ``lilicorr_*`` geometry key (candidate_topk, hidden_size,
  num_layers, num_heads, mlp_ratio, factor_dim, vector_eps, logit_scale). ``conv_kernel_size`` and
  ``conv_group_size`` both when the backbone convolves (vLLM then builds DFlash2's decoder layers and requires
  every ``.attention_conv.`` / ``.mlp_conv.`` tensor), neither for DFlash's; never DFlash2's selector keys. No
  ``auto_map``: no transformers remote code opens this head.
- ``model.safetensors``: the backbone's tensors under z-lab's names and the correlator's under ``lilicorr.``, in
  the named-MLP form vLLM loads (``feature_norm``, ``feature_mlp.{up,down}_proj``, ``layers.{i}.mlp.{up,down}_
  proj``, ``layers.{i}.attn.in_proj_{weight,bias}``, ``layers.{i}.attn.out_proj``). No embedding, no head, no
  ``d2t`` (vLLM refuses a draft vocabulary map: the candidates are target ids).

Reading, the nn.Sequential names ModelOpt's training module writes (``feature_mlp.0`` the LayerNorm,
``feature_mlp.{1,3}``, ``mlp.{0,2}``) are accepted as SGLang's and TensorRT-LLM's loaders accept them. Every name
is checked both ways, as for DFlash: a name left over or missing is refused.
"""

from __future__ import annotations

from types import ModuleType

from pathlib import Path

from treadle.drafts.kind import layout_config
from treadle.errors import UserError

ARCHITECTURE = "LiLiCorrDraftModel"
TITLE = "LiLiCorr"
PREFIX = "lilicorr."
# ModelOpt's nn.Sequential names -> the named-MLP ones (the same tensors).
SEQUENTIAL = ((".feature_mlp.0.", ".feature_norm."), (".feature_mlp.1.", ".feature_mlp.up_proj."),
              (".feature_mlp.3.", ".feature_mlp.down_proj."), (".mlp.0.", ".mlp.up_proj."),
              (".mlp.2.", ".mlp.down_proj."))
GEOMETRY = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
            "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")


def is_layout(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or ()) and "dflash_config" in config


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a LiLiCorr draft in this layout, or None (``speculators``: the kind's table, None today:
    speculators 0.9.0 has no class for the kind)."""
    return layout_config(draft_dir, is_layout, "lilicorr", speculators)


def split(weights: dict) -> tuple[dict, dict]:
    """(the backbone's weights, the correlator's) of a LiLiCorrDraft's state dict."""
    backbone = {k[len("backbone."):]: v for k, v in weights.items() if k.startswith("backbone.")}
    head = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    rest = sorted(weights.keys() - {f"backbone.{k}" for k in backbone} - {PREFIX + k for k in head})
    if rest:
        raise UserError(f"lilicorr export: weights {rest} are neither the backbone's nor the correlator's")
    return backbone, head


def export(draft, weights: dict, target_config, dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of a LiLiCorrDraft in the LiLiCorrDraftModel layout."""
    backbone, head = split(weights)
    tensors, config = draft.backbone.layout.export(draft.backbone, backbone, target_config, dtype, extra)
    want = set(draft.lilicorr.state_dict())
    if set(head) != want:
        raise UserError(f"lilicorr export: the correlator's weights {sorted(set(head) ^ want)} do not match its "
                        "parameters; nothing was written")
    tensors.update({PREFIX + k: v.contiguous() for k, v in head.items()})
    config.pop("auto_map", None)  # DFlash's remote code does not open this head
    config["architectures"] = [ARCHITECTURE]
    config["dflash_config"].update({"projector_type": "lilicorr", "lilicorr_enabled": True,
                                    **draft.lilicorr.geometry()})
    return tensors, config


def geometry(config: dict, where) -> dict:
    """The ``lilicorr_*`` keys of a config in this layout, all present (none has a default a head could be rebuilt
    from: ModelOpt's and vLLM's loaders require them too)."""
    dc = config.get("dflash_config") or {}
    missing = [k for k in GEOMETRY if dc.get(k) is None]
    if missing or not dc.get("lilicorr_enabled", True):
        raise UserError(f"draft {where}: config.json dflash_config lacks {missing or ['lilicorr_enabled = true']}; "
                        "accepted: a LiLiCorrDraftModel config with every lilicorr_* key")
    return {k: dc[k] for k in GEOMETRY}


def conv_keys(config: dict, where) -> dict:
    """The backbone's convolutions (``LiLiCorrDraft`` keywords) of a config in this layout: none, or both
    ``conv_kernel_size`` and ``conv_group_size`` (vLLM's rule: then its layers are DFlash2's)."""
    dc = config.get("dflash_config") or {}
    taps, group = dc.get("conv_kernel_size") or 0, dc.get("conv_group_size") or 0
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (taps, group)) \
            or bool(taps) != bool(group):
        raise UserError(f"draft {where}: config.json dflash_config.conv_kernel_size = {taps!r} and conv_group_size = "
                        f"{group!r}; accepted: both positive integers (a convolving backbone) or neither")
    return {"conv_kernel_size": taps, "conv_group_size": group} if taps else {}


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of a LiLiCorrDraft from the layout's tensors (a ``model.`` prefix dropped; ModelOpt's
    sequential names accepted)."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    head = {}
    for name in [k for k in tensors if k.startswith(PREFIX)]:
        key = "." + name[len(PREFIX):]
        for old, new in SEQUENTIAL:
            key = key.replace(old, new)
        head[key[1:]] = tensors.pop(name)
    want = draft.lilicorr.state_dict()
    unknown, missing = sorted(head.keys() - want.keys()), sorted(want.keys() - head.keys())
    bad = [k for k in head.keys() & want.keys() if head[k].shape != want[k].shape]
    if unknown or missing or bad:
        raise UserError(f"draft {where}: model.safetensors's lilicorr.* tensors do not match the correlator its "
                        f"config describes (unknown {unknown[:6]}, missing {missing[:6]}, other shapes {bad[:6]})")
    backbone = draft.backbone.layout.import_weights(tensors, draft.backbone, where)
    return {**{f"backbone.{k}": v for k, v in backbone.items()}, **{PREFIX + k: v for k, v in head.items()}}


def check_head(geometry_keys: dict, built: dict, where: Path) -> None:
    """The head a config describes is the one treadle builds for its width (``built``: its keys; treadle's
    correlator is as wide as the draft, with its heads, factor width, MLP ratio, scale and eps fixed)."""
    for key in ("lilicorr_hidden_size", "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
                "lilicorr_vector_eps", "lilicorr_logit_scale"):
        if geometry_keys[key] != built[key] and not (key == "lilicorr_hidden_size" and geometry_keys[key] == 0):
            raise UserError(f"draft {where}: config.json dflash_config.{key} = {geometry_keys[key]!r}; treadle's "
                            f"correlator for this target has {built[key]!r}; accepted: a LiLiCorr draft with "
                            "treadle's correlator geometry")
