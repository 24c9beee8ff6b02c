"""Top-1 agreement of a draft with its target, per slot: the counts every kind's objective reports and the rates the
run logs from them (``acc_k``, ``eal``), in training steps and in evaluations alike.

An objective reports side sums (summed over micro-batches and ranks like its loss): ``ttt_hits_k`` / ``ttt_rows_k``
(slot or unroll step k's guess is the target's greedy token, among the scored rows) and, where the draft proposes a
block or a chain, ``block_hits_k`` / ``block_rows_k`` (slots 1..k all are). The loop divides every side sum by the
label tokens; a rate is a ratio of two of them, so that division cancels. Plain Python: no torch here.
"""

from __future__ import annotations

COUNTS = ("ttt_hits_", "ttt_rows_", "block_hits_", "block_rows_")


def counts(side: dict) -> dict:
    """The agreement counts among an objective's side sums (what an evaluation passes on beside its loss)."""
    return {k: v for k, v in side.items() if k.startswith(COUNTS)}


def rates(metrics: dict, prefix: str = "") -> dict:
    """Replace ``{prefix}ttt_hits_k`` / ``{prefix}ttt_rows_k`` in ``metrics`` by ``{prefix}acc_k`` (a slot without a
    scored row gets none) and the block counts by ``{prefix}eal`` = sum_k P(slots 1..k all the target's greedy token),
    the drafts a greedy verification accepts per block (speculators' EAL, measured on whole blocks). In place; returns
    ``metrics``."""
    k = 1
    while f"{prefix}ttt_rows_{k}" in metrics:
        hits, rows = metrics.pop(f"{prefix}ttt_hits_{k}"), metrics.pop(f"{prefix}ttt_rows_{k}")
        if rows > 0:
            metrics[f"{prefix}acc_{k}"] = hits / rows
        k += 1
    k, eal = 1, 0.0
    while f"{prefix}block_rows_{k}" in metrics:
        hits, rows = metrics.pop(f"{prefix}block_hits_{k}"), metrics.pop(f"{prefix}block_rows_{k}")
        eal += hits / rows if rows > 0 else 0.0
        k += 1
    if k > 1:
        metrics[f"{prefix}eal"] = eal
    return metrics


def per_slot(record: dict, key: str) -> list[float]:
    """``record[f"{key}_1"]``, ``record[f"{key}_2"]`` ... up to the first one missing (a draft's ``accept_k``,
    ``acc_k``, ``eval_acc_k``)."""
    values, k = [], 1
    while isinstance(record.get(f"{key}_{k}"), (int, float)):
        values.append(record[f"{key}_{k}"])
        k += 1
    return values


def reached(record: dict) -> list[int]:
    """The rounds behind each ``accept_k`` of an acceptance record: those that reached position k,
    ``acceptance_rounds`` times the product of the rates before k (an empty list for a record without the count)."""
    rounds = record.get("acceptance_rounds")
    if not isinstance(rounds, int):
        return []
    counts, share = [], 1.0
    for rate in per_slot(record, "accept"):
        counts.append(round(rounds * share))
        share *= rate
    return counts
