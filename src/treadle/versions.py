"""The versions of treadle's dependencies it is tested with, checked before a command runs.

The ranges are pyproject.toml's (read back from the installed package's metadata, so there is one list): the
lower bound is the oldest release tested, the upper bound the next release known or likely to break treadle
(torch's private-ish distributed APIs move between minors; transformers 5.40 removes calls deprecated in 5.x).
``constraints.txt`` pins the exact versions CI runs. A version outside its range fails early, in one line
naming the package, instead of deep inside a run as an AttributeError; ``TREADLE_IGNORE_VERSIONS=1`` turns
that into a warning for someone trying a new release on purpose.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata

from treadle.errors import UserError

IGNORE_ENV = "TREADLE_IGNORE_VERSIONS"


def requirements() -> list[str]:
    """treadle's runtime requirements as installed (``name<spec>``), extras left out; [] when treadle runs from a
    source tree that was never installed (nothing to read the ranges from)."""
    try:
        declared = metadata.requires("treadle") or []
    except metadata.PackageNotFoundError:
        return []
    return [r for r in declared if "extra ==" not in r.replace('"', " ").replace("'", " ")]


def out_of_range(required: list[str]) -> list[str]:
    """One message per requirement whose installed version lies outside its range (or that is not installed)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems = []
    for line in required:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed; treadle needs {req.name}{req.specifier}")
            continue
        # A local build tag (torch 2.13.0+cpu) is the same release for the range.
        if not req.specifier.contains(Version(installed).public, prereleases=True):
            problems.append(f"{req.name} {installed} is installed; treadle is tested with {req.name}{req.specifier}")
    return problems


@functools.cache
def check_versions() -> None:
    """Refuse (one line) to run with a dependency outside the tested range; once per process."""
    problems = out_of_range(requirements())
    if not problems:
        return
    fix = "pip install -c constraints.txt -e . installs the tested versions"
    if os.environ.get(IGNORE_ENV) == "1":
        print(f"treadle: warning: {problems[0]} (going on: {IGNORE_ENV}=1)", file=sys.stderr)
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise UserError(f"{problems[0]}{more}: {fix}, or set {IGNORE_ENV}=1 to try anyway")
