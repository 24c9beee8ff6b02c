"""DSpark as a draft kind (drafts/kind.py): DFlash's (drafts/dflash/kind.py) with DSpark's model, objective,
drafter and layout."""

from __future__ import annotations

from treadle.drafts.dflash.kind import DFlash
from treadle.drafts.dspark import layout as dspark_layout
from treadle.drafts.dspark import settings
from treadle.drafts.dspark.drafter import DSparkDrafter
from treadle.drafts.dspark.model import DSparkModel
from treadle.drafts.dspark.objective import DSparkObjective
from treadle.drafts.kind import DraftKind


class DSpark(DFlash):
    settings = settings
    model_class = DSparkModel
    objective_class = DSparkObjective
    drafter_class = DSparkDrafter
    # Always the Qwen3DSparkModel layout vLLM and SGLang load (dspark/layout.py): no embedding, head or d2t ...
    layout = dspark_layout
    # ... and no remote code beside it (transformers has no DSpark class; the engines read the directory)
    write_extra = DraftKind.write_extra


DSPARK = DSpark()
