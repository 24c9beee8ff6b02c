"""DFlash as a draft kind (drafts/kind.py): its model, objective, drafter and layout behind one object."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash import settings
from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dflash.layout import export as dflash_export
from treadle.drafts.dflash.model import build_dflash, load_dflash
from treadle.drafts.dflash.objective import dflash_setup
from treadle.drafts.kind import DraftKind


class DFlash(DraftKind):
    settings = settings

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dflash(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return dflash_setup(cfg, model)

    def drafter(self, model):
        return DFlashDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always z-lab's DFlashDraftModel layout vLLM and SGLang load (dflash/layout.py: config.json a Qwen3 config
        with dflash_config, ``model.safetensors`` under z-lab's names, no embedding or head)."""
        return dflash_export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """``dflash.py``, the model config.json's ``auto_map`` names: transformers' remote code for the directory
        (``AutoModel.from_pretrained(dir, trust_remote_code=True)``, as z-lab's drafts load; dflash/remote_code.py).
        vLLM and SGLang read the directory without it."""
        (Path(directory) / dflash_layout.REMOTE_CODE).write_bytes(dflash_layout.remote_code())


DFLASH = DFlash()
