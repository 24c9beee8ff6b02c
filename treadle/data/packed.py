"""Packed pre-training samples and the one global sample order.

Packing: the shard directories (see ``treadle.data.prepare``) are one long
token stream. Sample ``i`` is the window ``[i*L, i*L + L + 1)`` (L = seq_len):
``L`` inputs and the ``L`` next tokens as labels, so neighbouring samples
share exactly one token and no token is ever an unpredicted input. Documents
are not padded; instead ``position_ids`` restart at 0 where a document starts
(HF models then keep attention inside a document, with ``use_cache=False``),
and with ``mask_cross_doc`` a label that belongs to the next document is
replaced by -100 so the loss never asks the model to predict one document from
another.

Order: ``SampleOrder`` defines an infinite sequence of sample indices, epoch
after epoch, each epoch a seeded permutation. Training state is a single
integer: the position in that sequence. Every rank computes the same sequence
and takes its own slice of each step, so

* resuming is O(1) (no replay of the loader),
* the samples of step ``s`` do not depend on the world size: a run resumed on
  a different number of ranks sees exactly the data it would have seen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from treadle.errors import UserError

IGNORE_INDEX = -100
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class _Shard:
    """One validated shard directory. Its tokens are memory-mapped lazily (cheap to pickle)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"shard directory {self.path}: does not exist (expected the --out of `treadle prepare`)")
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise UserError(f"{meta_file}: missing (expected a shard directory written by `treadle prepare`)")
        try:
            meta = json.loads(meta_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{meta_file}: not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise UserError(f"{meta_file}: expected a JSON object")
        for key in ("dtype", "num_tokens", "vocab_size", "tokenizer_fingerprint"):
            if key not in meta:
                raise UserError(f"{meta_file}: missing key {key!r}")
        if meta["dtype"] not in _DTYPES:
            raise UserError(f"{meta_file}: dtype {meta['dtype']!r} is not one of {', '.join(_DTYPES)}")
        self.meta = meta
        self.dtype = np.dtype(_DTYPES[meta["dtype"]])
        self.num_tokens = int(meta["num_tokens"])

        tokens_file = self.path / "tokens.bin"
        if not tokens_file.is_file():
            raise UserError(f"{tokens_file}: missing (expected {self.num_tokens} {self.dtype.name} tokens)")
        expected = self.num_tokens * self.dtype.itemsize
        actual = tokens_file.stat().st_size
        if actual != expected:
            raise UserError(
                f"{tokens_file}: {actual} bytes, expected {expected} "
                f"({self.num_tokens} {self.dtype.name} tokens per meta.json); the shard is truncated or stale"
            )

        offsets_file = self.path / "offsets.npy"
        if not offsets_file.is_file():
            raise UserError(f"{offsets_file}: missing (expected int64 document offsets)")
        try:
            offsets = np.load(offsets_file, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise UserError(f"{offsets_file}: not a readable .npy array ({e})") from None
        n_docs = meta.get("num_documents")
        if (
            offsets.ndim != 1
            or offsets.size < 1
            or not np.issubdtype(offsets.dtype, np.integer)
            or offsets[0] != 0
            or offsets[-1] != self.num_tokens
            or np.any(np.diff(offsets) < 0)
            or (n_docs is not None and offsets.size != n_docs + 1)
        ):
            raise UserError(
                f"{offsets_file}: expected non-decreasing int64 offsets from 0 to num_tokens={self.num_tokens}"
                + (f" with num_documents+1={n_docs + 1} entries" if n_docs is not None else "")
            )
        self.offsets = offsets.astype(np.int64, copy=False)
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            if self.num_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)  # np.memmap refuses empty files
            else:
                self._tokens = np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self):
        # Pickling a memmap copies its whole content; re-open it on the other side instead.
        state = dict(self.__dict__)
        state["_tokens"] = None
        return state


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length windows over the concatenated token stream of one or more shard directories."""

    def __init__(self, shard_dirs: Sequence[Path] | Path | str, seq_len: int, mask_cross_doc: bool = True):
        if isinstance(shard_dirs, (str, Path)):
            shard_dirs = [shard_dirs]
        if not shard_dirs:
            raise UserError("packed dataset: no shard directories given")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len {seq_len!r}: expected a positive integer")
        self.seq_len = seq_len
        self.mask_cross_doc = mask_cross_doc
        self.shards = [_Shard(Path(d)) for d in shard_dirs]

        first = self.shards[0]
        for shard in self.shards[1:]:
            if shard.meta["tokenizer_fingerprint"] != first.meta["tokenizer_fingerprint"]:
                raise UserError(
                    f"shard directories {first.path} and {shard.path} were tokenized with different tokenizers "
                    f"(fingerprints {first.meta['tokenizer_fingerprint']} and {shard.meta['tokenizer_fingerprint']}); "
                    "all shards of a dataset must share one tokenizer"
                )
        self.meta = first.meta
        self.tokenizer_fingerprint: str = first.meta["tokenizer_fingerprint"]
        self.vocab_size = max(int(s.meta["vocab_size"]) for s in self.shards)
        self.tokenizer_dir = Path(first.meta["tokenizer_dir"]) if first.meta.get("tokenizer_dir") else None

        # Global coordinates: shard k's tokens start at shard_starts[k]; every
        # shard's document starts, shifted, form one sorted array. Each shard's
        # offsets begin at 0, so a shard boundary is always a document boundary.
        sizes = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._shard_starts[-1])
        self._doc_starts = np.concatenate(
            [s.offsets[:-1] + start for s, start in zip(self.shards, self._shard_starts[:-1])]
        ).astype(np.int64)

        self._len = (self.num_tokens - 1) // seq_len if self.num_tokens > 0 else 0
        if self._len < 1:
            raise UserError(
                f"shard directories {', '.join(str(s.path) for s in self.shards)} hold {self.num_tokens} tokens: "
                f"too few for one sample of seq_len={seq_len} (needs at least {seq_len + 1})"
            )

    def __len__(self) -> int:
        return self._len

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Global tokens [start, stop) as int64, stitched across shard boundaries."""
        first = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        parts, k = [], first
        while start < stop:
            lo = int(self._shard_starts[k])
            hi = min(stop, int(self._shard_starts[k + 1]))
            if hi > start:
                parts.append(self.shards[k].tokens[start - lo : hi - lo])
                start = hi
            k += 1
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range for {self._len} samples")
        L = self.seq_len
        start = i * L
        window = self._read(start, start + L + 1)
        t = np.arange(start, start + L + 1, dtype=np.int64)
        doc = np.searchsorted(self._doc_starts, t, side="right") - 1  # document of each window token
        position_ids = t[:-1] - self._doc_starts[doc[:-1]]
        labels = window[1:].copy()
        if self.mask_cross_doc:
            # The target is the first token of the next document: predicting it
            # from the previous document is noise, not signal.
            labels[doc[1:] != doc[:-1]] = IGNORE_INDEX
        return {
            "input_ids": torch.from_numpy(window[:-1].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
        }


class SampleOrder:
    """Position ``g`` of an infinite stream -> sample ``permutation(seed, g // N)[g % N]``.

    Each epoch is a fresh permutation seeded by (seed, epoch), so any position
    can be computed directly without replaying earlier epochs.
    """

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise UserError(f"sample order over {num_samples} samples: expected at least 1")
        if seed < 0:
            raise UserError(f"data seed {seed}: expected a non-negative integer")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        # One-entry cache: consecutive steps almost always stay in one epoch.
        if epoch != self._epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at positions [start, start + count), crossing epochs as needed."""
        out = np.empty(count, dtype=np.int64)
        filled, g = 0, start
        while filled < count:
            epoch, offset = divmod(g, self.num_samples)
            take = min(count - filled, self.num_samples - offset)
            out[filled : filled + take] = self.permutation(epoch)[offset : offset + take]
            filled += take
            g += take
        return out


def _collate(dataset, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    items = [dataset[int(i)] for i in indices]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


class StepLoader:
    """Hands out the micro-batches of one optimizer step for this rank.

    Step layout: a step consumes ``global_batch = micro_batch_size *
    grad_accum_steps * world_size`` consecutive positions of the global order,
    starting at ``position``. Micro-batch ``m`` on rank ``r`` takes positions
    ``position + (m * world_size + r) * micro_batch_size + [0, micro_batch_size)``,
    so the set of samples in a step depends only on the global batch size,
    not on how it is split into ranks and accumulation steps. Each micro-batch
    also carries ``order_position``, its rows' positions in the global order.
    """

    def __init__(self, dataset, micro_batch_size: int, grad_accum_steps: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if micro_batch_size < 1 or grad_accum_steps < 1 or world_size < 1:
            raise UserError(
                f"micro_batch_size={micro_batch_size}, grad_accum_steps={grad_accum_steps}, "
                f"world_size={world_size}: all must be positive integers"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.rank = rank
        self.world_size = world_size
        self.order = SampleOrder(len(dataset), seed)
        self.position = 0

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed so far (for logging)."""
        return self.position / self.order.num_samples

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        step = self.order.indices(self.position, self.global_batch)
        mb, ws = self.micro_batch_size, self.world_size
        batches = []
        for m in range(self.grad_accum_steps):
            lo = (m * ws + self.rank) * mb
            batch = _collate(self.dataset, step[lo : lo + mb])
            # Where these rows sit in the global order: a key for per-micro-batch randomness
            # (a draft's lag) that is the same whatever the number of ranks.
            batch["order_position"] = torch.arange(self.position + lo, self.position + lo + mb)
            batches.append(batch)
        self.position += self.global_batch
        return batches

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict:
        # num_samples is recorded so a resume against different data (another
        # seq_len, more shards) fails loudly instead of silently reshuffling.
        return {"position": self.position, "seed": self.order.seed, "num_samples": self.order.num_samples}

    def load_state_dict(self, state: dict) -> None:
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise UserError(f"loader state: position {position!r} is not a non-negative integer")
        if state.get("seed") != self.order.seed:
            raise UserError(
                f"loader state: checkpoint data seed {state.get('seed')!r} differs from the configured seed "
                f"{self.order.seed}; resuming would change the sample order (use the checkpoint's seed)"
            )
        n = state.get("num_samples")
        if n is not None and n != self.order.num_samples:
            raise UserError(
                f"loader state: checkpoint was taken on a dataset of {n} samples, this one has "
                f"{self.order.num_samples} (different data or seq_len); the sample order would not continue"
            )
        self.position = position


def eval_batches(dataset, batch_size: int, max_batches: int | None = None,
                 rank: int = 0, world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Sequential (unshuffled) evaluation batches: samples 0, 1, ... split across ranks.

    The evaluation covers the first ``max_batches * batch_size`` samples (all of them
    when None) whatever the number of ranks, so eval loss does not depend on it.
    Global batch ``b`` covers samples ``[b * batch_size * world_size, ...)``;
    rank ``r`` takes its ``batch_size`` slice. Every rank yields the same
    number of equally shaped batches (collectives in the eval loop must match):
    slots past the covered samples are filled with sample 0 and labels of
    -100, so they count for nothing.
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
        yield batch
