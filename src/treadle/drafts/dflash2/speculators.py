"""The DFlash2 draft in the speculators format (drafts/speculators_format.py ``BlockTable``): its table, both ways.

Read for this: speculators 0.9.0 (PyPI wheel) ``speculators/models/dflash2/config.py`` (``DFlash2SpeculatorConfig``:
DFlash's keys plus ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``;
``sliding_window_non_causal`` True by default) and ``models/dflash2/core.py`` / ``model_definitions.py``
(``DFlash2DraftModel``: the full verifier vocabulary only; ``layers.{i}.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}`` and ``candidate_selector.{predecessor,successor}_codebook, hidden_projection.weight``,
the names z-lab's layout and treadle's export use). Not expressible there, refused: a draft without its selector
(speculators' model always holds one) and a target whose logits are transformed (no key for it).
"""

from __future__ import annotations

from treadle.drafts.dflash2 import layout
from treadle.drafts.speculators_format import BlockTable, logit_transform_refusal


def refusal(draft, target_config) -> str | None:
    if draft.selector is None:
        return ("the draft has no candidate selector (trained as another head's backbone); speculators' "
                "DFlash2DraftModel always holds one")
    return logit_transform_refusal(draft, target_config)


TABLE = BlockTable("dflash2", "DFlash2DraftModel", layout, sample_from_anchor=False, non_causal=True,
                   own=layout.KEYS, dropped=("is_causal",), refuse=refusal)
export, is_layout, as_layout = TABLE.export, TABLE.is_layout, TABLE.as_layout
