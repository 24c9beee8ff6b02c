"""DSpark as a draft kind (drafts/kind.py): the block kind (drafts/dflash/kind.py) with DSpark's model, objective,
drafter and layout, and the stages of a target that shipped them (dspark/v4.py)."""

from __future__ import annotations

from pathlib import Path

from treadle.drafts.dflash.kind import BlockKind
from treadle.drafts.dspark import layout as dspark_layout
from treadle.drafts.dspark import settings
from treadle.drafts.dspark import speculators as dspark_speculators
from treadle.drafts.dspark.drafter import DSparkDrafter
from treadle.drafts.dspark.build import build_dspark, load_dspark
from treadle.drafts.dspark.model import DSparkModel
from treadle.drafts.dspark.objective import DSparkObjective


STITCHED = "stitched"  # a stages run's export: the target checkpoint with the trained stages put back


class DSpark(BlockKind):
    settings = settings
    model_class = DSparkModel
    objective_class = DSparkObjective
    drafter_class = DSparkDrafter
    # Always the Qwen3DSparkModel layout vLLM and SGLang load (dspark/layout.py): no embedding, head or d2t; stages
    # a target shipped (dspark/v4.py) are exported under the checkpoint's own names instead
    layout = dspark_layout
    speculators = dspark_speculators  # `treadle export --to speculators`, draft.init of that format
    confidence_head = True  # --confidence-threshold: the engines' early stop (drafter.py)

    def build(self, cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
        return build_dspark(cfg, data_vocab, data_tokenizer_fingerprint, empty)

    def load(self, draft_dir, target):
        return load_dspark(draft_dir, target)

    def setup(self, cfg, model, datasets):
        from treadle.drafts.dspark.v4 import StagesModel, refuse_unbuilt

        if isinstance(model, StagesModel):
            refuse_unbuilt(cfg)
        return super().setup(cfg, model, datasets)

    def drafter(self, model):
        from treadle.drafts.dspark.v4 import DSparkStages

        if isinstance(model.draft_model, DSparkStages):
            from treadle.drafts.dspark.drafter import StagesDrafter

            return StagesDrafter(model)
        return super().drafter(model)

    def max_gamma(self, config: dict) -> int | None:
        return dspark_layout.block_size(config)

    def export(self, draft, weights: dict, target_config, torch_dtype, dtype: str, meta: dict) -> tuple[dict, dict]:
        """Stages a target shipped: the stage tensors under the checkpoint's own names and dtypes, with the target's
        config (``write_extra`` stitches them into a copy of the target); else the Qwen3DSparkModel layout."""
        from treadle.drafts.dspark.v4 import DSparkStages

        if isinstance(draft, DSparkStages):
            return draft.to_checkpoint(weights), {**target_config.to_dict(), **draft.export_config(), **meta}
        return super().export(draft, weights, target_config, torch_dtype, dtype, meta)

    def write_extra(self, directory: Path, weights: dict, config: dict | None = None,
                    target_dir: Path | None = None) -> None:
        """Stages: ``stitched/``, a copy of the target checkpoint with the trained stage tensors put where they were
        (drafts/dspark/stages.py ``stitch``): every other tensor's bytes, the index and the config unchanged."""
        if config and config.get("treadle_dspark_stages"):
            from treadle.drafts.dspark import stages
            from treadle.drafts.dspark.v4 import FROZEN

            trained = {k: v for k, v in weights.items() if not k.endswith(FROZEN)}
            stages.stitch(target_dir, Path(directory) / STITCHED, trained)


DSPARK = DSpark()
