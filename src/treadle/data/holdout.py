"""A validation set held out of the training data (``data.val_fraction``).

Which documents are held out depends only on the number of documents in a source and the
fraction: the ``round(fraction * n)`` documents (at least one) whose index has the smallest
hash. So the split is the same in every process, at any world size, after any resume and
under any ``train.seed`` (runs with different seeds are compared on the same validation
set), and held-out documents are spread over the whole source rather than taken from
its end, which may be sorted by date or topic. Training never sees a held-out document.

The validation set of a run with several sources interleaves their held-out parts (see
``Interleaved``), so the first ``train.eval_batches`` batches sample every source in
proportion to its held-out size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from treadle.errors import UserError


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection on uint64 that scatters consecutive indices uniformly."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def held_out(num_documents: int, fraction: float, where: str) -> np.ndarray:
    """Boolean mask over a source's documents: True for the ones held out for validation."""
    count = max(1, round(fraction * num_documents))
    if count >= num_documents:
        raise UserError(f"data.val_fraction = {fraction} would hold out {count} of the {num_documents} document(s) of "
                        f"{where}, leaving none to train on; accepted: a smaller fraction, a source with more "
                        "documents (rows), or a validation set of its own (data.val = a file, or [] for none)")
    keys = _mix64(np.arange(num_documents, dtype=np.uint64))
    return keys <= np.partition(keys, count - 1)[count - 1]  # distinct keys (a bijection): exactly `count`


class Interleaved(torch.utils.data.Dataset):
    """Several sources' held-out datasets as one, their samples interleaved evenly.

    Sample ``j`` of a part of ``n`` samples sits at fraction ``(j + 0.5) / n`` of the whole; sorted by that
    (ties by part), any prefix holds every part in proportion to its size.
    """

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        first = self.parts[0]
        self.seq_len = first.seq_len
        self.tokenizer_fingerprint = first.tokenizer_fingerprint
        self.shards = [s for p in self.parts for s in p.shards]
        keys = np.concatenate([(np.arange(len(p)) + 0.5) / len(p) for p in self.parts])
        owner = np.concatenate([np.full(len(p), k) for k, p in enumerate(self.parts)])
        index = np.concatenate([np.arange(len(p)) for p in self.parts])
        order = np.lexsort((owner, keys))
        self._owner, self._index = owner[order], index[order]

    @property
    def where(self) -> str:
        return "; ".join(p.where for p in self.parts)

    def __len__(self) -> int:
        return len(self._owner)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.parts[int(self._owner[i])][int(self._index[i])]
