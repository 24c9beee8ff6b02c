"""LiLiCorr's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide).

The backbone is a DFlash draft, so every dflash key means what it means there (and is checked by dflash's rules);
LiLiCorr adds the lattice's width, the correlator's depth and whether the backbone trains with it, and
``conv_group_size`` (DFlash2's key) makes the backbone convolve as DFlash2's does (LiLiCorr + conv).
"""

from __future__ import annotations

from treadle.drafts.dflash import settings as dflash

NAME = "lilicorr"
KEYS = dflash.KEYS + ("candidates", "correlator_layers", "train_backbone", "conv_group_size")
TTT_STEPS = 1  # no unroll: one backbone forward and one correlator pass draft the whole block
LAYOUTS = ("treadle",)
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "LiLiCorr already trains a correlator on a frozen backbone (draft.train_backbone = false), which PEFT's freezing would override"
LAYOUT_NOTE = "its layout is the LiLiCorrDraftModel one vLLM's lilicorr.py loads (z-lab's DFlash plus lilicorr.*)"
WINDOW_NOTE = dflash.WINDOW_NOTE

# vLLM's LiLiCorrHead accepts a power of two up to 16 (its fused top-k tiles); 8 is its config's default.
CANDIDATES = 8
MAX_CANDIDATES = 16
CORRELATOR_LAYERS = 2  # the paper's "2-layer correlator" (ModelOpt PR #2342's recipes)


def candidates(draft) -> int:
    return draft.candidates or CANDIDATES


def correlator_layers(draft) -> int:
    return draft.correlator_layers or CORRELATOR_LAYERS


def conv_group_size(draft) -> int:
    """0 (unset): DFlash's backbone; set: DFlash2's convolving layers (without its selector), this group size."""
    return draft.conv_group_size or 0


def train_backbone(draft) -> bool:
    """Joint training (the backbone learns with the correlator, as ModelOpt PR #2342 trains) unless set false."""
    return draft.train_backbone is not False


def check(draft) -> None:
    dflash.check(draft)
    k = candidates(draft)
    if k > MAX_CANDIDATES or k & (k - 1):
        raise ValueError(f"draft.candidates = {k}: vLLM's LiLiCorr head serves a power of two up to "
                         f"{MAX_CANDIDATES}; accepted: 1, 2, 4, 8 or 16")
    if not train_backbone(draft) and draft.init is None:
        raise ValueError("draft.train_backbone = false without draft.init: a frozen backbone must be a trained one; "
                         "accepted: draft.init = a DFlash (or LiLiCorr) draft, or draft.train_backbone unset")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'lilicorr': its DFlash backbone's "
                     "anchored blocks are not built for sliced sequences yet; accepted: context_parallel = 1")
