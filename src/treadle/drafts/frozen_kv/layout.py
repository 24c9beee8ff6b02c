"""The assistant on disk: ``Gemma4AssistantForCausalLM``'s own checkpoint, the one place treadle's names meet it.

An export is what ``Gemma4AssistantForCausalLM.from_pretrained`` loads and ``generate(..., assistant_model=...)``
drives: ``model.safetensors`` under the module's own names (treadle's are them behind ``assistant.``), ``config.json``
(``model_type: gemma4_assistant``, treadle's metadata as extra keys) and ``generation_config.json`` with
``num_assistant_tokens`` (generate's K per round; the trained ``draft.ttt_steps``). Every name is checked against a
freshly built ``Gemma4AssistantForCausalLM(config).state_dict()`` before anything is written: a renamed weight would
load as a random one with only a warning from transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treadle.drafts.kind import layout_config
from treadle.errors import UserError

PREFIX = "assistant."  # FrozenKvDraft's attribute: treadle's names are the module's behind it
ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"
TIED = "lm_head.weight"  # tied to model.embed_tokens.weight: written once, as save_pretrained writes it


def check_names(have, want, what: str) -> None:
    """Refuse, in one line, names that are not exactly the ones ``Gemma4AssistantForCausalLM`` holds."""
    unknown, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    if unknown or missing:
        raise UserError(f"{what}: the weight names do not match Gemma4AssistantForCausalLM's (unknown {unknown[:6]}, "
                        f"missing {missing[:6]}); nothing was written or loaded")


def export(assistant_config, weights: dict, dtype: str, meta: dict) -> tuple[dict, dict]:
    """(tensors, config.json) of the export from the draft's weights in treadle's names."""
    from transformers import Gemma4AssistantForCausalLM

    names = {(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in weights.items()}
    with torch.device("meta"):
        want = Gemma4AssistantForCausalLM(assistant_config).state_dict()
    check_names(names, want, "frozen_kv export")
    if assistant_config.tie_word_embeddings:
        names.pop(TIED)
    config = {**assistant_config.to_dict(), "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    clash = sorted(config.keys() & meta.keys())
    if clash:
        raise UserError(f"frozen_kv export: treadle's metadata keys {clash} would overwrite the assistant's config")
    return names, {**config, "dtype": dtype, **meta}


def write_generation_config(directory: Path, num_assistant_tokens: int) -> None:
    """generate's K: ``SinglePositionMultiTokenCandidateGenerator`` reads the assistant's ``num_assistant_tokens``."""
    from transformers import GenerationConfig

    GenerationConfig(num_assistant_tokens=num_assistant_tokens,
                     num_assistant_tokens_schedule="constant").save_pretrained(directory)


def read_config(draft_dir) -> dict | None:
    """The config.json of a Gemma 4 assistant (a frozen_kv export or a shipped one: its kind added), or None."""
    return layout_config(draft_dir, lambda config: config.get("model_type") == MODEL_TYPE, "frozen_kv")
