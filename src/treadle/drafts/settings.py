"""What the config knows of each draft kind: its name, the ``[draft]`` keys it reads, its defaults, its refusals.

Plain Python, no torch: ``config/schema.py`` validates ``[draft]`` with it whenever a config loads (``treadle
config`` answers without torch), so the ``settings`` modules sit in the config's layer (tests/test_layers.py)
and import nothing else of treadle. What a kind does at run time (build, objective, drafter, layouts) is its
``kind.py``, found through ``drafts/registry.py``.

A kind's ``settings.py`` provides: ``NAME`` (draft.kind), ``KEYS`` (the optional [draft] keys of OPTIONAL_KEYS it
reads), ``TTT_STEPS`` (draft.ttt_steps when unset), ``LAYOUTS`` (draft.layout values it trains and exports),
``LAYOUT_NOTE`` / ``WINDOW_NOTE`` (only a kind that refuses another layout / a draft.window: why, in the refusal),
``check(draft)`` (its own refusals of a DraftConfig) and ``check_context_parallel(draft, cp, loss_chunk_tokens)`` (its
refusals when distributed.context_parallel = cp > 1, model.loss_chunk_tokens as set: "auto" or an int), each refusal a
one-line ValueError.
"""

from __future__ import annotations

from treadle.drafts.dflash import settings as dflash
from treadle.drafts.dspark import settings as dspark
from treadle.drafts.dspine import settings as dspine
from treadle.drafts.dflash2 import settings as dflash2
from treadle.drafts.eagle3 import settings as eagle3
from treadle.drafts.frozen_kv import settings as frozen_kv
from treadle.drafts.glide import settings as glide
from treadle.drafts.lilicorr import settings as lilicorr
from treadle.drafts.mtp import settings as mtp
from treadle.drafts.xpress import settings as xpress

KINDS = {k.NAME: k for k in (glide, eagle3, dflash, mtp, frozen_kv, dspark, dflash2, lilicorr, dspine,
                             xpress)}
NAMES = tuple(KINDS)  # draft.kind's accepted values, in this order (what configuration.md and errors list)
# Unset unless a kind reads them; checked in this order.
OPTIONAL_KEYS = ("feature_layers", "vocab_size", "init", "ttt_steps", "block_size", "num_layers", "anchors",
                 "slot_gamma", "slot_weighting", "mask_token_id", "markov_rank",
                 "conv_group_size", "selector_rank", "selector_top_k", "selector_weight",
                 "candidates", "correlator_layers", "train_backbone")  # unset unless a kind reads them; checked in this order


def _kinds_with(test) -> str:
    return " or ".join(repr(name) for name in sorted(KINDS) if test(KINDS[name]))  # alphabetical


def check(draft) -> None:
    """A ``DraftConfig``'s keys against its kind (or against no kind: an ordinary run)."""
    own = KINDS.get(draft.kind)
    for key in OPTIONAL_KEYS:
        if getattr(draft, key) is not None and (own is None or key not in own.KEYS):
            raise ValueError(f"draft.{key} is set but draft.kind = {draft.kind!r}; accepted: draft.kind = "
                             f"{_kinds_with(lambda k: key in k.KEYS)}, or leave it unset")
    if own is None:
        if draft.layout != "treadle":
            raise ValueError(f"draft.layout = {draft.layout!r} is set but draft.kind = {draft.kind!r}; accepted: "
                             f"draft.kind = {_kinds_with(lambda k: draft.layout in k.LAYOUTS)}, or leave it unset")
    else:
        # A kind with one layout (LAYOUT_NOTE: why) or without windowed attention (WINDOW_NOTE: why) refuses the key.
        if draft.layout not in own.LAYOUTS:
            raise ValueError(f"draft.layout = {draft.layout!r} with draft.kind = {own.NAME!r} ({own.LAYOUT_NOTE}); "
                             "accepted: draft.layout unset")
        if draft.window and getattr(own, "WINDOW_NOTE", None):
            raise ValueError(f"draft.window = {draft.window} with draft.kind = {own.NAME!r} ({own.WINDOW_NOTE}); "
                             "accepted: draft.window = 0")
        own.check(draft)


def check_beside(draft) -> None:
    """``draft.target = 'self'``: the run's kind reads its target's training forward (a kind's ``BESIDE_NOTE``
    says why it cannot)."""
    own = KINDS[draft.kind]
    note = getattr(own, "BESIDE_NOTE", None)
    if note is not None:
        live = " or ".join(repr(n) for n in sorted(KINDS) if getattr(KINDS[n], "BESIDE_NOTE", None) is None)
        raise ValueError(f"draft.target = 'self' with draft.kind = {own.NAME!r}: {note}; accepted: draft.kind = "
                         f"{live}, or draft.target = a frozen target's directory")
    if hasattr(own, "check_beside"):
        own.check_beside(draft)


def check_lora(draft) -> None:
    """``[lora]`` in a draft run: adapters on a trained draft (``draft.init``) of a kind that has them (a kind's
    ``ADAPTERS``; else its ``LORA_NOTE`` says why not)."""
    own = KINDS[draft.kind]
    if not getattr(own, "ADAPTERS", False):
        adapted = " or ".join(repr(n) for n in sorted(KINDS) if getattr(KINDS[n], "ADAPTERS", False))
        raise ValueError(f"lora.rank with draft.kind = {own.NAME!r}: {own.LORA_NOTE}; accepted: draft.kind = "
                         f"{adapted}, or lora.rank unset")
    if draft.init is None:
        raise ValueError(f"lora.rank with draft.kind = {own.NAME!r} and no draft.init: adapters adapt a trained draft "
                         "(the base draft stays frozen); accepted: draft.init = the base draft's directory (an export "
                         "or its run directory), or lora.rank unset")


def check_context_parallel(draft, cp: int, loss_chunk_tokens: str | int) -> None:
    """What the run's kind refuses when ``distributed.context_parallel = cp > 1`` with ``model.loss_chunk_tokens``
    (an ordinary run: nothing)."""
    own = KINDS.get(draft.kind)
    if own is not None:
        own.check_context_parallel(draft, cp, loss_chunk_tokens)


def default_ttt_steps(kind: str) -> int:
    return KINDS[kind].TTT_STEPS
