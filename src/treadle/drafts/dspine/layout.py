"""The DSpine draft on disk: SpecForge's ``DSpineDraftModel`` layout (sgl-project/SpecForge
``specforge/modeling/draft/dspine.py`` @9aafadfceaeb728209d4b4c6bda221f2c1fed70f, a ``DFlashDraftModel`` subclass
saved with ``save_pretrained``; ``specforge/algorithms/dspine/providers.py`` and SpecForge's script packaging a
reference checkpoint read and write the same names). Tencent/DSpine's README says vLLM serves it since November
2026; vLLM's loader was not readable here, so the names are SpecForge's.

z-lab's DFlash layout (drafts/dflash/layout.py: the Qwen3 config, ``dflash_config.{target_layer_ids, mask_token_id,
block_size}`` in z-lab's layer convention, the same backbone tensors, no embedding or head), with:

- ``architectures = ["DSpineDraftModel"]``, no ``auto_map`` (SpecForge's converter drops it; DFlash's remote code
  would open the backbone without the injection);
- ``dspine_config``: every ``DSpineConfig`` field SpecForge saves (``transfer_rank``, ``message_size``, ``top_k``,
  the loss weights and schedule), treadle's values; read back: ``transfer_rank`` and ``message_size`` must match the
  tensors, ``top_k`` is the walk's candidates (SpecForge's default 16 when absent);
- tensors ``injection.readouts.{i}.weight`` [r, d], ``injection.writes.{i}.weight`` [d, m],
  ``injection.{message,receiver_gate,predecessor_gate}.weight`` [m, r], ``injection.bias`` [m],
  ``transfer_codes`` [V, r] and ``transfer_ready`` (a bool scalar, True: SpecForge refuses to run before its codes
  are set). treadle's names are the same; ``transfer_ready`` is written, and on import required True, then dropped.
"""

from __future__ import annotations

from types import ModuleType

import torch

from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dspine import settings
from treadle.drafts.kind import layout_config
from treadle.errors import UserError

ARCHITECTURE = "DSpineDraftModel"
TITLE = "DSpine"
READY = "transfer_ready"
SHARED = ("injection.message.weight", "injection.receiver_gate.weight", "injection.predecessor_gate.weight",
          "injection.bias", "transfer_codes")


def names(num_layers: int) -> dict[str, str]:
    """Every treadle name of a ``num_layers`` DSpine draft -> its name in the layout (the same, past DFlash's)."""
    out = dflash_layout.names(num_layers)
    for i in range(num_layers):
        out.update({n: n for n in (f"injection.readouts.{i}.weight", f"injection.writes.{i}.weight")})
    return out | {n: n for n in SHARED}


def is_layout(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or ()) and "dflash_config" in config


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a DSpine draft in this layout, or None (``speculators``: the kind's table, None today:
    speculators 0.9.0 has no class for the kind)."""
    return layout_config(draft_dir, is_layout, "dspine", speculators)


def dspine_config(draft) -> dict:
    """The ``dspine_config`` SpecForge's ``DSpineConfig`` saves, with treadle's values (the schedule keys are
    SpecForge's defaults: treadle trains without them, and nothing at decode time reads them)."""
    inj = draft.injection
    return {"transfer_rank": inj.rank, "message_size": inj.message.out_features, "top_k": draft.candidates,
            "ce_weight": settings.CE_WEIGHT, "alignment_weight": settings.ALIGNMENT_WEIGHT,
            "alignment_warmup_steps": 146, "replacement_layers": 3, "replacement_probability": 0.5,
            "replacement_hold_ratio": 1 / 6, "replacement_end_ratio": 1 / 3,
            "candidate_mass_threshold": settings.CANDIDATE_MASS}


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of a DSpineDraft in this layout (``dflash_layout.export``'s arguments)."""
    tensors, config = dflash_layout.export(draft, weights, target_config, dtype, extra, names(draft.num_layers))
    tensors[READY] = torch.tensor(True)
    del config["auto_map"]
    return tensors, {**config, "architectures": [ARCHITECTURE], "dspine_config": dspine_config(draft)}


def options(config: dict, where) -> dict:
    """The DSpineDraft keywords of a config.json in this layout."""
    dc = config.get("dspine_config")
    if not isinstance(dc, dict):
        raise UserError(f"draft {where}: config.json has no dspine_config; accepted: a DSpineDraftModel config "
                        "with dspine_config.transfer_rank and message_size")
    values = {}
    for key, keyword in (("transfer_rank", "transfer_rank"), ("message_size", "message_size"), ("top_k", "candidates")):
        value = dc.get(key, settings.CANDIDATES if key == "top_k" else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"draft {where}: config.json dspine_config.{key} = {value!r}; accepted: a positive integer")
        values[keyword] = value
    return values


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of a DSpineDraft from the layout's tensors: ``transfer_ready`` required True, then dropped."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    ready = tensors.pop(READY, None)
    if ready is None or ready.numel() != 1 or not bool(ready):
        raise UserError(f"draft {where}: model.safetensors's {READY} is {ready!r}; accepted: a DSpine draft whose "
                        "transfer codes were set (transfer_ready = true)")
    out = dflash_layout.import_weights(tensors, draft, where, names(draft.num_layers))
    want = draft.state_dict()
    bad = sorted(k for k in out if out[k].shape != want[k].shape)
    if bad:
        raise UserError(f"draft {where}: model.safetensors's {bad[:6]} have other shapes than its config.json's "
                        "dspine_config describes; accepted: a DSpine draft whose tensors match its config")
    return out
