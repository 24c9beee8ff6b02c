"""The snapshot an async save writes: tensors copied into CPU buffers that are reused from one save to the next."""

from __future__ import annotations

from typing import Any

import torch


class StagingBuffers:
    """One extra CPU copy of the state for the run's lifetime, but no fresh allocation (page faults) on the
    training thread at each save (``dcp.async_save`` allocates anew each time: bench/checkpoint.py)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, obj: Any, key: tuple = ()) -> Any:
        """A snapshot of ``obj`` that training can no longer change: tensors copied into CPU buffers."""
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor:  # DTensor and other subclasses keep their own layout
                return obj.detach().clone()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self._buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
            buf.copy_(obj.detach())
            return buf
        if isinstance(obj, dict):
            return {k: self.stage(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.stage(v, key + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self.stage(v, key + (i,)) for i, v in enumerate(obj))
        return obj  # int, float, str, bool, None: immutable
