"""Training samples from shard directories: packed windows (pre-training) and packed examples (SFT).

Both give samples of exactly ``seq_len`` positions: ``input_ids``, ``labels``
(the next token, or -100 where no loss is taken) and ``position_ids``, which
restart at 0 where a document or example starts. Hugging Face models read a
restart of ``position_ids`` (with no attention mask) as the start of a new packed
sequence and keep attention inside it, so packed documents never see each other.

Either may hold a subset of the shards' documents (``documents``: the number of
documents -> a mask of those kept; ``data.val_fraction`` splits training and
held-out documents this way): the kept documents then form the token stream, in order.

``PackedDataset`` (pre-training): the shards are one long token stream; sample
``i`` is the window ``[i*L, i*L + L + 1)`` (L = seq_len): ``L`` inputs and the
``L`` next tokens as labels, so neighbouring samples share exactly one token and
no token is ever an unpredicted input. With ``mask_cross_doc`` a label that
belongs to the next document is replaced by -100: predicting one document from
another is noise.

``ExampleDataset`` (SFT): an example is never cut across samples. Whole examples
are packed in order into samples (next fit), the rest of a sample is padding with
labels -100. Only tokens marked in the shard's loss mask (assistant / completion
tokens) carry loss. An example longer than ``L + 1`` tokens follows the
``overlong`` policy: ``truncate`` keeps its first ``L + 1`` tokens (and drops it
if no loss token is left), ``drop`` drops it; both are counted in ``stats``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from treadle.data.shards import Shard
from treadle.errors import UserError
from treadle.models.upcast import at_least_fp32

IGNORE_INDEX = -100


def row_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits, [B, L] labels -> [B] summed CE (fp32 softmax: under bf16 autocast logits are bf16)."""
    ce = F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return ce.view(labels.shape).sum(-1)


class _ShardSet(torch.utils.data.Dataset):
    """One or more shard directories of one tokenizer, addressed as one global token stream."""

    def __init__(self, shard_dirs: Sequence[Path] | Path | str, seq_len: int,
                 documents: Callable[[int], np.ndarray] | None = None, part: str = ""):
        if isinstance(shard_dirs, (str, Path)):
            shard_dirs = [shard_dirs]
        if not shard_dirs:
            raise UserError("dataset: no shard directories given")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len {seq_len!r}: expected a positive integer")
        self.seq_len = seq_len
        self.shards = [Shard(Path(d)) for d in shard_dirs]
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
        self.pad_id = int(first.meta["eos_id"]) if first.meta.get("eos_id") is not None else 0

        # Global coordinates: shard k's tokens start at shard_starts[k]; every
        # shard's document starts, shifted, form one sorted array. Each shard's
        # offsets begin at 0, so a shard boundary is always a document boundary.
        sizes = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._shard_starts[-1])
        self._doc_starts = np.concatenate(
            [s.offsets[:-1] + start for s, start in zip(self.shards, self._shard_starts[:-1])]
        ).astype(np.int64)
        self._has_mask = any(s.has_loss_mask for s in self.shards)
        self.part = part  # which of the documents, for messages ("" = all)
        self._pieces: tuple[np.ndarray, np.ndarray] | None = None
        if documents is not None:
            self._keep_documents(np.asarray(documents(self._doc_starts.size), dtype=bool))

    def _keep_documents(self, keep: np.ndarray) -> None:
        """From here on the stream is the kept documents only, back to back: ``_read`` and ``_doc_starts`` speak
        its coordinates. Runs of consecutive kept documents are read as one piece of the shards' stream."""
        if keep.shape != self._doc_starts.shape:
            raise ValueError(f"documents: a mask of {self._doc_starts.size} documents expected, got {keep.shape}")
        starts = self._doc_starts[keep]
        lengths = (np.append(self._doc_starts[1:], self.num_tokens) - self._doc_starts)[keep]
        virtual = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        new_piece = np.ones(starts.size, dtype=bool)
        new_piece[1:] = starts[1:] != starts[:-1] + lengths[:-1]
        first = np.flatnonzero(new_piece)
        self._pieces = (np.append(virtual[first], virtual[-1]), starts[first])  # (stream starts + end, shard-stream starts)
        self._doc_starts = virtual[:-1]
        self.num_tokens = int(virtual[-1])

    @property
    def where(self) -> str:
        """The shard directories (and which of their documents), for messages."""
        dirs = f"shard director{'y' if len(self.shards) == 1 else 'ies'} {', '.join(str(s.path) for s in self.shards)}"
        return f"{dirs} ({self.part})" if self.part else dirs

    def token_counts(self, vocab_size: int, chunk: int = 1 << 22) -> np.ndarray:
        """[vocab_size] occurrences of each token id among the tokens that take loss (all, without a loss mask)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, self.num_tokens, chunk):
            stop = min(start + chunk, self.num_tokens)
            tokens = self._read(start, stop)
            weights = self._read(start, stop, mask=True) if self._has_mask else None
            counts += np.bincount(tokens, weights=weights, minlength=vocab_size)[:vocab_size].astype(np.int64)
        return counts

    def _read(self, start: int, stop: int, mask: bool = False) -> np.ndarray:
        """Tokens [start, stop) of the dataset's stream as int64 (with ``mask``: their loss mask)."""
        if self._pieces is None:
            return self._read_shards(start, stop, mask)
        piece_starts, shard_starts = self._pieces
        k = int(np.searchsorted(piece_starts, start, side="right")) - 1
        parts = []
        while start < stop:
            hi = min(stop, int(piece_starts[k + 1]))
            if hi > start:
                at = int(shard_starts[k]) + start - int(piece_starts[k])
                parts.append(self._read_shards(at, at + hi - start, mask))
                start = hi
            k += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _read_shards(self, start: int, stop: int, mask: bool = False) -> np.ndarray:
        """Tokens [start, stop) of all shards' stream as int64 (with ``mask``: their loss mask), stitched across shards."""
        first = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        parts, k = [], first
        while start < stop:
            lo = int(self._shard_starts[k])
            hi = min(stop, int(self._shard_starts[k + 1]))
            if hi > start:
                shard = self.shards[k]
                if not mask:
                    parts.append(shard.tokens[start - lo : hi - lo])
                else:  # a shard without a mask (plain text) takes loss on every token
                    m = shard.loss_mask
                    parts.append(m[start - lo : hi - lo] if m is not None else np.ones(hi - start, dtype=np.uint8))
                start = hi
            k += 1
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)


class PackedDataset(_ShardSet):
    """Fixed-length windows over the concatenated token stream of one or more shard directories."""

    def __init__(self, shard_dirs: Sequence[Path] | Path | str, seq_len: int, mask_cross_doc: bool = True,
                 documents: Callable[[int], np.ndarray] | None = None, part: str = ""):
        super().__init__(shard_dirs, seq_len, documents, part)
        self.mask_cross_doc = mask_cross_doc
        self._len = (self.num_tokens - 1) // seq_len if self.num_tokens > 0 else 0
        if self._len < 1:
            raise UserError(
                f"{self.where}: {self.num_tokens} tokens, too few for one sample of seq_len={seq_len} "
                f"(needs at least {seq_len + 1})"
            )

    def __len__(self) -> int:
        return self._len

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
        if self._has_mask:
            labels[self._read(start + 1, start + L + 1, mask=True) == 0] = IGNORE_INDEX
        return {
            "input_ids": torch.from_numpy(window[:-1].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
        }


class ExampleDataset(_ShardSet):
    """Whole examples (documents) packed into ``seq_len`` samples; loss only where the loss mask says."""

    def __init__(self, shard_dirs: Sequence[Path] | Path | str, seq_len: int, overlong: str = "truncate",
                 documents: Callable[[int], np.ndarray] | None = None, part: str = ""):
        super().__init__(shard_dirs, seq_len, documents, part)
        if overlong not in ("truncate", "drop"):
            raise UserError(f"data.overlong = {overlong!r}; accepted: 'truncate' or 'drop'")
        L = seq_len
        ends = np.append(self._doc_starts[1:], self.num_tokens)
        positions = ends - self._doc_starts - 1  # an example of n tokens gives n - 1 (input, label) pairs
        over = np.flatnonzero(positions > L)
        keep = positions > 0
        truncated = 0
        if overlong == "drop":
            keep[over] = False
        else:
            for d in over:  # cut to L positions; an example with no loss token left says nothing
                s = int(self._doc_starts[d])
                if self._read(s + 1, s + 1 + L, mask=True).any():
                    truncated += 1
                else:
                    keep[d] = False
        self._examples = np.flatnonzero(keep)
        self._lengths = np.minimum(positions[self._examples], L)
        self.stats = {"examples": int(keep.sum()), "truncated": truncated, "dropped": int((~keep & (positions > 0)).sum())}
        if self._examples.size == 0:
            raise UserError(f"{self.where}: no example fits "
                            f"seq_len={L} with data.overlong = {overlong!r} ({self.stats['dropped']} dropped)")
        # Next fit, in data order: deterministic, and cheap to recompute for any seq_len.
        bins, used = [0], 0
        for j, n in enumerate(self._lengths.tolist()):
            if used + n > L:
                bins.append(j)
                used = 0
            used += n
        self._bins = np.array(bins + [len(self._lengths)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._bins) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        L = self.seq_len
        input_ids = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros(L, dtype=np.int64)
        at = 0
        for j in range(int(self._bins[i]), int(self._bins[i + 1])):
            start, n = int(self._doc_starts[self._examples[j]]), int(self._lengths[j])
            tokens = self._read(start, start + n + 1)
            target = self._read(start + 1, start + n + 1, mask=True).astype(bool)
            input_ids[at : at + n] = tokens[:-1]
            labels[at : at + n] = np.where(target, tokens[1:], IGNORE_INDEX)
            position_ids[at : at + n] = np.arange(n)
            at += n
        position_ids[at:] = np.arange(L - at)  # padding is a segment of its own
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(position_ids)}
