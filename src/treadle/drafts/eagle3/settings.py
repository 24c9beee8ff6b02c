"""EAGLE-3's [draft] keys and refusals (drafts/settings.py says what a kind's settings provide)."""

from __future__ import annotations

NAME = "eagle3"
KEYS = ("feature_layers", "vocab_size", "init", "ttt_steps")
TTT_STEPS = 7
LAYOUTS = ("treadle",)  # draft.layout unset: its export is always the EAGLE layout vLLM and SGLang load
# [lora] on a draft.init of this kind: per-domain adapters on a trained draft (models/lora.py, docs/lora.md)
ADAPTERS = True
# Why draft.layout / draft.window are refused (drafts/settings.py words the one-line refusals).
LAYOUT_NOTE = "its layout is the EAGLE one vLLM and SGLang load"
WINDOW_NOTE = "it has no windowed self-attention"


def check(draft) -> None:
    layers = draft.feature_layers
    if layers is not None and (len(layers) != 3 or layers[0] < 1 or not layers[0] < layers[1] < layers[2]):
        raise ValueError(f"draft.feature_layers = {layers}: accepted: three strictly increasing "
                         "output_hidden_states indices >= 1 (i = decoder layer i's output; < the target's "
                         "layer count), what vLLM and SGLang serve; unset = EAGLE-3's (2, N/2, N - 3)")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    if loss_chunk_tokens == 0:  # "auto" chunks under context parallelism (eagle3_setup)
        raise ValueError(f"distributed.context_parallel = {cp} with draft.kind = 'eagle3' and "
                         "model.loss_chunk_tokens = 0: a sequence slice is scored only chunk by chunk; accepted: "
                         "model.loss_chunk_tokens = auto or > 0, or context_parallel = 1")
