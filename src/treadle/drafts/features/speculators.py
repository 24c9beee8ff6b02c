"""Speculators' offline data (hidden states written by vLLM's ``extract_hidden_states``) read as an EAGLE-3 store.

What the tools write (read in vllm-project/speculators @ c05b95b3 and vllm-project/vllm, the files named in
docs/features.md)::

    DIR/                            scripts/prepare_data.py --output: ``datasets.Dataset.save_to_disk``
      state.json  dataset_info.json  data-*.arrow     columns input_ids [T] int64, loss_mask [T] int64 (0/1), seq_len
      token_freq.pt  d2t.npy  t2d.npy                 (pickles / vocabulary maps: never read here)
      hidden_states/hs_{i}.safetensors                scripts/data_generation_offline.py: the file vLLM's
                                                      ExampleHiddenStatesConnector wrote for row i, moved and renamed
          hidden_states [T, n, d]   the model's dtype (bf16 / fp16 / fp32); slot j is the j-th captured layer in
                                    forward order (vLLM appends them as its decoder loop reaches them, so in increasing
                                    layer order whatever order the ids were given in); vLLM's layer id k is Hugging
                                    Face's ``output_hidden_states`` index k, and speculators' launch_vllm.py appends
                                    id N (num_hidden_layers): the last decoder layer's output BEFORE the final norm
          token_ids [T] int64       the prompt vLLM ran; speculators' trainer drops a sample whose token_ids are not
                                    exactly row i's input_ids

Rows without a file (a request that failed and was skipped, ``--max-samples``) have no sample here; the manifest
counts them. The files do not say which layers they hold: the caller's ``feature_layers`` (Hugging Face indices,
strictly increasing) are taken to be the first n - 1 slots, and the last slot layer N before the norm, as
speculators' trainer takes them (src/speculators/train/data.py).

How a sample maps to treadle's (one conversation per sample, like data/packed.py's ``ExampleDataset``): position t
holds token t, the target's features at t (``target.features``, the first n - 1 slots concatenated: what
``FeatureTap`` takes for ``feature_layers``) and the target's final hidden state at t (``target.hidden`` =
``final_norm(last slot)``, in fp32, so ``lm_head(target.hidden)`` is the target's prediction of token t + 1).
``labels[t]`` is token t + 1 where ``loss_mask[t]`` is 1, else -100: speculators' EAGLE-3 trainer scores the draft
row whose teacher is the target at position t exactly when loss_mask[t] is 1 (models/eagle3/data.py ``shift_batch``
keeps l_{t} beside the teacher y_{t}; metrics.py ``align_for_step`` moves the mask with the teacher at every TTT
step), and treadle's unroll scores a row iff the label at its teacher's index is set (drafts/ttt.py), so the same rows
are trained. prepare_data.py sets loss_mask[t] = 1 on the assistant's tokens, so this is one position earlier than
treadle's own SFT masks (labels[t] set where token t + 1 is the assistant's): the first answer token is not a target
and the token after the answer's last one is. The last position of a conversation has no next token and takes no
label (speculators scores its KL against the teacher there; treadle cannot).

A conversation of more than ``seq_len + 1`` tokens is truncated to its first ``seq_len + 1`` (``seq_len`` positions);
one that leaves no label is dropped; a shorter one is padded: ``pad_id`` inputs, -100 labels, zero features and
hidden states, and position ids that count again from 0 (padding is a segment of its own, as in ``ExampleDataset``).

Nothing is unpickled: the hidden states are safetensors, the dataset is Arrow (read by Hugging Face ``datasets``),
and speculators' ``token_freq.pt`` is never opened. The constructor checks every file's header, token ids and
the dataset's token ids against the vocabulary before the first sample, so a bad store is refused in one line
naming the file before anything runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from treadle.data.packed import IGNORE_INDEX
from treadle.errors import UserError, first_line

FORMAT = "speculators"
HIDDEN_DIR = "hidden_states"
_FILE = re.compile(r"hs_(0|[1-9][0-9]*)\.safetensors")  # the names speculators reads: hs_{i}, no zero padding
_FLOATS = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ACCEPTED = ("accepted: the --output directory of speculators' prepare_data.py (a Hugging Face datasets Arrow "
             "dataset with input_ids and loss_mask columns) holding data_generation_offline.py's "
             "hidden_states/hs_{i}.safetensors")
_BATCH_ROWS = 1024  # dataset rows read at once while the store is checked


def is_speculators_dir(path) -> bool:
    """Whether ``path`` looks like speculators' offline data: a datasets directory (state.json) with a
    hidden_states/ folder, or a folder holding hs_{i}.safetensors files directly or in hidden_states/ (so that a
    store missing its dataset, or the hidden_states folder itself, reaches ``SpeculatorsSamples`` and is refused
    there with the reason). Reads no file."""
    path = Path(path)
    if (path / "state.json").is_file() and (path / HIDDEN_DIR).is_dir():
        return True
    return _holds_hs_file(path / HIDDEN_DIR) or _holds_hs_file(path)


def _holds_hs_file(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(_FILE.fullmatch(e.name) for e in entries)
    except OSError:
        return False


class SpeculatorsSamples(torch.utils.data.Dataset):
    """EAGLE-3 training samples from speculators' offline data (see the module docstring).

    ``path``: the prepare_data.py output directory; ``hidden_states``: where the hs_{i} files are when not in
    ``path/hidden_states`` (speculators' ``--hidden-states-path``). ``feature_layers``: the draft's Hugging Face
    ``output_hidden_states`` indices, strictly increasing, which the files' first n - 1 slots must hold.
    ``final_norm``: the target's final norm (copied to fp32 on the CPU). ``vocab_size``: the target's.

    Item i: ``input_ids``, ``labels``, ``position_ids`` [seq_len] int64, ``target.features``
    [seq_len, len(feature_layers) * d] and ``target.hidden`` [seq_len, d] float32.
    """

    def __init__(self, path: Path, seq_len: int, feature_layers: tuple[int, ...], final_norm: torch.nn.Module,
                 vocab_size: int, *, hidden_states: Path | None = None, pad_id: int = 0):
        self.path = Path(path)
        self.hidden_dir = Path(hidden_states) if hidden_states is not None else self.path / HIDDEN_DIR
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len {seq_len!r}: expected a positive integer")
        layers = tuple(int(i) for i in feature_layers)
        if not layers or any(i < 0 for i in layers) or any(a >= b for a, b in zip(layers, layers[1:])):
            raise UserError(f"feature_layers = {list(layers)} for speculators' data {self.path}: accepted: strictly "
                            "increasing output_hidden_states indices (vLLM stores the captured layers in forward "
                            "order, so only increasing indices name its slots)")
        weight = getattr(final_norm, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError("final_norm: the target's final norm module (with a weight) expected")
        self.seq_len, self.layers, self.vocab_size, self.pad_id = seq_len, layers, int(vocab_size), int(pad_id)
        self.hidden_size = int(weight.shape[-1])
        # The teacher's input: the norm in fp32 whatever the target's dtype, on the CPU where loaders run.
        self._norm = copy.deepcopy(final_norm).to(device="cpu", dtype=torch.float32).eval().requires_grad_(False)
        self._data = _open_dataset(self.path)
        files = _hs_files(self.hidden_dir, len(self._data), self.path)
        self._check(files)

    # ------------------------------------------------------------------------------------------- checking the store

    def _check(self, files: dict[int, Path]) -> None:
        """Every row that has a file: its header, its token ids against the row's, the row's ids against the
        vocabulary; then which rows give a sample, and the manifest."""
        L, k = self.seq_len, len(self.layers)
        rows, lengths, targets, counts = [], [], [], np.zeros(self.vocab_size, dtype=np.int64)
        truncated = dropped = tokens = size = 0
        dtype = None
        for row, ids, mask in self._rows(sorted(files)):
            file = files[row]
            T, file_dtype = self._check_file(file, row, ids)
            if dtype is None:
                dtype, first = file_dtype, file
            elif file_dtype != dtype:
                raise UserError(f"{file}: hidden states in {_FLOATS[file_dtype]} but {first} holds {_FLOATS[dtype]}; "
                                "accepted: one store's files from one vLLM run (one dtype)")
            n = min(T - 1, L)  # positions with a next token in the window
            labelled = mask[:n] != 0
            if n < 1 or not labelled.any():
                dropped += 1
                continue
            truncated += T - 1 > L
            rows.append(row)
            lengths.append(n)
            targets.append(ids[1 : n + 1][labelled])
            if len(targets) == _BATCH_ROWS:  # one count per batch: a vocabulary-wide array per row adds up
                counts += np.bincount(np.concatenate(targets), minlength=self.vocab_size)
                targets.clear()
            tokens += T
            size += file.stat().st_size
        if targets:
            counts += np.bincount(np.concatenate(targets), minlength=self.vocab_size)
        if not rows:
            raise UserError(f"{self.path}: no sample ({len(files)} hidden-state files, {dropped} without a loss token "
                            f"in their first {L + 1} tokens); {_ACCEPTED}, with at least one row whose loss_mask is "
                            "set within seq_len")
        self._rows_kept = np.array(rows, dtype=np.int64)
        self._lengths = np.array(lengths, dtype=np.int64)
        self._counts = counts
        self.manifest = {
            "format": FORMAT, "path": str(self.path), "hidden_states": str(self.hidden_dir),
            "dataset_fingerprint": _fingerprint(self.path),
            "rows": len(self._data), "rows_without_hidden_states": len(self._data) - len(files),
            "num_samples": len(rows), "dropped": dropped, "truncated": truncated, "seq_len": L,
            "hidden_size": self.hidden_size, "num_layers_stored": k + 1, "feature_layers": list(self.layers),
            "last_slot": "the last decoder layer's output before the final norm (not recorded in the files)",
            "dtype": _FLOATS[dtype], "tokens": tokens, "bytes": size,
        }

    def _rows(self, wanted: list[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(row, input_ids, loss_mask) of the ``wanted`` rows (increasing), read a batch of rows at a time, each
        checked: equal lengths, ids inside the vocabulary."""
        for at in range(0, len(wanted), _BATCH_ROWS):
            chunk = wanted[at : at + _BATCH_ROWS]
            batch = self._data[chunk]
            for row, ids, mask in zip(chunk, batch["input_ids"], batch["loss_mask"]):
                ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask)
                self._check_row(row, ids, mask)
                yield row, ids, mask

    def _check_row(self, row: int, ids: np.ndarray, mask: np.ndarray) -> None:
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise UserError(f"{self.path}: row {row} has {ids.size} input_ids but {mask.size} loss_mask entries; "
                            f"{_ACCEPTED}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise UserError(f"{self.path}: row {row} (hidden states {self.hidden_dir / f'hs_{row}.safetensors'}) "
                            f"holds token id {int(ids[bad][0])}, outside the target's vocabulary of "
                            f"{self.vocab_size}; accepted: data tokenized by this target's tokenizer")

    def _check_file(self, file: Path, row: int, ids: np.ndarray) -> tuple[int, torch.dtype]:
        """(tokens, dtype) of one hs file, its header and token ids checked against row ``row``."""
        with _opened(file) as f:
            keys = set(f.keys())
            if not {"hidden_states", "token_ids"} <= keys:
                raise UserError(f"{file}: holds {sorted(keys)}; accepted: a file of vLLM's "
                                "ExampleHiddenStatesConnector (hidden_states [T, n, d] and token_ids [T])")
            hs = f.get_slice("hidden_states")
            shape, stored = tuple(hs.get_shape()), hs.get_dtype()
            tok = _read(file, lambda: f.get_tensor("token_ids"))
        want, dtype = len(self.layers) + 1, _DTYPES.get(stored)
        if dtype is None or len(shape) != 3:
            raise UserError(f"{file}: hidden_states is {stored} {list(shape)}; accepted: [T, n, d] in "
                            "bfloat16, float16 or float32, as vLLM writes it")
        if shape[1] != want:
            raise UserError(f"{file}: stores {shape[1]} hidden states per token but feature_layers = "
                            f"{list(self.layers)} needs {want} (those layers, then the last decoder layer's output); "
                            "accepted: data generated with these feature layers (speculators' launch_vllm.py "
                            "--target-layer-ids with the last layer appended)")
        if shape[2] != self.hidden_size:
            raise UserError(f"{file}: hidden states of width {shape[2]} but the target's hidden size is "
                            f"{self.hidden_size}; accepted: hidden states of this target")
        if tok.dtype.is_floating_point or tok.dtype == torch.bool or tok.dim() != 1 or tok.numel() != shape[0]:
            raise UserError(f"{file}: token_ids {tok.dtype} {list(tok.shape)} do not match hidden_states "
                            f"{list(shape)}; accepted: integer token ids [T], one per hidden state")
        got = tok.to(torch.int64).numpy()
        if got.shape != ids.shape or not np.array_equal(got, ids):
            differ = np.flatnonzero(got[: min(got.size, ids.size)] != ids[: min(got.size, ids.size)])
            at = int(differ[0]) if differ.size else min(got.size, ids.size)
            raise UserError(f"{file}: its token_ids ({got.size} tokens) differ from row {row}'s input_ids in "
                            f"{self.path} ({ids.size} tokens) from token {at} on; accepted: hidden states vLLM "
                            f"computed for exactly row {row}'s input_ids (speculators' trainer drops such a sample)")
        return shape[0], dtype

    # ------------------------------------------------------------------------------------------------- the samples

    def __len__(self) -> int:
        return len(self._rows_kept)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] occurrences of each token id among the labels (what an eagle3 run's reduced vocabulary is
        chosen from, as ``ExampleDataset.token_counts`` gives for shards)."""
        out = np.zeros(vocab_size, dtype=np.int64)
        n = min(vocab_size, self._counts.size)
        out[:n] = self._counts[:n]
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        row, n, L = int(self._rows_kept[i]), int(self._lengths[i]), self.seq_len
        file = self.hidden_dir / f"hs_{row}.safetensors"
        item = self._data[row]
        ids = np.asarray(item["input_ids"], dtype=np.int64)[: n + 1]
        mask = np.asarray(item["loss_mask"])[:n] != 0
        with _opened(file) as f:  # only the window's rows are read from disk
            hs = _read(file, lambda: f.get_slice("hidden_states")[:n])
            tok = _read(file, lambda: f.get_slice("token_ids")[: n + 1])
        if hs.shape != (n, len(self.layers) + 1, self.hidden_size) or not np.array_equal(tok.long().numpy(), ids):
            raise UserError(f"{file}: changed since the store was opened (it no longer matches row {row} of "
                            f"{self.path}); accepted: a store left as it was while a run reads it")
        input_ids = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.arange(L, dtype=np.int64)
        input_ids[:n] = ids[:n]
        labels[:n] = np.where(mask, ids[1:], IGNORE_INDEX)
        position_ids[n:] = np.arange(L - n)  # padding is a segment of its own
        features = torch.zeros(L, len(self.layers) * self.hidden_size)
        hidden = torch.zeros(L, self.hidden_size)
        features[:n] = hs[:, :-1].reshape(n, -1).float()
        with torch.no_grad():
            hidden[:n] = self._norm(hs[:, -1].float())
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(position_ids), "target.features": features, "target.hidden": hidden}


# ----------------------------------------------------------------------------------------------------- reading files

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _open_dataset(path: Path):
    """The Arrow dataset of prepare_data.py, as numpy rows of input_ids and loss_mask."""
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; {_ACCEPTED}")
    if not (path / "state.json").is_file():
        inside = " (this looks like the hidden_states folder itself: give its parent)" if _holds_hs_file(path) else ""
        raise UserError(f"{path}: no Arrow dataset (state.json, dataset_info.json, data-*.arrow: what "
                        f"Dataset.save_to_disk writes){inside}; {_ACCEPTED}")
    import datasets

    from treadle.quiet import hf_quiet

    try:
        with hf_quiet():
            data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: cannot be read as a datasets Arrow directory ({first_line(exc)}); "
                        f"{_ACCEPTED}") from None
    if not isinstance(data, datasets.Dataset):
        raise UserError(f"{path}: holds a DatasetDict ({', '.join(data)}), not one dataset; {_ACCEPTED}")
    missing = {"input_ids", "loss_mask"} - set(data.column_names)
    if missing:
        raise UserError(f"{path}: the dataset has columns {data.column_names}, not {sorted(missing)}; {_ACCEPTED}")
    return data.with_format("numpy", columns=["input_ids", "loss_mask"])


def _hs_files(folder: Path, rows: int, path: Path) -> dict[int, Path]:
    """{row: file} of the hs_{row}.safetensors files in ``folder``."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries]
    except OSError as exc:
        raise UserError(f"{folder}: cannot be listed ({exc.strerror or first_line(exc)}); accepted: the "
                        "hidden_states folder data_generation_offline.py wrote") from None
    files = {int(m.group(1)): folder / name for name in names if (m := _FILE.fullmatch(name))}
    beyond = sorted(r for r in files if r >= rows)
    if beyond:
        raise UserError(f"{files[beyond[0]]}: row {beyond[0]} but the dataset {path} has {rows} rows; accepted: "
                        "hidden states generated from this dataset")
    if not files:
        raise UserError(f"{folder}: no hs_{{i}}.safetensors file; {_ACCEPTED}")
    return files


class _opened:
    """``safe_open`` of one file, whose failure (a torn, truncated or foreign file) is one line naming it."""

    def __init__(self, file: Path):
        self.file = file

    def __enter__(self):
        from safetensors import safe_open

        try:
            self._handle = safe_open(str(self.file), framework="pt", device="cpu")
            return self._handle.__enter__()
        except Exception as exc:
            raise _damaged(self.file, exc) from None

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


def _read(file: Path, read):
    try:
        return read()
    except UserError:
        raise
    except Exception as exc:
        raise _damaged(file, exc) from None


def _damaged(file: Path, exc: BaseException) -> UserError:
    return UserError(f"{file}: not a readable safetensors file ({first_line(exc)}): torn or damaged; accepted: the "
                     "file as vLLM wrote it (generate that row again: data_generation_offline.py redoes missing "
                     "files)")


def _fingerprint(path: Path) -> str | None:
    """The dataset's ``_fingerprint`` in state.json (datasets' hash of how it was made), or None."""
    try:
        return json.loads((path / "state.json").read_text()).get("_fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
