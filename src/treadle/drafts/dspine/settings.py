"""DSpine's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide).

The backbone is a DFlash draft, so every dflash key means what it means there; DSpine adds ``candidates``, the
top-k of each slot's backbone logits that the predecessor-conditioned scores rerank (SpecForge's ``top_k``). The
transfer space's rank and the message width follow the target (SpecForge's 1024 and 512, capped by the target's
width and vocabulary: drafts/dspine/model.py).
"""

from __future__ import annotations

from treadle.drafts.dflash import settings as dflash

NAME = "dspine"
KEYS = (*dflash.KEYS, "candidates")
TTT_STEPS = 1  # no unroll: one forward drafts the whole block, the candidate walk reranks it
LAYOUTS = ("treadle",)
LORA_NOTE = "not built for DSpine: its injection's export and adapters were never tried together; adapt a dflash draft"
LAYOUT_NOTE = "its layout is SpecForge's DSpineDraftModel one (z-lab's DFlash plus injection.* and transfer_codes)"
WINDOW_NOTE = dflash.WINDOW_NOTE

# SpecForge's DSpineConfig defaults (specforge/modeling/draft/dspine.py @9aafadf).
CANDIDATES = 16
TRANSFER_RANK = 1024
MESSAGE_SIZE = 512
CE_WEIGHT = 0.1  # the backbone's and the refinement's CE share; the rest is the L1 to the target's distribution
ALIGNMENT_WEIGHT = 0.5
CANDIDATE_MASS = 1e-4  # the refinement's L1 is left out where the target gives the candidates less mass

block_size, num_layers, slot_gamma = dflash.block_size, dflash.num_layers, dflash.slot_gamma


def candidates(draft) -> int:
    return draft.candidates or CANDIDATES


def check(draft) -> None:
    dflash.check(draft)
    if block_size(draft) < 2:
        raise ValueError(f"draft.block_size = {block_size(draft)} with draft.kind = 'dspine': a block holds the anchor "
                         "and at least one draft; accepted: draft.block_size >= 2")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    dflash.check_context_parallel(draft, cp, loss_chunk_tokens)
