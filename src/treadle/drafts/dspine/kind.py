"""DSpine as a draft kind (drafts/kind.py): its model, objective, drafter and layout behind one object."""

from __future__ import annotations

from treadle.drafts.dspine import layout, settings
from treadle.drafts.dspine.drafter import DSpineDrafter
from treadle.drafts.dspine.model import build_dspine, load_dspine
from treadle.drafts.dspine.objective import dspine_setup
from treadle.drafts.kind import DraftKind


class DSpine(DraftKind):
    settings = settings
    read_config = staticmethod(layout.read_config)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dspine(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dspine(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return dspine_setup(cfg, model)

    def drafter(self, model):
        return DSpineDrafter(model)

    def max_gamma(self, config: dict) -> int | None:
        from treadle.drafts.dflash.layout import drafts_per_block

        return drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always SpecForge's DSpineDraftModel layout (dspine/layout.py)."""
        return layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


DSPINE = DSpine()
