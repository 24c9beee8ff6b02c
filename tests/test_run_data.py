"""Whole runs on a mixture: per-source metrics, a phase at its exact step with its lr scale, and resume across it."""

import json
import math

import pytest

from treadle.cli import main
from treadle.config import load_config
from tests.helpers import mixture_args, records, write_pairs


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))


CONSTANT = ["--schedule.decay=constant", "--schedule.warmup_steps=0", "--train.max_steps=6"]


def test_mixture_phase_and_resume_across_it(shards, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    a = tmp_path / "a"
    assert main(mixture_args(shards, pairs, a, *CONSTANT, "--checkpoint.every=2", "--checkpoint.keep_last=5")) == 0
    recs = {r["step"]: r for r in map(json.loads, (a / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    # Step 4 (0-based step 3) is the phase's first: lr halves exactly there and the SFT source stops being drawn.
    assert [recs[s]["lr"] for s in range(1, 7)] == [5e-3] * 3 + [2.5e-3] * 3
    assert [recs[s]["phase"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    sft_tokens = [recs[s]["tokens/sft"] for s in range(1, 7)]
    assert sft_tokens[2] > 0 and sft_tokens[2:] == [sft_tokens[2]] * 4
    assert all(recs[s]["tokens/code"] + recs[s]["tokens/sft"] == recs[s]["tokens"] for s in recs)
    assert all("loss/sft" not in recs[s] for s in (4, 5, 6)) and any("loss/sft" in recs[s] for s in (1, 2, 3))
    # The step loss is the token-weighted mean of the sources' losses.
    for s in (1, 2, 3):
        if "loss/sft" in recs[s]:
            lo, hi = sorted([recs[s]["loss/code"], recs[s]["loss/sft"]])
            assert lo <= recs[s]["loss"] <= hi

    # The run directory's config runs again as it is (data.sources without the default data.train beside it).
    assert load_config(a / "config.toml").data.sources[1].name == "sft"
    # Resumed before the phase (step 2) and inside it (step 4): the same steps, losses, lr and source tokens.
    for ckpt in ("step_2", "step_4"):
        b = tmp_path / f"from_{ckpt}"
        assert main(mixture_args(shards, pairs, b, *CONSTANT, f"--checkpoint.resume={a / 'checkpoints' / ckpt}")) == 0
        first = int(ckpt.split("_")[1]) + 1
        for key in ("loss", "lr", "tokens/code", "tokens/sft", "loss/code"):
            want, got = records(a, key), records(b, key)
            assert sorted(got) == list(range(first, 7)), key
            assert all(math.isclose(got[s], want[s], rel_tol=1e-6) for s in got), (ckpt, key)


def test_resume_with_other_sources_is_refused(shards, tmp_path, capsys):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    a = tmp_path / "a"
    assert main(mixture_args(shards, pairs, a, "--train.max_steps=2")) == 0
    argv = [x for x in mixture_args(shards, pairs, a, "--train.max_steps=3") if not x.startswith(("--data.sources", "--data.phases"))]
    argv.append(f'--data.sources=[{{name="code",path="{shards / "train"}"}}]')
    assert main(argv) == 2
    assert "sources" in capsys.readouterr().err
