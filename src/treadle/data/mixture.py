"""Where each position of the one global sample order comes from: which source, which sample.

The run's data is one infinite sequence of positions ``g = 0, 1, 2, ...``; a
step consumes ``global_batch`` consecutive positions (see ``loader.py``).

* **Which source.** Position ``g`` draws a uniform number from a counter-based
  generator keyed by ``(seed, g // CHUNK)``, and the source is the interval of
  the cumulative probabilities that holds it. Probabilities are
  ``weight^(1/temperature)``, normalized, and change with the phase of the step
  being taken. Nothing depends on the number of ranks or on earlier draws.
* **Which sample.** Each source has its own ``SampleOrder`` (seeded per-epoch
  permutations) and a cursor: how many of its samples the run has drawn. The
  ``k``-th position that picks source ``s`` takes sample ``order_s[cursor_s + k]``.

So the whole loader state is the position plus one cursor per source: resuming
costs O(1) at any step, and is exact at any world size.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from treadle.errors import UserError

_MIX_STREAM = 0x6D6978  # "mix": keeps the source draws apart from every sample permutation
CHUNK = 1 << 14


def stream_of(name: str) -> int:
    """A stable integer per source name (crc32: the same in every process and Python version)."""
    return zlib.crc32(name.encode("utf-8"))


def probabilities(weights: Sequence[float], temperature: float = 1.0) -> np.ndarray:
    """Sampling probabilities ~ weight^(1/temperature): T > 1 flattens the mixture, T < 1 sharpens it."""
    w = np.asarray(weights, dtype=np.float64)
    if temperature <= 0 or np.any(w < 0) or not np.any(w > 0):
        raise UserError(f"mixture weights {list(weights)} at temperature {temperature}: need weights >= 0, "
                        "at least one > 0, and temperature > 0")
    p = np.where(w > 0, w, 0.0) ** (1.0 / temperature)
    return p / p.sum()


@dataclass(frozen=True)
class Phase:
    start_step: int
    weights: tuple[float, ...]  # one per source, in source order
    lr_scale: float = 1.0


class Mixture:
    """The probability of each source by step (phases) and the source of every global position."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None, phases: Sequence[Phase] = (),
                 temperature: float = 1.0):
        """``weights`` hold until the first phase (equal weights when None); a phase at step 0 replaces them."""
        if not names:
            raise UserError("a mixture needs at least one source")
        base = Phase(0, tuple(weights) if weights is not None else (1.0,) * len(names))
        phases = sorted(phases, key=lambda p: p.start_step)
        self.names = list(names)
        self.phases = phases if phases and phases[0].start_step == 0 else [base, *phases]
        self.temperature = temperature
        self._cumulative = []
        for p in self.phases:
            if len(p.weights) != len(names):
                raise ValueError(f"phase at step {p.start_step}: {len(p.weights)} weights for {len(names)} sources")
            self._cumulative.append(np.cumsum(probabilities(p.weights, temperature)))
        self._chunk: tuple[tuple[int, int], np.ndarray] | None = None

    @classmethod
    def single(cls, name: str = "train") -> Mixture:
        return cls([name])

    def phase_index(self, step: int) -> int:
        return int(np.searchsorted([p.start_step for p in self.phases], step, side="right")) - 1

    def lr_scale(self, step: int) -> float:
        return self.phases[self.phase_index(step)].lr_scale

    def probabilities(self, step: int) -> np.ndarray:
        return np.diff(self._cumulative[self.phase_index(step)], prepend=0.0)

    def _uniforms(self, seed: int, start: int, count: int) -> np.ndarray:
        out = np.empty(count)
        filled, g = 0, start
        while filled < count:
            c, offset = divmod(g, CHUNK)
            if self._chunk is None or self._chunk[0] != (seed, c):  # one-chunk cache: steps are consecutive
                self._chunk = ((seed, c), np.random.Generator(np.random.PCG64([seed, _MIX_STREAM, c])).random(CHUNK))
            take = min(count - filled, CHUNK - offset)
            out[filled : filled + take] = self._chunk[1][offset : offset + take]
            filled += take
            g += take
        return out

    def sources(self, seed: int, start: int, count: int, step: int) -> np.ndarray:
        """Source index of positions [start, start + count), all taken at ``step``."""
        if len(self.names) == 1:
            return np.zeros(count, dtype=np.int64)
        cumulative = self._cumulative[self.phase_index(step)]
        picked = np.searchsorted(cumulative, self._uniforms(seed, start, count), side="right")
        # Rounding can leave cumulative[-1] a hair under 1: such a draw belongs to the last source that can be drawn.
        return np.minimum(picked, int(np.flatnonzero(np.diff(cumulative, prepend=0.0) > 0)[-1]))


class SampleOrder:
    """Position ``g`` of an infinite stream -> sample ``permutation(seed, stream, g // N)[g % N]``.

    Each epoch is a fresh permutation seeded by (seed, stream, epoch), so any
    position can be computed directly without replaying earlier epochs. A
    source's ``stream`` is derived from its name: its order does not depend on
    which other sources share the run.
    """

    def __init__(self, num_samples: int, seed: int, stream: int = 0):
        if num_samples < 1:
            raise UserError(f"sample order over {num_samples} samples: expected at least 1")
        if seed < 0:
            raise UserError(f"data seed {seed}: expected a non-negative integer")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.stream = int(stream)
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        # One-entry cache: consecutive steps almost always stay in one epoch.
        if epoch != self._epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, self.stream, epoch])).permutation(self.num_samples)
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
