"""A frozen_kv draft run's objective: the recursive unroll drafts/recurrent.py scores (shared with mtp): step k's
row t guesses token t + k + 1, CE / KL / mix per ``draft.loss``, step k weighted ``ttt_decay**(k - 1)``; metrics
``acc_k`` and ``eal``."""

from __future__ import annotations

from treadle.drafts.recurrent import recurrent_setup as frozen_kv_setup

__all__ = ["frozen_kv_setup"]
