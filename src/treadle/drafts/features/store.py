"""A feature store on disk: what a draft reads from its frozen target, per token of the run's packed windows.

Layout of a store directory (written by ``treadle features``, train/features.py)::

    manifest.json                  format, fingerprints, per-token read shapes, splits and their shards; written
                                   first with "complete": false, last with true
    train-00000.safetensors ...    samples [j * shard_samples, ...) of the training windows
    val-00000.safetensors ...      the validation windows (eval loss), when the run has validation data
    eval.safetensors               the acceptance texts (prompts + the target's greedy continuation) and their reads

A shard holds, for its ``n`` windows of ``T`` tokens, ``input_ids`` / ``labels`` / ``position_ids`` [n, T] (int32)
and each read (``hidden``: the target's final hidden state, which its frozen head turns into the teacher's logits;
EAGLE-3's ``features``; GLIDE's ``k`` / ``v``) as [n, T, ...] in the store's dtype: fp32 (exact), bf16, or fp8 (e4m3)
with a per-token fp32 scale in ``<name>.scale`` [n, T]. Shards are safetensors (no pickle) and written whole under a
temporary name, then renamed: a shard file that exists and whose size is what its header declares is complete.

The windows are indexed as the run's dataset indexes them (the same packing, any order): the run's loader draws
them in its own order and resumes at its own position, exactly as it would with the live target.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from treadle.drafts.features.cli_args import DTYPES  # how reads are stored, named where the CLI reads them
from treadle.drafts.run_model import READS_PREFIX
from treadle.errors import UserError

FORMAT = "treadle-features"
VERSION = 1
MANIFEST = "manifest.json"
TOKEN_KEYS = ("input_ids", "labels", "position_ids")
IDS = (*TOKEN_KEYS, "texts")  # integer tensors of a shard (the rest are reads)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


# ----------------------------------------------------------------------------- encoding


def encode(name: str, x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A read [n, T, ...] as the store keeps it (fp8: per-token scaled, the scale beside it)."""
    x = x.detach().float().contiguous()
    if dtype == "fp32":
        return {name: x}
    if dtype == "bf16":
        return {name: x.to(torch.bfloat16)}
    amax = x.abs().flatten(2).amax(-1) if x.dim() > 2 else x.abs()
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    view = scale.view(*scale.shape, *([1] * (x.dim() - 2)))
    return {name: (x / view).to(torch.float8_e4m3fn), f"{name}.scale": scale}


def decode(name: str, get) -> torch.Tensor:
    """A read back in fp32 from ``get(key)`` (a shard's tensors)."""
    x = get(name)
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    scale = get(f"{name}.scale")
    return x.float() * scale.view(*scale.shape, *([1] * (x.dim() - scale.dim())))


def bytes_per_token(reads: dict[str, list[int]], dtype: str) -> int:
    """Disk bytes one token costs in a store of ``dtype`` (reads: name -> per-token shape), tokens' ids included."""
    size = {"fp32": 4, "bf16": 2, "fp8": 1}[dtype]
    total = 4 * len(TOKEN_KEYS)
    for shape in reads.values():
        total += size * int(torch.tensor(shape).prod()) + (4 if dtype == "fp8" else 0)
    return total


# ----------------------------------------------------------------------------- files


def shard_complete(path: Path) -> bool:
    """Whether ``path`` is a whole safetensors file: present, and as long as its header says (a torn write is not)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            return path.stat().st_size == 8 + length + end
    except (OSError, ValueError, struct.error, KeyError, TypeError):
        return False


def dataset_fingerprint(ds) -> str | None:
    """Which packed windows a dataset gives: its type, length, window and tokenizer, and the tokens of three windows
    (first, middle, last). Two datasets with equal fingerprints give the store's windows in the same places."""
    if ds is None:
        return None
    digest = hashlib.sha256(json.dumps([type(ds).__name__, ds.seq_len, len(ds), ds.tokenizer_fingerprint]).encode())
    for i in sorted({0, len(ds) // 2, len(ds) - 1}):
        for key, t in sorted(ds[i].items()):
            digest.update(key.encode() + t.numpy().tobytes())
    return digest.hexdigest()[:16]


def read_manifest(path: Path, key: str) -> dict:
    """The manifest of a complete store, else one line naming what is wrong and what to do."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{key} {path} is not a treadle feature store (no {MANIFEST}); accepted: a directory "
                        "written by `treadle features CONFIG --out DIR`") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{key} {file} cannot be read as a feature store manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{key} {file} is not a treadle feature store manifest (format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise UserError(f"{key} {path} is a feature store of format version {manifest.get('version')}; this "
                        f"treadle reads version {VERSION}: write it again with `treadle features`")
    if not manifest.get("complete"):
        raise UserError(f"{key} {path} is an unfinished feature store (its `treadle features` was interrupted); "
                        "run the same command again: it continues where it stopped")
    return manifest


def first_difference(want: dict, have: dict, where: str = "") -> str | None:
    """The first field (dotted name) where two fingerprint trees differ, with both values; None: equal."""
    for k in [*want, *(k for k in have if k not in want)]:  # in the fingerprints' order: the kind before its layers
        a, b = want.get(k), have.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, f"{where}{k}.")
            if found:
                return found
        elif a != b:
            return f"{where}{k}: the store's {a!r}, this run's {b!r}"
    return None


def data_differences(found: str, stored: dict, settings: dict) -> tuple[str, list[str]]:
    """``found`` (``first_difference``'s line) in the user's terms: where it is the data's windows (a hash, which says
    that they differ, not why), the data settings that cut them differently (``stored``: the store's, ``settings``:
    this run's, config key -> value), every one with both values; and those settings as the store has them."""
    if not found.startswith("data."):
        return found, []
    named = [k for k in settings if k in stored and stored[k] != settings[k]]
    if not named:
        return f"{found}: the same data settings, so the data's files changed since the store was written", []
    return ("; ".join(f"{k}: the store's {stored[k]!r}, this run's {settings[k]!r}" for k in named),
            [f"{k} = {stored[k]!r}" for k in named])


def stored_settings(manifest: dict) -> dict:
    """The data settings a store's windows were cut with (a store written before they were recorded: its seq_len)."""
    return manifest.get("settings") or {"data.seq_len": manifest.get("seq_len")}


# ----------------------------------------------------------------------------- reading


class Store:
    """An opened, complete store: its manifest, and each split's shards checked whole."""

    def __init__(self, path, key: str = "draft.features"):
        self.path, self.key = Path(path), key
        self.manifest = read_manifest(self.path, key)
        self.shard_samples = int(self.manifest["shard_samples"])
        self.reads = list(self.manifest["reads"])
        for split in self.manifest["splits"].values():
            for shard in split["shards"]:
                self._check(self.path / shard["file"], shard["bytes"])
        if self.manifest.get("eval"):
            self._check(self.path / self.manifest["eval"]["file"], self.manifest["eval"]["bytes"])

    def _check(self, file: Path, size: int) -> None:
        if not file.is_file():
            raise UserError(f"{self.key}: shard {file} is missing; run the `treadle features` command that wrote "
                            "the store again: it rewrites missing and damaged shards")
        if file.stat().st_size != size or not shard_complete(file):
            raise UserError(f"{self.key}: shard {file} is damaged ({file.stat().st_size} bytes, the manifest "
                            f"records {size}); run the `treadle features` command that wrote the store again: it "
                            "rewrites damaged shards")

    def check(self, fingerprints: dict, settings: dict) -> None:
        """Refuse, in one line naming the first difference, a store written for another target, tokenizer, data,
        draft or configuration than ``fingerprints`` (``features.run.fingerprints`` of this run); other data is
        named by the settings that differ (``settings``: this run's, ``features.run.data_settings``)."""
        found = first_difference(self.manifest["fingerprints"], fingerprints)
        if found is not None:
            found, theirs = data_differences(found, stored_settings(self.manifest), settings)
            also = f"the store's {', '.join(theirs)}, or " if theirs else ""
            raise UserError(f"{self.key} {self.path} was written for another run than this one ({found}); "
                            f"accepted: {also}a store written by `treadle features` with this run's config")

    def samples(self, split: str, base) -> "StoredSamples | None":
        return StoredSamples(self, split, base) if split in self.manifest["splits"] else None

    def get(self, file: str, names, rows) -> dict[str, torch.Tensor]:
        """``names`` of ``file``'s rows ``rows`` (a slice), reads decoded to fp32 and ids to int64."""
        from safetensors import safe_open

        path = self.path / file
        try:
            with safe_open(str(path), framework="pt") as f:
                get = lambda k: f.get_slice(k)[rows]  # noqa: E731
                out = {k: get(k).long() for k in names if k in IDS}
                out.update({READS_PREFIX + k: decode(k, get) for k in names if k not in IDS})
        except Exception as exc:  # a shard damaged after it was checked (safetensors raises its own errors)
            raise UserError(f"{self.key}: shard {path} cannot be read: {str(exc).splitlines()[0]}") from None
        return out

    def stored_eval(self):
        """The acceptance texts and the target's reads on them (``StoredEval``), or None if the store has none."""
        from treadle.drafts.run_model import StoredEval

        entry = self.manifest.get("eval")
        if not entry:
            return None
        got = self.get(entry["file"], ["texts", *self.reads], slice(None))
        return StoredEval(got.pop("texts"), {k[len(READS_PREFIX):]: v for k, v in got.items()})


class StoredSamples(torch.utils.data.Dataset):
    """A split of a store as the run's dataset: window ``i`` with the target's reads (batch keys ``target.*``).

    Everything else (length in tokens, vocabulary, tokenizer, where it came from) is the dataset it was written
    from (``base``), whose fingerprint the store matched.
    """

    def __init__(self, store: Store, split: str, base):
        self.store, self.split, self.base = store, split, base
        self.count = int(store.manifest["splits"][split]["samples"])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} out of range for {self.count} samples")
        n = self.store.shard_samples
        file = shard_name(self.split, i // n)
        got = self.store.get(file, [*TOKEN_KEYS, *self.store.reads], slice(i % n, i % n + 1))
        return {k: v[0] for k, v in got.items()}

    def __getattr__(self, name: str):  # the base dataset's attributes (seq_len, num_tokens, where, ...)
        if name in ("store", "split", "base", "count"):
            raise AttributeError(name)
        return getattr(self.base, name)
