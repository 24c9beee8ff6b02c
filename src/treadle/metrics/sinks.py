"""Where metrics go: ``metrics.jsonl`` in the run directory, and the console.

On a terminal the console is a live rich progress bar; elsewhere (CI, a file)
it prints plain log lines, because a progress bar redrawn into a log file is noise.
Only rank 0 writes (``enabled=False`` elsewhere).
"""

from __future__ import annotations

import json
import math
import sys
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


class Console:
    """Progress bar on a TTY, plain lines otherwise."""

    def __init__(self, total_steps: int, enabled: bool = True, live: bool | None = None):
        self.enabled = enabled
        self.console = RichConsole(file=sys.stdout)
        self.live = self.console.is_terminal if live is None else live
        self.total = total_steps
        self._progress: Progress | None = None
        self._task = None

    def start(self, step: int) -> None:
        if not (self.enabled and self.live):
            return
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=self.total, completed=step, stats="")
        self._progress.start()

    def step(self, step: int, stats: dict | None = None) -> None:
        if self._progress is not None:
            fields = {"stats": _fmt(stats)} if stats else {}
            self._progress.update(self._task, completed=step, **fields)

    def log(self, record: dict, kind: str = "step") -> None:
        """A logged record: a line above the bar on a TTY, a plain line otherwise."""
        if not self.enabled:
            return
        line = f"{kind} {record.get('step', '')}: {_fmt(record)}"
        if self._progress is not None and kind == "step":
            self.step(record["step"], {k: record[k] for k in ("loss", "lr", "tokens_per_s") if k in record})
        else:
            self.print(line)

    def print(self, text: str) -> None:
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(text, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
