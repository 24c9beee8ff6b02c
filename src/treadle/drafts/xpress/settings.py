"""XPress's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide).

The backbone is a DFlash draft, so every dflash key means what it means there and is checked by dflash's rules; the
refiner's shape and recipe are speculators 0.9.0's defaults (``--speculator-type xpress``), fixed here.
"""

from __future__ import annotations

from treadle.drafts.dflash import settings as dflash

NAME = "xpress"
KEYS = dflash.KEYS
TTT_STEPS = 1  # no unroll: one backbone forward, then a fixed number of refiner passes over the whole block
LAYOUTS = ("treadle",)
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "adapters on its refiner head (bottleneck, block mixer, vocabulary readout) are not built"
LAYOUT_NOTE = "its layout is speculators' XPressSpeculator one (vLLM PR #54448 serves it)"
WINDOW_NOTE = dflash.WINDOW_NOTE

# The refiner (speculators' XPressSpeculatorConfig defaults): rank-r bottleneck, SwiGLU MLP r -> ratio * r -> r.
RANK = 256
MLP_RATIO = 2
JACOBI_PASSES = 6  # decode: refiner passes, each fed the previous pass's argmax (the engines' fixed serial depth)
# Training (speculators' XPressDraftModel.get_trainer_kwargs defaults): one teacher-forced refiner pass, then
# CONSISTENCY_PASSES free-running rounds weighted CONSISTENCY_WEIGHT (their mean), and the backbone's own slot loss
# (draft.loss) weighted BASE_WEIGHT; the refiner's terms are CE_WEIGHT * CE + TV_WEIGHT * TV against the target.
CONSISTENCY_PASSES = 3
CONSISTENCY_WEIGHT = 0.3
BASE_WEIGHT = 0.6
CE_WEIGHT = 0.1
TV_WEIGHT = 0.9

# The block's shape keys: DFlash's getters and defaults (block 16, 5 layers: speculators' XPress recipe too).
block_size, num_layers, slot_gamma = dflash.block_size, dflash.num_layers, dflash.slot_gamma


def check(draft) -> None:
    dflash.check(draft)


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    dflash.check_context_parallel(draft, cp, loss_chunk_tokens)
