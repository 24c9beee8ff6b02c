"""The one exception type for bad user input.

Anything raised as a ``UserError`` reaches the user as a single line on stderr
and exit code 2, with no traceback (see ``treadle.cli.main``). Raise it *before*
touching anything on disk, so that bad input never damages an earlier run.
"""

EXIT_USAGE = 2


class UserError(Exception):
    """Bad config, data, path or flag. The message names the culprit and what is accepted."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library errors are often pages long), or its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
