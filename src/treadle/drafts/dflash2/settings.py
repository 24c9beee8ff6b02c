"""DFlash2's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide): DFlash's, plus the
convolution's group and the selector's rank, candidates and loss weight."""

from __future__ import annotations

from treadle.drafts.dflash import settings as dflash

NAME = "dflash2"
KEYS = (*dflash.KEYS, "conv_group_size", "selector_rank", "selector_top_k", "selector_weight")
TTT_STEPS = 1  # no unroll: one forward drafts the whole block, the selector walks it
LAYOUTS = ("treadle",)
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "not built for DFlash2: its selector's export and adapters were never tried together; adapt a dflash draft"
LAYOUT_NOTE = "its layout is z-lab's DFlash2DraftModel one vLLM loads"
WINDOW_NOTE = dflash.WINDOW_NOTE

# z-lab's released DFlash2 (tests/fixtures/dflash2-config.json in z-lab/dflash), NeMo's and speculators' defaults.
CONV_KERNEL_SIZE = 2  # taps: the slot itself and the slot before it
CONV_GROUP_SIZE = 16  # channels sharing one dynamic tap correction
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
SELECTOR_WEIGHT = 1.0  # NeMo's selector_loss_weight, speculators' --selector-loss-alpha

block_size, num_layers, slot_gamma = dflash.block_size, dflash.num_layers, dflash.slot_gamma


def conv_group_size(draft) -> int:
    return draft.conv_group_size or CONV_GROUP_SIZE


def selector_rank(draft) -> int:
    return draft.selector_rank or SELECTOR_RANK


def selector_top_k(draft) -> int:
    return draft.selector_top_k or SELECTOR_TOP_K


def selector_weight(draft) -> float:
    return SELECTOR_WEIGHT if draft.selector_weight is None else draft.selector_weight


def check(draft) -> None:
    dflash.check(draft)


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    dflash.check_context_parallel(draft, cp, loss_chunk_tokens)
