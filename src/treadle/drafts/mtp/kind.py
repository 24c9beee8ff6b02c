"""MTP heads (the DeepSeek-V3 / GLM-4-MoE and Qwen3-Next / Qwen3.5 layouts) as a draft kind (drafts/kind.py): model,
objective, drafter and the two exports behind one object."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.kind import DraftKind
from treadle.drafts.mtp import layout, settings, speculators
from treadle.drafts.mtp.model import build_mtp, load_mtp
from treadle.drafts.mtp.objective import mtp_setup

STITCHED = "stitched"  # the export's subdirectory holding the target checkpoint with the layer put back


class Mtp(DraftKind):
    settings = settings
    carried_by_model = True  # MTP pretraining's model export is the checkpoint with its trained layer
    speculators = speculators  # `treadle export --to speculators` (the Qwen families), draft.init of that format

    def read_config(self, draft_dir) -> dict | None:  # its layout, or speculators' (the table passed in)
        return layout.read_config(draft_dir, speculators)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_mtp(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_mtp(draft_dir, target)

    def setup(self, cfg, model, datasets):
        return mtp_setup(cfg, model)

    def drafter(self, model):
        from treadle.drafts.mtp.drafter import MtpDrafter

        return MtpDrafter(model)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """The layer alone under its family's stand-alone prefix (DeepSeek: SGLang's NextN layout
        ``model.layers.0.*``; Qwen: ``mtp.*``), no embedding or head; every name checked against the module before
        anything is written."""
        layout.check_names(weights, draft.state_dict(), "mtp export")
        prefix = draft.family.prefix(target_config.num_hidden_layers, alone=True)
        tensors = {prefix + k: v for k, v in layout.to_checkpoint(weights, draft.family).items()}
        return tensors, layout.alone_config(target_config.to_dict(), {**draft.export_config(), "dtype": dtype, **meta})

    def write_into_model(self, model_dir: Path, draft, weights: dict) -> None:
        """The layer at its family's place in the model's own export (``layout.carry``), names checked first."""
        layout.check_names(weights, draft.state_dict(), "mtp export")
        layout.carry(model_dir, weights, draft.family)

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """``stitched/``: a copy of the target checkpoint with the layer put back at its family's place (DeepSeek:
        ``model.layers.{N}.*`` with the target's embedding and head copied beside it, which vLLM's DeepSeekMTP loads
        from there; Qwen: ``mtp.*``)."""
        target_config = config["target_config"]
        family = layout.family_of_config(target_config)
        alone = family.prefix(target_config["num_hidden_layers"], alone=True)
        layer = layout.stitched_layer(target_dir, {k[len(alone):]: v for k, v in weights.items()}, family)
        layout.stitch(target_dir, Path(directory) / STITCHED, layer,
                      family.prefix(target_config["num_hidden_layers"], alone=False))


MTP = Mtp()
