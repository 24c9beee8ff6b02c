"""DFlash's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

NAME = "dflash"
KEYS = ("feature_layers", "init", "block_size", "num_layers", "anchors", "slot_gamma", "slot_weighting",
        "mask_token_id")
TTT_STEPS = 1  # no unroll: one forward drafts the whole block
LAYOUTS = ("treadle",)  # draft.layout unset: its export is always z-lab's DFlashDraftModel layout vLLM and SGLang load
# [lora] on a draft.init of this kind: per-domain adapters on a trained draft (models/lora.py, docs/lora.md)
ADAPTERS = True
# Why draft.layout / draft.window are refused (drafts/settings.py words the one-line refusals).
LAYOUT_NOTE = "its layout is z-lab's DFlashDraftModel one vLLM and SGLang load"
WINDOW_NOTE = "its block attends to the whole context"

BLOCK_SIZE = 16  # z-lab's "-b16" drafts, speculators' default
NUM_LAYERS = 5  # z-lab's, SpecForge's and speculators' released drafts
SLOT_GAMMA = 7.0  # the DFlash paper's decay at block 16 (ModelOpt's doc: 4 at block 8)


# The getters of the block's shape keys; a kind on this backbone with other defaults (DSpark) binds ``default``.
def block_size(draft, default: int = BLOCK_SIZE) -> int:
    return draft.block_size or default


def num_layers(draft, default: int = NUM_LAYERS) -> int:
    return draft.num_layers or default


def slot_gamma(draft, default: float = SLOT_GAMMA) -> float:
    return draft.slot_gamma or default


def check_feature_layers(draft) -> None:
    """A block draft's ``feature_layers`` (DFlash's and the kinds built on its backbone)."""
    layers = draft.feature_layers
    if layers is not None and (not layers or layers[0] < 1 or any(a >= b for a, b in zip(layers, layers[1:]))):
        raise ValueError(f"draft.feature_layers = {layers}: accepted: one or more strictly increasing "
                         "output_hidden_states indices >= 1 (i = decoder layer i's output; < the target's layer "
                         "count); unset = z-lab's picks spread over the target's layers")


def check(draft) -> None:
    check_feature_layers(draft)
    check_dpace(draft)
    if draft.gamma > block_size(draft) - 1:
        raise ValueError(f"draft.gamma = {draft.gamma} with draft.kind = {draft.kind!r} and a block of "
                         f"{block_size(draft)}: one draft forward proposes block_size - 1 = {block_size(draft) - 1} "
                         "tokens; accepted: draft.gamma <= draft.block_size - 1")


def check_dpace(draft) -> None:
    if draft.slot_weighting == "dpace" and draft.loss != "ce":
        raise ValueError(f"draft.slot_weighting = 'dpace' with draft.loss = {draft.loss!r}: D-PACE weighs slots by "
                         "exp(-CE), meaningful for a cross-entropy loss only; accepted: draft.loss = 'ce', or "
                         "draft.slot_weighting = 'decay'")
    if draft.slot_weighting == "dpace" and draft.slot_gamma is not None:
        raise ValueError(f"draft.slot_gamma = {draft.slot_gamma} with draft.slot_weighting = 'dpace', which does not "
                         "read it; accepted: draft.slot_gamma unset, or draft.slot_weighting = 'decay'")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = {draft.kind!r}: its anchored blocks are not "
                     "built for sliced sequences yet; accepted: context_parallel = 1")
