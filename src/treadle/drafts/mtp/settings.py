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


def check(draft) -> None:
    """Nothing of its own beyond the layout and window refusals every single-layout kind gets."""


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'mtp': its unroll is not built for "
                     "sliced sequences yet; accepted: context_parallel = 1")


def check_beside(draft) -> None:
    """Beside its target, jointly: the module's input is the target's final hidden state, which is also the teacher
    of a kl / mix loss; its loss would pull the target toward its draft. DeepSeek-V3 trains MTP on the data."""
    if draft.joint and draft.loss != "ce":
        raise ValueError(f"draft.joint = true with draft.kind = 'mtp' and draft.loss = {draft.loss!r}: the target's "
                         "hidden state the module reads is also the teacher, which the joint loss would train toward "
                         "the draft; accepted: draft.loss = 'ce' (DeepSeek-V3's MTP objective), or draft.joint = false")
