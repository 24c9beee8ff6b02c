"""EAGLE-3 as a draft kind (drafts/kind.py): its model, objective, drafter and layout behind one object."""

from __future__ import annotations

from treadle.drafts.eagle3 import settings, speculators
from treadle.drafts.eagle3.drafter import Eagle3Drafter
from treadle.drafts.eagle3.layout import export as eagle3_export
from treadle.drafts.eagle3.model import build_eagle3, load_eagle3
from treadle.drafts.eagle3.objective import eagle3_setup
from treadle.drafts.kind import DraftKind


class Eagle3(DraftKind):
    settings = settings
    # read_config: none of its own; GLIDE's generic reader (glide/model.py) recognises EAGLE-3's layout
    speculators = speculators  # `treadle export --to speculators`, draft.init of that format

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_eagle3(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_eagle3(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return eagle3_setup(cfg, model, datasets)

    def drafter(self, model):
        return Eagle3Drafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always the original EAGLE layout vLLM, SGLang, SpecForge and TensorRT-LLM load (eagle3/layout.py:
        config.json a Hugging Face Llama config, ``model.safetensors`` under the consumers' names)."""
        return eagle3_export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


EAGLE3 = Eagle3()
