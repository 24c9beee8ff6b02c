"""Where metrics go: ``metrics.jsonl`` in the run directory, and the console.

On a terminal the console is a live rich progress bar; elsewhere (CI, a file)
it prints plain log lines, because a progress bar redrawn into a log file is noise.
Only rank 0 writes (``enabled=False`` elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _finite(value):
    # Strict JSON has no NaN/Infinity: a non-finite value is written as null.
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlSink:
    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._fh = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._fh is None:  # opened on first write: a run that fails validation leaves no file
            self._fh = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most one line
        self._fh.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a resumed run logs them again) and a torn last line."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = []
        for line in self.path.read_text().split("\n"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if record.get("step", 0) <= step:
                kept.append(line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _fmt(record: dict) -> str:
    parts = []
    for k, v in record.items():
        if k == "step" or isinstance(v, list):  # per-item values (expert_tokens) stay in metrics.jsonl
            continue
        if isinstance(v, float):
            v = f"{v:.4g}" if (abs(v) < 1e5 or not math.isfinite(v)) else f"{v:,.0f}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def duration(seconds: float) -> str:
    """'45s', '12m05s', '3h02m': a time left, as a log reader wants it."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Console:
    """Progress bar on a TTY, plain lines otherwise.

    A plain step line ends with the step out of the total and the time left, ``[40/600, eta 23m05s]``: wall time
    per step since the first step this process ran (the first step warms up), evals and saves included.
    """

    def __init__(self, total_steps: int, enabled: bool = True, live: bool | None = None, records: bool = True):
        self.enabled = enabled
        self.records = records  # False: metrics.sinks leaves "console" out (no record lines; the bar and notices stay)
        self.console = RichConsole(file=sys.stdout)
        self.live = self.console.is_terminal if live is None else live
        self.total = total_steps
        self._progress: Progress | None = None
        self._task = None
        self._clock: tuple[float, int] | None = None  # (when, step) at the end of this process's first step

    def start(self, step: int) -> None:
        if not (self.enabled and self.live):
            return
        self._progress = Progress(
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=self.total, completed=step, stats="", label="train")
        self._progress.start()

    def step(self, step: int, stats: dict | None = None) -> None:
        if self._clock is None:
            self._clock = (time.monotonic(), step)
        if self._progress is not None:
            fields = {"stats": _fmt(stats)} if stats else {}
            self._progress.update(self._task, completed=step, label="train", **fields)

    def log(self, record: dict, kind: str = "step") -> None:
        """A logged record: a line above the bar on a TTY, a plain line otherwise."""
        if not (self.enabled and self.records):
            return
        line = f"{kind} {record.get('step', '')}: {_fmt(record)}"
        if self._progress is not None and kind == "step":
            self.step(record["step"], {k: record[k] for k in ("loss", "lr", "tokens_per_s") if k in record})
        else:
            if kind == "step" and "step" in record:
                line += f" [{self._where(record['step'])}]"
            self.print(line)

    def _where(self, step: int) -> str:
        where = f"{step}/{self.total}"
        if self._clock is not None and step > self._clock[1]:
            per_step = (time.monotonic() - self._clock[0]) / (step - self._clock[1])
            where += f", eta {duration(per_step * max(self.total - step, 0))}"
        return where

    def status(self, text: str) -> None:
        """What the run is doing between steps (an eval starting, which may take a while): a plain line, or on a
        TTY the bar's label until the next step (the bar would otherwise stand still with nothing said)."""
        if self._progress is not None:
            self._progress.update(self._task, label=text)
            self._progress.refresh()
        elif self.enabled and self.records and not self.live:
            self.print(text)

    def print(self, text: str) -> None:
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(text, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# ---------------------------------------------------------------------------- optional sinks

_EXTRAS = {"tensorboard": ("tensorboard", "treadle[tensorboard]"), "wandb": ("wandb", "treadle[wandb]")}


def check_sinks_installed(sinks: list[str]) -> None:
    """An optional sink whose package is missing: one line naming the extra, before the run writes anything."""
    import importlib.util

    from treadle.errors import UserError

    for name in sinks:
        if name in _EXTRAS and importlib.util.find_spec(_EXTRAS[name][0]) is None:
            module, extra = _EXTRAS[name]
            raise UserError(f"metrics.sinks lists {name!r} but the {module} package is not installed; accepted: "
                            f"pip install '{extra}', or leave {name!r} out of metrics.sinks")


def _dropped(name: str, what: str, exc: Exception, then: str) -> str:
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"treadle: warning: the {name} sink {what} ({type(exc).__name__}: {message}); {then}"


class Sinks:
    """metrics.jsonl and the optional sinks (TensorBoard, W&B); rank 0's.

    An optional sink that raises (a full disk under its directory, a lost network) is reported once and dropped:
    it never stops training. ``seconds`` sums the time each optional sink took (what it costs a step).
    """

    def __init__(self, jsonl: JsonlSink, warn=print):
        self.jsonl = jsonl
        self.optional: list = []
        self.seconds: dict[str, float] = {}
        self.warn = warn

    def add(self, sink) -> None:
        self.optional.append(sink)
        self.seconds.setdefault(sink.name, 0.0)

    def write(self, record: dict, kind: str = "step") -> None:
        self.jsonl.write(record)
        for sink in list(self.optional):
            t0 = time.perf_counter()
            self._guard(sink, sink.write, record, kind)
            self.seconds[sink.name] += time.perf_counter() - t0

    def _guard(self, sink, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a sink is a side channel: whatever it raises, training goes on
            self.optional.remove(sink)
            self.warn(_dropped(sink.name, "failed", exc, "it is dropped, training goes on"))
            if fn != sink.close:
                with contextlib.suppress(Exception):
                    sink.close()

    def truncate_after(self, step: int) -> None:
        self.jsonl.truncate_after(step)

    def close(self) -> None:
        self.jsonl.close()
        for sink in list(self.optional):
            self._guard(sink, sink.close)
        self.optional = []


def open_optional_sinks(sinks: Sinks, cfg, out: Path, resumed_step: int | None) -> None:
    """The optional sinks ``metrics.sinks`` names, continuing this run's (a resume: up to ``resumed_step``).

    One that cannot open (W&B online without a login) is reported and left out, like one that fails later."""
    from treadle.config import flatten, to_toml

    names, tree = cfg.metrics.sinks, cfg.model_dump(mode="json", exclude_none=True)

    def tensorboard():
        from treadle.metrics.tensorboard_sink import TensorBoardSink

        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(tree).items()}
        return TensorBoardSink(out / "tensorboard", to_toml(cfg), hparams, -1 if resumed_step is None else resumed_step)

    def wandb():
        from treadle.metrics.wandb_sink import WandbSink

        m = cfg.metrics
        return WandbSink(out, tree, m.wandb_project, m.wandb_name or out.resolve().name, m.wandb_group, m.wandb_tags,
                         m.wandb_mode, resumed=resumed_step is not None)

    for name, opener in (("tensorboard", tensorboard), ("wandb", wandb)):
        if name in names:
            try:
                sinks.add(opener())
            except Exception as exc:  # noqa: BLE001 - see Sinks: a sink never stops training
                sinks.warn(_dropped(name, "could not start", exc, "training goes on without it"))
