"""An mtp draft run's objective: the recursive unroll drafts/recurrent.py scores (shared with frozen_kv)."""

from __future__ import annotations

from treadle.drafts.recurrent import recurrent_setup as mtp_setup

__all__ = ["mtp_setup"]
