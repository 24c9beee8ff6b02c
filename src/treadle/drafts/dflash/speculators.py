"""The DFlash draft in the speculators format (drafts/speculators_format.py ``BlockTable``): its table, both ways.

Read for this: speculators 0.9.0 (PyPI wheel) ``speculators/models/dflash/config.py`` (``DFlashSpeculatorConfig``,
registered as ``"dflash"``, architectures ``["DFlashSpeculator"]``, ``sample_from_anchor`` False by default: slot 0 is
the anchor, slots 1.. draft, as treadle's DFlash), ``models/dflash/core.py`` (``DFlashDraftModel``: z-lab's tensor
names) and ``convert/dflash/converter.py`` (z-lab's config regrouped; its layer ids + 1).
"""

from __future__ import annotations

from treadle.drafts.dflash import layout
from treadle.drafts.speculators_format import BlockTable, logit_transform_refusal

TABLE = BlockTable("dflash", "DFlashSpeculator", layout, sample_from_anchor=False, refuse=logit_transform_refusal)
export, is_layout, as_layout = TABLE.export, TABLE.is_layout, TABLE.as_layout
