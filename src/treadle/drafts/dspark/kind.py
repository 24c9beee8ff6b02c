"""DSpark as a draft kind (drafts/kind.py): its model, objective, drafter and layout behind one object."""

from __future__ import annotations

from treadle.drafts.dspark import layout as dspark_layout
from treadle.drafts.dspark import settings
from treadle.drafts.dspark.drafter import DSparkDrafter
from treadle.drafts.dspark.model import build_dspark, load_dspark
from treadle.drafts.dspark.objective import dspark_setup
from treadle.drafts.kind import DraftKind


class DSpark(DraftKind):
    settings = settings

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dspark(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dspark(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return dspark_setup(cfg, model)

    def drafter(self, model):
        return DSparkDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always the Qwen3DSparkModel layout vLLM and SGLang load (dspark/layout.py): no embedding, head or d2t."""
        return dspark_layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


DSPARK = DSpark()
