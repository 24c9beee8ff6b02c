"""GLIDE's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

NAME = "glide"
KEYS = ("init", "ttt_steps")
TTT_STEPS = 1  # the teacher-forced pass alone (no unroll)
LAYOUTS = ("treadle", "longspec")
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "not built for GLIDE: no engine serves a GLIDE draft with adapters, and its cross-attention into the target's K/V was never tried under PEFT"

# Why draft.target = 'self' is refused (drafts/settings.py check_beside words it).
BESIDE_NOTE = "GLIDE reads the K/V cache of the target's last layer, which the training forward does not hand out yet"

def check(draft) -> None:
    if draft.layout == "longspec" and draft.window not in (0, 513):
        raise ValueError(f"draft.window = {draft.window} with draft.layout = 'longspec': LongSpec's "
                         "self-attention reads the 512 tokens before each token, fixed in its code; "
                         "accepted: draft.window = 0 or 513 (treadle counts the token itself)")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    if (draft.ttt_steps or 1) > 1:
        raise ValueError(f"distributed.context_parallel = {cp} with draft.ttt_steps = {draft.ttt_steps}: the "
                         "GLIDE training-time test is not built for sliced sequences; accepted: context_parallel = "
                         "1, or draft.ttt_steps = 1")
