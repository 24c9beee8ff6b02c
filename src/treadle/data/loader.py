"""Hands out each optimizer step's micro-batches for this rank, from one global sample order.

Step layout: a step consumes ``global_batch = micro_batch_size * grad_accum_steps *
world_size`` consecutive positions of the global order, starting at ``position``.
Micro-batch ``m`` on rank ``r`` takes positions ``position + (m * world_size + r) *
micro_batch_size + [0, micro_batch_size)``, so the samples of a step depend only on
the global batch size, not on how it is split into ranks and accumulation steps.
Which source and sample each position holds is ``mixture.py``'s business.

Each micro-batch carries, besides ``input_ids`` / ``labels`` / ``position_ids``:

* ``order_position`` - its rows' positions in the global order (a key for
  per-micro-batch randomness, e.g. a draft's lag, that no world size changes);
* ``source`` - each row's source index (per-source loss and tokens).

Every micro-batch's largest token id is checked against the model's vocabulary
(``vocab_size``) before it leaves the loader: a shard from another tool, without a
recorded ``max_token_id``, would otherwise train on silently or die inside the
embedding, depending on the draw. One max over a [mb, seq_len] tensor costs
microseconds against a step of milliseconds or more.

Context parallelism (``cp_size > 1``, ``distributed.context_parallel``): ``rank`` and ``world_size`` are the
data-parallel ones (every rank of a context group gets the same micro-batches) and each micro-batch leaves with
this rank's slice ``cp_rank`` of every sequence (``slice_sequences``). The labels were shifted when the sample
was made, so the slice keeps the label of its last position (the next slice's first token) and the slices'
label counts add up to the whole sequence's: the loop's token count, summed over all ranks, stays the step's.

Prefetch: while the model trains on step ``s``, a background thread reads and
collates step ``s + 1`` (its plan, the index math, is computed up front and is
cheap). A plan that turns out wrong (a rollback rewound the step) is discarded.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from treadle.data.mixture import Mixture, SampleOrder, stream_of
from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError


# A sample's per-position tensors: what a context-parallel rank cuts to its slice (the rest is per row).
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids")


def slice_sequences(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """Slice ``cp_rank`` of ``cp_size`` equal parts of every sequence in ``batch`` (rows, per-row keys untouched).

    Position ids keep their values (a document crossing the cut continues its positions on the next rank: the
    attention rebuilds the packed mask from them, RoPE reads them); labels are already shifted, so none is lost.
    """
    if cp_size == 1:
        return batch
    length = batch["input_ids"].shape[1]
    if length % cp_size:
        raise UserError(f"data.seq_len = {length} cannot be split into distributed.context_parallel = {cp_size} equal "
                        f"parts; accepted: a multiple of {cp_size}")
    part = length // cp_size
    return {k: v[:, cp_rank * part:(cp_rank + 1) * part].contiguous() if k in SEQUENCE_KEYS else v
            for k, v in batch.items()}


def _collate(dataset, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    items = [dataset[int(i)] for i in indices]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


# What a user can do when the saved data position does not fit: continue with the old data, or leave this run
# (a new run starts from the checkpoint's weights with model.path = the old run directory, whose hf/ holds them).
_REMEDY = ("accepted: the checkpoint's data and data.seq_len to continue the run, or a new train.output_dir "
           "(--model.path=<this run directory> starts from its exported weights)")


def check_token_ids(ids: torch.Tensor, vocab_size: int | None, where) -> None:
    """A ``UserError`` if any id in ``ids`` is at or beyond ``vocab_size`` (None: no check); ``where()`` names
    the data (called only then)."""
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        raise UserError(f"{where()} holds token id {int(ids.max())}, beyond the model's vocabulary (vocab_size "
                        f"{vocab_size}); accepted: ids below {vocab_size}, i.e. data tokenized with the model's tokenizer")


def _check_batch(batch: dict[str, torch.Tensor], vocab_size: int | None, where) -> None:
    # Labels are the inputs shifted by one, but a window's last label is not among its inputs.
    check_token_ids(batch["input_ids"], vocab_size, where)
    check_token_ids(batch["labels"], vocab_size, where)


@dataclass(frozen=True, eq=False)
class _Plan:
    """Everything needed to build one step's batches for one rank, computed from the loader state."""

    key: tuple  # (position, cursors before, step): equal keys, equal plans
    sources: np.ndarray  # [grad_accum_steps, micro_batch_size] source index per row
    samples: np.ndarray  # same shape: sample index within the source
    first_positions: tuple[int, ...]  # global position of each micro-batch's first row
    cursors: tuple[int, ...]  # every source's cursor after the step


class StepLoader:
    def __init__(self, datasets, micro_batch_size: int, grad_accum_steps: int, seed: int,
                 rank: int = 0, world_size: int = 1, mixture: Mixture | None = None, prefetch: bool = False,
                 vocab_size: int | None = None, cp_rank: int = 0, cp_size: int = 1):
        """``datasets``: one dataset (a source named "train") or ``{name: dataset}`` mixed by ``mixture``;
        ``vocab_size``: the model's, which every token id must be below (None: unchecked); ``rank`` /
        ``world_size``: data-parallel; ``cp_rank`` / ``cp_size``: this rank's slice of every sequence."""
        if micro_batch_size < 1 or grad_accum_steps < 1 or world_size < 1:
            raise UserError(
                f"micro_batch_size={micro_batch_size}, grad_accum_steps={grad_accum_steps}, "
                f"world_size={world_size}: all must be positive integers"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise UserError(f"data seed {seed}: expected a non-negative integer")
        if not isinstance(datasets, Mapping):
            datasets = {"train": datasets}
        self.names = list(datasets)
        self.datasets = [datasets[n] for n in self.names]
        self.mixture = mixture or Mixture.single(self.names[0])
        if self.mixture.names != self.names:
            raise ValueError(f"mixture sources {self.mixture.names} differ from the datasets {self.names}")
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.orders = [SampleOrder(len(ds), seed, stream_of(name)) for name, ds in zip(self.names, self.datasets)]
        self.position = 0
        self.cursors = [0] * len(self.names)
        self.steps = 0  # steps handed out (the step index when the caller does not give one)
        self.prefetch = prefetch
        self.vocab_size = vocab_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self._pool: cf.ThreadPoolExecutor | None = None  # started on first use, again after close()
        self._pending: tuple[_Plan, cf.Future] | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def epoch(self) -> float:
        """Fractional passes over all sources' samples so far (for logging)."""
        return self.position / sum(o.num_samples for o in self.orders)

    def tokens_by_source(self, seq_len: int) -> dict[str, int]:
        """Input tokens drawn from each source so far, all ranks (a source's cursor times seq_len)."""
        return {name: cursor * seq_len for name, cursor in zip(self.names, self.cursors)}

    # ------------------------------------------------------------------ planning (pure) and building

    def _plan(self, position: int, cursors: Sequence[int], step: int) -> _Plan:
        mb, ws, ga = self.micro_batch_size, self.world_size, self.grad_accum_steps
        src = self.mixture.sources(self.seed, position, self.global_batch, step)
        idx = np.empty_like(src)
        after = list(cursors)
        for k in np.unique(src).tolist():
            rows = src == k
            idx[rows] = self.orders[k].indices(after[k], int(rows.sum()))
            after[k] += int(rows.sum())
        mine = [slice((m * ws + self.rank) * mb, (m * ws + self.rank + 1) * mb) for m in range(ga)]
        return _Plan((position, tuple(cursors), step), np.stack([src[s] for s in mine]), np.stack([idx[s] for s in mine]),
                     tuple(position + s.start for s in mine), tuple(after))

    def _build(self, plan: _Plan) -> list[dict[str, torch.Tensor]]:
        batches = []
        for sources, samples, first in zip(plan.sources, plan.samples, plan.first_positions):
            items = [self.datasets[k][int(i)] for k, i in zip(sources.tolist(), samples.tolist())]
            batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
            batch["order_position"] = torch.arange(first, first + self.micro_batch_size)
            batch["source"] = torch.from_numpy(sources.copy())
            _check_batch(batch, self.vocab_size, lambda: self._where(batch))
            batches.append(slice_sequences(batch, self.cp_rank, self.cp_size))
        return batches

    def _where(self, batch: dict[str, torch.Tensor]) -> str:
        """The source of a micro-batch's first row holding an id beyond the vocabulary, with its shard dirs."""
        largest = torch.maximum(batch["input_ids"].max(dim=1).values, batch["labels"].max(dim=1).values)
        k = int(batch["source"][int(largest.argmax())])
        dataset = self.datasets[k]
        return f"source {self.names[k]!r}" + (f" ({dataset.where})" if hasattr(dataset, "where") else "")

    def next_step(self, step: int | None = None) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the step ``step`` (its phase decides the mixture); advances the state."""
        step = self.steps if step is None else step
        pending, self._pending = self._pending, None
        if pending is not None and pending[0].key == (self.position, tuple(self.cursors), step):
            plan, batches = pending[0], pending[1].result()
        else:  # no prefetch, or a stale one (a rollback or resume moved the state)
            plan = self._plan(self.position, self.cursors, step)
            batches = self._build(plan)
        self.position += self.global_batch
        self.cursors = list(plan.cursors)
        self.steps = step + 1
        if self.prefetch:  # the next step, built while the model trains on this one
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="treadle-prefetch")
            upcoming = self._plan(self.position, self.cursors, step + 1)
            self._pending = (upcoming, self._pool.submit(self._build, upcoming))
        return batches

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        while True:
            yield self.next_step()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._pending = None, None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        # Sample counts are recorded so a resume against different data (another
        # seq_len, more shards) fails loudly instead of silently reshuffling.
        return {"position": self.position, "seed": self.seed,
                "sources": {n: {"cursor": c, "num_samples": o.num_samples}
                            for n, c, o in zip(self.names, self.cursors, self.orders)}}

    def load_state_dict(self, state: dict) -> None:
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise UserError(f"loader state: position {position!r} is not a non-negative integer")
        if state.get("seed") != self.seed:
            raise UserError(
                f"loader state: checkpoint data seed {state.get('seed')!r} differs from the configured seed "
                f"{self.seed}; resuming would change the sample order; accepted: the checkpoint's seed to continue, or "
                "a new train.output_dir"
            )
        saved = state.get("sources")
        if not isinstance(saved, dict) or sorted(saved) != sorted(self.names):
            raise UserError(
                f"loader state: the checkpoint's sources {sorted(saved) if isinstance(saved, dict) else saved!r} differ "
                f"from the configured ones {sorted(self.names)}; the sample order would not continue; "
                f"{_REMEDY}"
            )
        for name, order in zip(self.names, self.orders):
            n = saved[name].get("num_samples")
            if n != order.num_samples:
                raise UserError(
                    f"loader state: source {name!r} had {n} samples in the checkpoint, it has {order.num_samples} "
                    f"now (different data or seq_len); the sample order would not continue; {_REMEDY}"
                )
        self.position = position
        self.cursors = [int(saved[name]["cursor"]) for name in self.names]
        self._pending = None


def eval_batches(dataset, batch_size: int, max_batches: int | None = None,
                 rank: int = 0, world_size: int = 1, vocab_size: int | None = None,
                 cp_rank: int = 0, cp_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Sequential (unshuffled) evaluation batches: samples 0, 1, ... split across ranks.

    The evaluation covers the first ``max_batches * batch_size`` samples (all of them
    when None) whatever the number of ranks, so eval loss does not depend on it.
    Global batch ``b`` covers samples ``[b * batch_size * world_size, ...)``;
    rank ``r`` takes its ``batch_size`` slice. Every rank yields the same
    number of equally shaped batches (collectives in the eval loop must match):
    slots past the covered samples are filled with sample 0 and labels of
    -100, so they count for nothing. Token ids are checked against ``vocab_size`` as in ``StepLoader``.
    ``rank`` / ``world_size`` are data-parallel; ``cp_rank`` / ``cp_size`` slice every sequence as there.
    """
    if batch_size < 1:
        raise UserError(f"eval batch_size {batch_size}: expected a positive integer")
    n = len(dataset) if max_batches is None else min(len(dataset), max_batches * batch_size)
    per_global = batch_size * world_size
    num_batches = math.ceil(n / per_global)
    for b in range(num_batches):
        lo = b * per_global + rank * batch_size
        idx = [i for i in range(lo, lo + batch_size) if i < n]
        pad = batch_size - len(idx)
        batch = _collate(dataset, idx + [0] * pad)
        if pad:
            batch["labels"][batch_size - pad :] = IGNORE_INDEX
        _check_batch(batch, vocab_size, lambda: f"the evaluation data ({getattr(dataset, 'where', 'data.val')})")
        yield slice_sequences(batch, cp_rank, cp_size)
