"""Frozen-KV drafts' [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

NAME = "frozen_kv"
KEYS = ("init", "ttt_steps", "num_layers")
# generate drives the assistant num_assistant_tokens steps per round from one position; 3 is the depth FastMTP and
# speculators train a replayed module to (the mtp kind's default, frontier-2026-11.md §1.3) and the export's
# num_assistant_tokens: deeper steps are worth little with a draft whose acceptance falls per step.
TTT_STEPS = 3
NUM_LAYERS = 2  # a new assistant's layers (draft.num_layers unset): one sliding, one full, so it reads both K/V
LAYOUTS = ("treadle",)  # draft.layout unset: the export is always Gemma4AssistantForCausalLM's own checkpoint
# Why [lora] (adapters on a draft) is refused for this kind (drafts/settings.py words the one-line refusal).
LORA_NOTE = "a Gemma-4 assistant is served by transformers' generate, which loads no adapter for the assistant"
# Why draft.layout / draft.window are refused (drafts/settings.py words the one-line refusals).
LAYOUT_NOTE = "its layout is Gemma4AssistantForCausalLM's own checkpoint"
WINDOW_NOTE = "its attention reads the target's K/V under the target's own sliding window"

# Why draft.target = 'self' is refused (drafts/settings.py check_beside words it).
BESIDE_NOTE = "Gemma 4's assistant reads the target's KV cache, which the training forward does not hand out yet"

def check(draft) -> None:
    """Nothing of its own beyond the layout and window refusals every single-layout kind gets."""


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'frozen_kv': its unroll is not built "
                     "for sliced sequences yet; accepted: context_parallel = 1")


def num_layers(draft) -> int:
    return draft.num_layers or NUM_LAYERS
