"""DFlash2 as a draft kind (drafts/kind.py): its model, objective, drafter and layout behind one object."""

from __future__ import annotations

from treadle.drafts.dflash2 import layout, settings, speculators
from treadle.drafts.dflash2.drafter import DFlash2Drafter
from treadle.drafts.dflash2.model import build_dflash2, load_dflash2
from treadle.drafts.dflash2.objective import dflash2_setup
from treadle.drafts.kind import DraftKind


class DFlash2(DraftKind):
    settings = settings
    speculators = speculators  # `treadle export --to speculators`, draft.init of that format

    def read_config(self, draft_dir) -> dict | None:  # its layout, or speculators' (the table passed in)
        return layout.read_config(draft_dir, speculators)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dflash2(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dflash2(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return dflash2_setup(cfg, model)

    def drafter(self, model):
        return DFlash2Drafter(model)

    def max_gamma(self, config: dict) -> int | None:
        from treadle.drafts.dflash.layout import drafts_per_block

        return drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always z-lab's DFlash2DraftModel layout vLLM loads (dflash2/layout.py)."""
        return layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


DFLASH2 = DFlash2()
