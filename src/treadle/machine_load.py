"""Whether this machine was loaded while something was timed: a verdict, and why in words.

A timing taken while other processes compete for the CPUs is slower by a factor nothing in the timing itself shows:
passes that agree were steady, not quiet (issue 48: the auto probe measured 4,304 ms per layer under a steady load,
455 ms on the quiet machine, and cached the first). So what treadle keeps or compares across runs is timed inside a
``Watch``, which marks the machine loaded on any of three readings:

- the 1-minute load average against the CPUs this process may use (``sched_getaffinity``), less one for each of
  this job's processes on the machine (``LOCAL_WORLD_SIZE`` under a launcher, else this one). A process pinned to
  a few CPUs of a larger host reads the host's load average: it may be judged loaded when its own CPUs are free,
  which costs a measurement next time, never a wrong figure kept;
- CPU steal (a hypervisor running other guests on these CPUs) in /proc/stat over the watched interval, where the
  kernel reports it;
- a fixed reference kernel (a float32 matmul on torch's threads) timed before and after the measurement, against
  its quiet figure: the fastest it ran here on a verdict of quiet, kept in treadle's cache per machine and thread
  count. It catches what the other two miss: a neighbour in another container, whose tasks this one's load
  average may not count, and a load that began within the last minute, which the average shows only slowly.

A caller starts a ``Watch`` (``watch()``) before timing and takes its ``verdict()`` after. ``Given`` judges readings
handed to it instead of the machine's: tests (and callers that measured them) get a verdict that does not depend on
the machine it runs on. Light at import: torch is imported only to time the reference kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

LOAD_PER_CPU = 0.75  # other runnable tasks per usable CPU above which the machine counts as loaded
STEAL_SHARE = 0.10  # share of CPU time stolen over the interval above which the machine counts as loaded
STEAL_MIN_TICKS = 50  # fewer clock ticks than this between two /proc/stat readings say nothing about steal
REFERENCE_SLOWER = 1.5  # the reference kernel this many times slower than its quiet figure: loaded
# The reference kernel: a pass long enough that a scheduler's time slice cannot miss it (a 0.7 ms pass of 256-wide
# products ran as fast under a load of 6.6 on 2 CPUs as ever; 512-wide passes ran 4-20x slower), judged by its median
# pass (the fastest of a few passes can still slip between other jobs' slices).
REFERENCE_SIZE = 512  # the matmul's side: ~1.5 ms per product on one of our 2-core machines
REFERENCE_PRODUCTS = 4  # products per timed pass
REFERENCE_PASSES = 5  # timed passes


@dataclass(frozen=True)
class Readings:
    """What a watch saw; a reading the machine does not offer is None."""

    load: float | None = None  # 1-minute load average
    cpus: int = 1  # CPUs this process may use
    own: int = 1  # this job's processes on this machine (each adds about one to the load average while it runs)
    steal: float | None = None  # share of CPU time stolen over the watched interval
    reference_s: float | None = None  # the reference kernel's median pass, the slower of before and after
    quiet_s: float | None = None  # its quiet figure from the cache


@dataclass(frozen=True)
class Verdict:
    loaded: bool
    why: str  # the readings in words: what made it loaded, or what was read when it was not
    readings: Readings


def judge(r: Readings) -> Verdict:
    """The verdict on ``r``: loaded when any reading crosses its threshold; ``why`` names those that did (or, quiet,
    what was read)."""
    said, loaded = [], []
    if r.load is not None:
        text = f"load {r.load:.1f} on {r.cpus} CPU{'s' * (r.cpus != 1)}"
        said.append(text)
        if (r.load - r.own) / r.cpus > LOAD_PER_CPU:
            loaded.append(text)
    if r.steal is not None:
        text = f"{r.steal:.0%} of CPU time stolen by the hypervisor"
        said.append(text)
        if r.steal > STEAL_SHARE:
            loaded.append(text)
    if r.reference_s is not None and r.quiet_s:
        ratio = r.reference_s / r.quiet_s
        text = f"a reference kernel {ratio:.1f}x slower than on this machine when quiet"
        said.append(text)
        if ratio > REFERENCE_SLOWER:
            loaded.append(text)
    why = ", ".join(loaded or said) or "no load readings on this system"
    return Verdict(bool(loaded), why, r)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def own_processes() -> int:
    """This job's processes on this machine: a launcher's local ranks (all loading models alongside this one)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a system without one
        return None


def cpu_ticks() -> tuple[int, int] | None:
    """(all ticks, stolen ticks) of the machine from /proc/stat's first line; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":  # steal is the 8th counter (Linux 2.6.11 on)
        return None
    # guest and guest_nice (9th, 10th) are already counted in user and nice
    ticks = [int(v) for v in fields[1:9]]
    return sum(ticks), ticks[7]


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[0] - before[0] < STEAL_MIN_TICKS:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def machine() -> dict:
    """What makes a timing valid elsewhere: host, CPU model and flags, torch, threads."""
    import torch

    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in cpu:
                cpu[key.strip()] = val.strip()
    except OSError:
        cpu["processor"] = platform.processor()
    return {"host": platform.node(), "machine": platform.machine(), **cpu, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def reference_seconds() -> float:
    """The reference kernel's median pass: ``REFERENCE_PRODUCTS`` float32 matmuls on torch's threads, on the CPU
    (where the load this module reads competes)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=gen)
    b = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=gen)
    a @ b  # first-call paths
    passes = []
    for _ in range(REFERENCE_PASSES):
        t0 = time.perf_counter()
        for _ in range(REFERENCE_PRODUCTS):
            a @ b
        passes.append(time.perf_counter() - t0)
    return statistics.median(passes)


def quiet_path() -> Path:
    from treadle.corpus import cache_dir

    key = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "load" / f"reference-{key}.json"


def _read_quiet(path: Path) -> float | None:
    try:
        value = json.loads(path.read_text())["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, float) and value > 0 else None


class Watch:
    """The machine's load around one measurement: started before it, ``verdict()`` after it."""

    def __init__(self, path: Path | None = None):
        self.path = quiet_path() if path is None else path
        self.ticks = cpu_ticks()
        self.reference = [reference_seconds()]

    def verdict(self) -> Verdict:
        self.reference.append(reference_seconds())
        quiet = _read_quiet(self.path)
        readings = Readings(load_average(), usable_cpus(), own_processes(), steal_share(self.ticks, cpu_ticks()),
                            max(self.reference), quiet)
        verdict = judge(readings)
        fastest = min(self.reference)
        if not verdict.loaded and (quiet is None or fastest < quiet):  # the quiet figure: the fastest seen quiet
            # (a figure first recorded under a load nothing else showed comes down on the next quiet run)
            try:
                from treadle.fsutil import write_atomic

                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(self.path, json.dumps({"seconds": fastest}))
            except OSError:
                pass  # a read-only cache: the load average and steal still judge
        return verdict


class Given:
    """A watch over readings handed to it (tests; a caller that read them itself): ``verdict()`` judges them."""

    def __init__(self, readings: Readings):
        self.readings = readings

    def verdict(self) -> Verdict:
        return judge(self.readings)


def watch() -> Watch:
    """Start watching the machine (what the timing code calls: a test replaces it to give the readings)."""
    return Watch()
