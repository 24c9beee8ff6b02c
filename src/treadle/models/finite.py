"""Weights with NaN or inf refused where they are loaded, naming the file and the tensor.

A checkpoint written from an uninitialised module (``torch.empty``) or by a run that had already diverged loads
without complaint: the first sign is ``eval_loss=nan`` at step 0, and a few steps later the NaN guard stops the run
with advice about the learning rate, which points away from the cause. So every tensor a run loads to train or to
start from (``model.path``, ``draft.target`` and the layers it ships, ``draft.init``) is checked once, as it is read.

Cost: one fused reduction per tensor on the device the tensor lands on, whose 0-dim result stays there, and one host
sync per group of tensors (a file, a module, a model), never one per tensor or element. The reduction is a plain sum:
a NaN or an inf anywhere makes it NaN or inf, and a sum runs at memory speed (``isfinite(t).all()`` writes a mask as
long as the tensor first: about 40x slower on a CPU, 2 s per 10^8 values). A sum can also overflow on finite values
(fp16's range ends at 65504): a tensor whose sum is not finite is looked at element by element before it is refused.
Integer tensors (counters, ids) are not looked at: they cannot hold NaN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from treadle.errors import UserError

# Elements looked at at once when a sum was not finite: isfinite makes a bool mask as long as its input.
CHUNK = 1 << 26


def _finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on ``t``'s device, True when every element of ``t`` is finite (no host sync). False may also
    mean a sum that overflowed: ``_all_finite`` decides."""
    return torch.isfinite(t.detach().sum())


def _all_finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` finite, exactly (a chunk at a time; one sync per chunk): only after a false flag."""
    return all(bool(torch.isfinite(part).all()) for part in t.detach().reshape(-1).split(CHUNK))


def _counts(t: torch.Tensor) -> str:
    """'3 NaN and 2 inf of 4096 values': only on the refusal path."""
    t = t.detach()
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    parts = [f"{nan} NaN"] * bool(nan) + [f"{inf} inf"] * bool(inf)
    return f"{' and '.join(parts)} of {t.numel()} values"


class FiniteCheck:
    """Flags of tensors as they are read, held on their devices; ``verify`` syncs once and refuses the first
    tensor that is not finite.

    ``where`` of a tensor is the file it came from (or a directory, when the loader does not say which file);
    ``key`` (``model.path``, ``draft.init`` ...) leads the refusal when given.
    """

    def __init__(self, key: str | None = None):
        self.key = key
        self._flags: list[torch.Tensor] = []
        self._tensors: list[tuple[torch.Tensor, str, Path | str]] = []

    def add(self, t: torch.Tensor, name: str, where: Path | str) -> None:
        if t.is_meta or not (t.is_floating_point() or t.is_complex()):
            return
        self._flags.append(_finite_flag(t))
        self._tensors.append((t, name, where))

    def first_bad(self) -> tuple[torch.Tensor, str, Path | str] | None:
        """(tensor, name, where) of the first tensor added that is not all finite, or None; one host sync per
        device holding flags, and the flags are dropped."""
        flags, tensors = self._flags, self._tensors
        self._flags, self._tensors = [], []
        by_device: dict[torch.device, list[int]] = {}
        for i, flag in enumerate(flags):
            by_device.setdefault(flag.device, []).append(i)
        suspects = []
        for idx in by_device.values():
            ok = torch.stack([flags[i] for i in idx]).cpu().tolist()  # the sync
            suspects += [i for i, good in zip(idx, ok) if not good]
        return next((tensors[i] for i in sorted(suspects) if not _all_finite(tensors[i][0])), None)

    def verify(self) -> None:
        """A UserError naming the first tensor added that is not all finite."""
        bad = self.first_bad()
        if bad is not None:
            refuse(*bad, key=self.key)


def refuse(t: torch.Tensor, name: str, where: Path | str, key: str | None = None):
    lead = f"{key} " if key else ""
    raise UserError(f"{lead}{where}: tensor {name} holds {_counts(t)}: the checkpoint itself is broken (written "
                    "from an uninitialised module, or by a run that had diverged); accepted: weights that are all "
                    "finite")


def check_tensors(tensors: dict[str, torch.Tensor], where: Path | str, key: str | None = None) -> dict:
    """``tensors`` (read from the file ``where``) returned as they are once all are finite."""
    check = FiniteCheck(key)
    for name, t in tensors.items():
        check.add(t, name, where)
    check.verify()
    return tensors


def check_module(module: torch.nn.Module, model_dir: Path, key: str | None = None) -> None:
    """Every tensor of ``module``'s state (loaded from ``model_dir`` by a loader that does not say which file holds
    which tensor, e.g. ``from_pretrained``); a refusal names the file holding the tensor where its name is in a
    file's header, else the directory."""
    check, seen = FiniteCheck(key), set()
    for name, t in _state(module):
        if id(t) not in seen:  # a tied head is its embedding: checked once
            seen.add(id(t))
            check.add(t, name, model_dir)
    bad = check.first_bad()
    if bad is not None:
        t, name, _ = bad
        refuse(t, name, file_holding(model_dir, name) or model_dir, key)


def _state(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    for name, t in module.state_dict(keep_vars=True).items():
        yield name, t.to_local() if isinstance(t, DTensor) else t


def file_holding(model_dir: Path, name: str) -> Path | None:
    """The safetensors file of ``model_dir`` whose header names ``name`` (headers only), or None."""
    from safetensors import safe_open

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                return file
    return None
