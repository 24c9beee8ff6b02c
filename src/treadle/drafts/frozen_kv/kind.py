"""Frozen-KV drafts (Gemma 4's assistant) as a draft kind (drafts/kind.py): model, objective, drafter and layout."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.frozen_kv import layout, settings
from treadle.drafts.frozen_kv.model import build_frozen_kv, load_frozen_kv
from treadle.drafts.frozen_kv.objective import frozen_kv_setup
from treadle.drafts.kind import DraftKind


class FrozenKv(DraftKind):
    settings = settings
    read_config = staticmethod(layout.read_config)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_frozen_kv(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_frozen_kv(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return frozen_kv_setup(cfg, model)

    def drafter(self, model):
        from treadle.drafts.frozen_kv.drafter import FrozenKvDrafter

        return FrozenKvDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """``Gemma4AssistantForCausalLM``'s own checkpoint (frozen_kv/layout.py), every name checked first."""
        # config.json's dtype as transformers names it ("float32", "bfloat16"), not treadle's "fp32" / "bf16"
        name = str(torch_dtype).removeprefix("torch.")
        return layout.export(draft.assistant.config, weights, name, {**draft.export_config(), **meta})

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """``generation_config.json`` with ``num_assistant_tokens`` = the trained unroll depth."""
        steps = (config or {}).get("training", {}).get("ttt_steps") or settings.TTT_STEPS  # the [draft] dump
        layout.write_generation_config(Path(directory), steps)


FROZEN_KV = FrozenKv()
