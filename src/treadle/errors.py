"""The exceptions the CLI turns into exit codes, and the codes themselves.

Anything raised as a ``UserError`` reaches the user as a single line on stderr
and exit code 2, with no traceback (see ``treadle.cli.main``). Raise it *before*
touching anything on disk, so that bad input never damages an earlier run.

They live here, at the bottom layer and free of heavy imports, so that the CLI can
catch them without importing torch (``treadle --help`` and a config typo answer at once).

Exit codes (documented in docs/checkpoints.md):
    0   finished
    2   bad input (config, data, paths, flags)
    3   training failed: NaN policy gave up, or a checkpoint could not be written
    75  stopped cleanly and resumable (SIGTERM / SIGUSR1 / SIGINT / train.time_limit)
    130 stopped at once by a second SIGINT (nothing saved beyond the last checkpoint)
"""

from __future__ import annotations

from pathlib import Path

EXIT_USAGE = 2
EXIT_TRAINING_FAILED = 3
EXIT_STOPPED_RESUMABLE = 75
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad config, data, path or flag. The message names the culprit and what is accepted."""


class TrainingFailed(Exception):
    """The run cannot go on; the message says why and what to change. Exit code 3."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, file too large, read-only, no permission).

    Earlier checkpoints and ``latest`` are untouched, so the run can be resumed from
    them. ``path`` is where the write failed, ``os_error`` the error the OS gave.
    A ``UserError``, so the CLI reports it as one line (exit code 3: a full disk is not bad input).
    """

    def __init__(self, message: str, path: Path, os_error: OSError):
        super().__init__(message)
        self.path = path
        self.os_error = os_error


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library errors are often pages long), or its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
