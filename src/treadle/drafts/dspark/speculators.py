"""The DSpark draft in the speculators format (drafts/speculators_format.py ``BlockTable``): its table, both ways.

Read for this: speculators 0.9.0 (PyPI wheel) ``speculators/models/dspark/config.py`` (``DSparkSpeculatorConfig``:
DFlash's keys, ``sample_from_anchor`` True by default (slot k guesses anchor + k + 1, as treadle's DSpark), plus
``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``) and
``models/dspark/core.py`` / ``model_definitions.py`` (``markov_head.markov_w{1,2}.weight``,
``confidence_head.proj.{weight,bias}``: the Qwen3DSparkModel layout's names). Refused: stages a DeepSeek-V4 target
carries (no speculators class) and a target whose logits are transformed.
"""

from __future__ import annotations

from treadle.drafts.dspark import layout
from treadle.drafts.speculators_format import BlockTable, logit_transform_refusal

HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# The Qwen3DSparkModel config's own top-level keys (dspark/layout.py export) that speculators states otherwise.
ENGINE_KEYS = ("target_layer_ids", "mask_token_id", "num_anchors", "draft_vocab_size", "sample_from_anchor",
               "dspark_bonus_anchor")


def refusal(draft, target_config) -> str | None:
    if getattr(draft, "found", None) is not None:  # dspark/v4.py's DSparkStages (not imported: v4 reads this table)
        return "the draft is the DSpark stages a DeepSeek-V4 target carries; speculators has no class for them"
    return logit_transform_refusal(draft, target_config)


TABLE = BlockTable("dspark", "DSparkSpeculator", layout, sample_from_anchor=True, own=HEAD_KEYS,
                   dropped=ENGINE_KEYS, refuse=refusal)
export, is_layout, as_layout = TABLE.export, TABLE.is_layout, TABLE.as_layout
