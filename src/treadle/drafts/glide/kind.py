"""GLIDE as a draft kind (drafts/kind.py): its model, objective, drafter and layouts behind one object."""

from __future__ import annotations

from pathlib import Path

import torch

from treadle.drafts.glide import settings
from treadle.drafts.glide.drafter import GlideDrafter
from treadle.drafts.glide.layout import build_glide, export as longspec_export, load_glide
from treadle.drafts.glide.model import read_draft_config
from treadle.drafts.glide.objective import glide_setup
from treadle.drafts.kind import DraftKind
from treadle.drafts.targets import refuse_for


class Glide(DraftKind):
    settings = settings
    # treadle's generic reader, kept where GLIDE's layout check lives (glide/model.py): any treadle export of any kind
    # (its recorded treadle_draft_kind), and drafts trained elsewhere in EAGLE-3's or LongSpec's GLIDE layout
    read_config = staticmethod(read_draft_config)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        refuse_for("glide", cfg.target, "draft.target")  # from its config, before a weight is read
        built = build_glide(cfg, data_vocab, data_tokenizer_fingerprint, empty)
        refuse_for("glide", cfg.target, "draft.target", built[0].target)  # and what its modules show
        return built

    def load(self, draft_dir, target):
        return load_glide(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return glide_setup(cfg, model)

    def drafter(self, model):
        return GlideDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Layout ``longspec``: the Hugging Face directory LongSpec's ``LlamaGlideDecoderLayer`` /
        ``Qwen2GlideDecoderLayer.from_pretrained`` loads (glide/layout.py: config.json the target's config,
        ``model.safetensors`` under LongSpec's names). Layout ``treadle``: ``model.safetensors`` + ``config.json``
        (draft kind, hyper-parameters, target, training). Both also write ``draft_model_weights.pth``
        (``write_extra``)."""
        if draft.export_config().get("layout") == "longspec":  # LongSpec's names and config (glide/layout.py)
            return longspec_export(draft, weights, target_config, torch_dtype, {**draft.export_config(), **meta})
        return super().export(draft, weights, target_config, torch_dtype, dtype, meta)

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """``draft_model_weights.pth``: the same tensors, what LongSpec's trainer reloads (in layout ``treadle`` the
        file name and prefix stripping of LongSpec's trainer, not its names: LongSpec cannot load it)."""
        torch.save(weights, directory / "draft_model_weights.pth")


GLIDE = Glide()
