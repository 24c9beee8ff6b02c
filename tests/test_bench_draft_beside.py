"""bench/draft_beside.py (issue 49, a draft beside its target) end to end in its smallest form: the step-time table
(target alone, with the draft beside, a draft run), the three ways to keep a draft current through a target's SFT,
and MTP joint against the target alone. The bench's figures are not judged here (a smoke run's are noise): every
row must be there, finite, each decode lossless, and the load verdict stated in the timing table's header."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import draft_beside  # noqa: E402


def _tables(stdout: str) -> dict[str, dict[str, str]]:
    """Every markdown table's rows by their first cell, each a {header: cell} dict (the tables' first cells differ)."""
    rows, header = {}, None
    for line in stdout.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not line.startswith("|---"):
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_quick_bench_tables_step_times_the_three_fresh_drafts_and_mtp_joint(tmp_path, capsys):
    out = tmp_path / "bench"
    assert draft_beside.main(["--quick", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    rows = _tables(stdout)
    for way in ("target alone", "target + draft beside", "draft run (frozen target)"):
        median = rows[way]["s/step"].split(" (")[0]
        assert math.isfinite(float(median)) and float(median) > 0, rows[way]
    assert rows["target alone"]["x target alone"].startswith("1.00")
    assert ("LOADED machine" in stdout) != ("quiet machine" in stdout)  # the verdict, one of the two
    for way in draft_beside.WAYS:
        assert rows[way]["lossless"] == "True" and rows[way]["draft steps"] == "4", rows[way]
        assert all(float(rows[way][f"tau {m}"]) >= 1.0 for m in draft_beside.MODES)
    assert rows["beside"]["extra target forwards"] == "0" and rows["stale"]["extra target forwards"] == "4"
    for way in ("no MTP loss", "MTP loss x 0.3 (joint)"):
        assert math.isfinite(float(rows[way]["val loss (target's CE)"]))
    saved = json.loads((out / "results.json").read_text())
    assert [len(v) for v in saved["timing"]["step_s"].values()] == [2, 2, 2]  # interleaved repeats
