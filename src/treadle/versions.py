"""The versions of treadle's dependencies it supports, checked before a command runs.

The ranges are pyproject.toml's (read back from the installed package's metadata, so there is one list): the
lower bound is the oldest release CI tests (constraints-oldest.txt, `make test-oldest`), the upper bound the next
minor release not yet tested (torch's distributed APIs move between minors). ``constraints.txt`` pins the newest
releases CI tests; neither file is the range. Inside the range, an API newer than the oldest release is chosen at
run time (treadle/compat.py). A version outside its range fails early, in one line naming the package and the
supported range, instead of deep inside a run as an AttributeError; ``TREADLE_IGNORE_VERSIONS=1`` turns that into a
warning for someone trying a new release on purpose.
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
            problems.append(f"{req.name} {installed} is installed; treadle supports {req.name}{spec(req)}")
    return problems


def spec(req) -> str:
    """A requirement's range, lower bound first (packaging sorts it the other way): ``>=2.11,<2.16``."""
    return ",".join(sorted((str(s) for s in req.specifier), key=lambda s: not s.startswith(">")))


@functools.cache
def check_versions() -> None:
    """Refuse (one line) to run with a dependency outside the tested range; once per process."""
    problems = out_of_range(requirements())
    if not problems:
        return
    fix = "pip install a release inside the range (or pip install -c constraints.txt -e . for the newest tested)"
    if os.environ.get(IGNORE_ENV) == "1":
        print(f"treadle: warning: {problems[0]} (going on: {IGNORE_ENV}=1)", file=sys.stderr)
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise UserError(f"{problems[0]}{more}: {fix}, or set {IGNORE_ENV}=1 to try anyway")
