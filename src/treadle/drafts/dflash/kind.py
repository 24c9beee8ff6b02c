"""DFlash as a draft kind (drafts/kind.py), and ``BlockKind``: what every block draft on DFlash's backbone (DFlash2,
DSpark, DSpine, LiLiCorr, XPress) does through DFlash's functions with its own classes and layout."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash import settings
from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.dflash import speculators as dflash_speculators
from treadle.drafts.dflash.model import DFlashModel, build_dflash, load_dflash
from treadle.drafts.dflash.objective import DFlashObjective, dflash_setup
from treadle.drafts.kind import DraftKind


class BlockKind(DraftKind):
    """A block draft on DFlash's backbone: built, loaded, set up, decoded and exported by DFlash's functions with the
    kind's ``model_class``, ``objective_class``, ``drafter_class`` and ``layout``. A kind on the backbone subclasses
    this, names its classes, and overrides only what differs (DSpine's build, DSpark's stages)."""

    settings = settings
    model_class = DFlashModel  # what build_dflash / load_dflash make
    objective_class = DFlashObjective
    drafter_class = DFlashDrafter
    layout = dflash_layout  # whose ``export`` writes the consumers' layout
    # ``speculators``: DraftKind's None unless the kind names its own table (a kind never inherits DFlash's)

    def read_config(self, draft_dir) -> dict | None:
        return self.layout.read_config(draft_dir, self.speculators)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, self.model_class)

    def load(self, draft_dir, target):
        return load_dflash(draft_dir, target, self.model_class)

    def setup(self, cfg, model, datasets):
        return dflash_setup(cfg, model, self.objective_class)

    def drafter(self, model):
        return self.drafter_class(model)

    def max_gamma(self, config: dict) -> int | None:
        return dflash_layout.drafts_per_block(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Always the kind's ``layout``, the one its engines load (vLLM's, SGLang's): DFlash's is z-lab's
        DFlashDraftModel (dflash/layout.py: config.json a Qwen3 config with dflash_config, ``model.safetensors``
        under z-lab's names, no embedding or head)."""
        return self.layout.export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})


class DFlash(BlockKind):
    """DFlash's kind: the block kind that also ships transformers' remote code."""

    speculators = dflash_speculators  # `treadle export --to speculators`, draft.init of that format

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """``dflash.py``, the model config.json's ``auto_map`` names: transformers' remote code for the directory
        (``AutoModel.from_pretrained(dir, trust_remote_code=True)``, as z-lab's drafts load; dflash/remote_code.py).
        vLLM and SGLang read the directory without it."""
        (Path(directory) / dflash_layout.REMOTE_CODE).write_bytes(dflash_layout.remote_code())


DFLASH = DFlash()
