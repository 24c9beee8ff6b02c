"""DSpark's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

from functools import partial

from treadle.drafts.dflash import settings as dflash

NAME = "dspark"
KEYS = ("feature_layers", "init", "block_size", "num_layers", "anchors", "slot_gamma", "mask_token_id", "markov_rank")
TTT_STEPS = 1  # no unroll: one backbone forward, then the Markov head left to right over the block
LAYOUTS = ("treadle",)  # its export is always the Qwen3DSparkModel layout vLLM and SGLang load
# [lora] on a draft.init of this kind: per-domain adapters on a trained draft (models/lora.py, docs/lora.md)
ADAPTERS = True
LAYOUT_NOTE = "its layout is the Qwen3DSparkModel one vLLM and SGLang load"
WINDOW_NOTE = "its block attends to the whole context"

# DeepSpec's recipe (deepseek-ai/DeepSpec config/dspark/dspark_qwen3_8b.py): block 7 (every slot a draft), 5 layers,
# Markov rank 256, slot k's loss weighed exp(-k / 4).
BLOCK_SIZE = 7
NUM_LAYERS = 5
SLOT_GAMMA = 4.0
MARKOV_RANK = 256


block_size = partial(dflash.block_size, default=BLOCK_SIZE)
num_layers = partial(dflash.num_layers, default=NUM_LAYERS)
slot_gamma = partial(dflash.slot_gamma, default=SLOT_GAMMA)


def markov_rank(draft) -> int:
    return draft.markov_rank or MARKOV_RANK


def check(draft) -> None:
    dflash.check_feature_layers(draft)
    if draft.gamma > block_size(draft):
        raise ValueError(f"draft.gamma = {draft.gamma} with draft.kind = 'dspark' and a block of {block_size(draft)}: "
                         f"one draft forward proposes block_size = {block_size(draft)} tokens (the anchor's slot "
                         "drafts too); accepted: draft.gamma <= draft.block_size")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'dspark': its anchored blocks are not "
                     "built for sliced sequences yet; accepted: context_parallel = 1")
