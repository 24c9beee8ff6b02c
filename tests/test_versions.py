"""The dependency ranges are true and checked: pyproject.toml states the range treadle supports, constraints.txt (the
newest tested) and constraints-oldest.txt (the oldest) pin each runtime and test dependency inside it, the oldest
pins of torch and transformers are the bottom of their ranges, and a command refuses (one line naming the package and
the range, exit 2) to run with an installed version outside it."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from treadle.versions import out_of_range, requirements

REPO = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, Version]:
    lines = [ln.split("#")[0].strip() for ln in (REPO / name).read_text().splitlines()]
    pins = [Requirement(ln) for ln in lines if ln]
    assert all(str(p.specifier).startswith("==") for p in pins)
    return {p.name.lower(): Version(str(p.specifier)[2:]) for p in pins}


def test_constraints_pin_every_dependency_inside_its_stated_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [r for extra in ("deepspeed", "test") for r in project["optional-dependencies"][extra]]
    newest, oldest = _pins("constraints.txt"), _pins("constraints-oldest.txt")
    for name, pins in (("constraints.txt", newest), ("constraints-oldest.txt", oldest)):
        for line in declared:
            req = Requirement(line)
            assert req.name.lower() in pins, f"{req.name} is not pinned in {name}"
            assert req.specifier.contains(pins[req.name.lower()]), f"{name} pins {req.name} outside {req.specifier}"
    ranges = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    for name in ("torch", "transformers"):  # the oldest end CI tests is the range's bottom, the newest is inside it
        bottom = next(Version(s.version) for s in ranges[name] if s.operator == ">=")
        assert (oldest[name].major, oldest[name].minor) == (bottom.major, bottom.minor), (name, oldest[name], bottom)
        assert newest[name] > oldest[name]
    # The environment under test is the one the ranges describe, and the installed metadata says what the file says.
    assert out_of_range(requirements()) == []
    assert {Requirement(r).name for r in requirements()} == {Requirement(r).name for r in project["dependencies"]}


def _fake_distribution(root: Path, name: str, version: str) -> Path:
    """Package metadata that importlib finds before the real one (PYTHONPATH comes first): the version a user's
    older environment would report, without installing anything."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_a_dependency_outside_its_range_is_refused_in_one_line(tmp_path):
    fake = _fake_distribution(tmp_path / "site", "transformers", "4.50.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(REPO / "src")])}
    cmd = [sys.executable, "-m", "treadle", "config"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "transformers 4.50.0 is installed; treadle supports transformers>=5.17," in err[0], err
    assert "constraints.txt" in err[0] and "TREADLE_IGNORE_VERSIONS=1" in err[0]
    # On purpose: a warning line, then the command runs.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**env, "TREADLE_IGNORE_VERSIONS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("transformers 4.50.0") == 1 and "[train]" in proc.stdout


def test_a_model_type_the_installed_transformers_lacks_is_refused_in_one_line(tmp_path):
    """A family newer than the installed transformers (on the oldest end: Mistral Large 4, added after 5.17) is
    refused naming the installed release and the supported range, not by transformers' own error mid-load."""
    import json

    import pytest
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from treadle.errors import UserError
    from treadle.models.hf import load_causal_lm

    newer = "mistral_large4" if "mistral_large4" not in CONFIG_MAPPING_NAMES else "a_family_of_transformers_6"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": newer, "vocab_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as caught:
        load_causal_lm(tmp_path, "draft.target")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"draft.target {tmp_path}: model_type {newer!r}")
    assert f"transformers {transformers.__version__}" in line and "treadle supports transformers >=5.17," in line


def test_a_draft_kind_the_installed_transformers_cannot_serve_is_refused_in_one_line():
    """frozen_kv reads Gemma 4's K/V-sharing config, which transformers has from 5.23: on the oldest end (5.17) the
    kind is refused naming the release it needs; on the newest it passes the check."""
    import pytest

    from treadle import compat
    from treadle.drafts.frozen_kv.model import refuse_non_gemma4
    from treadle.errors import UserError

    if compat.gemma4_kv_sharing():
        refuse_non_gemma4("gemma4_text", "draft.target x")  # nothing to refuse
        return
    with pytest.raises(UserError) as caught:
        refuse_non_gemma4("gemma4_text", "draft.target x")
    line = str(caught.value)
    assert "\n" not in line and "draft.kind = 'frozen_kv'" in line and "needs transformers >= 5.23" in line
