"""MTP heads' [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

NAME = "mtp"
KEYS = ("init", "ttt_steps")
# FastMTP's and speculators' recursive depth: the engines replay the one module num_speculative_tokens times, and
# training the replay up to 3 deep is what both report gains for (FastMTP, arXiv 2509.18362; vllm-project/speculators
# ``docs/user_guide/algorithms/mtp.md`` and PR #366).
TTT_STEPS = 3
LAYOUTS = ("treadle",)  # draft.layout unset: the export is always the target family's own checkpoint layout
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "an MTP head is served from inside the target's own checkpoint, where an adapter is the target's adapter (the [model] run's [lora])"
# Why draft.layout / draft.window are refused (drafts/settings.py words the one-line refusals).
LAYOUT_NOTE = "its layout is the target checkpoint's own (model.layers.{N}.* or mtp.*)"
WINDOW_NOTE = "its decoder block is the target's, full causal attention"

# Why draft.target = 'self' is refused (drafts/settings.py check_beside words it).
BESIDE_NOTE = "an MTP layer beside its target (trained with it from step 0) is not built yet"

def check(draft) -> None:
    """Nothing of its own beyond the layout and window refusals every single-layout kind gets."""


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'mtp': its unroll is not built for "
                     "sliced sequences yet; accepted: context_parallel = 1")
