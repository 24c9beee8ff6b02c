"""Every target family trains: a tiny random model of each (tests/families.py), saved as a Hugging Face directory
with the test tokenizer, runs two steps of pretraining through ``treadle train --model.path``, with the plain loss
and with the chunked loss (model.loss_chunk_tokens), which must agree.

Gemma 2/3 soft-cap their logits and Granite scales them: the chunked head applies that inside each chunk, so the
chunked loss is still the model's own (the plain run's loss comes from the model's own logits). fp32: step 1 is
computed on the same weights, so the two agree to fp32's rounding; step 2 after one (equal up to rounding) update.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.families import FAMILIES, GLIDE_REFUSED, build_family
from tests.helpers import EXACT, records
from treadle.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 7  # divides neither the 64 tokens of a micro-batch nor the 512-token vocabulary


def family_args(shards, model_dir, out, *extra):
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        f"--model.path={model_dir}", "--data.seq_len=32", "--train.micro_batch_size=2", "--train.grad_accum_steps=1",
        "--train.log_every=1", "--train.eval_batches=1", "--train.max_steps=2", "--schedule.warmup_steps=1",
        *EXACT, *extra,
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_pretrains_with_the_plain_and_the_chunked_loss(family, shards, tmp_path):
    build_family(family, tmp_path / "model", shards / "tok")
    losses = {}
    for chunk in (0, CHUNK):
        out = tmp_path / f"run-{chunk}"
        # An explicit chunk size: a model the chunked loss cannot serve is refused (exit 2), not left unchunked.
        assert main(family_args(shards, tmp_path / "model", out, f"--model.loss_chunk_tokens={chunk}")) == 0, chunk
        losses[chunk] = records(out)
        assert sorted(losses[chunk]) == [1, 2] and all(math.isfinite(v) for v in losses[chunk].values()), losses
        assert (out / "hf" / "config.json").exists()
    plain, chunked = losses[0], losses[CHUNK]
    assert chunked[1] == pytest.approx(plain[1], rel=1e-6), (plain, chunked)
    assert chunked[2] == pytest.approx(plain[2], rel=1e-5), (plain, chunked)


def draft_family_args(shards, target, out, kind):
    """Two steps of a ``kind`` draft run, tiny (DRAFT_SHORT's acceptance settings, one eval batch)."""
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        f"--draft.kind={kind}", f"--draft.target={target}", "--data.seq_len=32", "--train.micro_batch_size=2",
        "--train.grad_accum_steps=1", "--train.log_every=1", "--train.eval_batches=1", "--train.max_steps=2",
        "--schedule.warmup_steps=1", "--draft.eval_prompts=2", "--draft.eval_prompt_len=8",
        "--draft.eval_new_tokens=8", "--draft.max_position_offset=64", *EXACT,
    ]


def spec_eval_is_lossless(target, run, tmp_path, kind):
    out = tmp_path / f"spec-{kind}.json"
    assert main(["spec-eval", "--target", str(target), "--draft", str(run), "--num-prompts", "2", "--prompt-len", "8",
                 "--max-new-tokens", "8", "--threads", "1", "--json", str(out)]) == 0, kind
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == kind and 1.0 <= got["tau"], got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_drafts_eagle3_everywhere_and_glide_where_it_can_read_the_cache(family, shards, tmp_path, capsys):
    """Per family, a 4-layer target (EAGLE-3's three feature layers need 4): two steps of an EAGLE-3 draft and a
    lossless greedy spec-eval with it; GLIDE likewise, or (GLIDE_REFUSED) refused in one line that names the reason
    and EAGLE-3 as the alternative, exit 2, before anything is written."""
    target = tmp_path / "target"
    build_family(family, target, shards / "tok", layers=4)
    for kind in ("eagle3", "glide"):
        run = tmp_path / kind
        capsys.readouterr()
        rc = main(draft_family_args(shards, target, run, kind))
        err = capsys.readouterr().err
        if kind == "glide" and family in GLIDE_REFUSED:
            assert rc == 2 and not run.exists(), (rc, err)
            line = [x for x in err.splitlines() if "GLIDE cannot draft" in x]
            assert len(line) == 1 and GLIDE_REFUSED[family] in line[0] and "draft.kind = 'eagle3'" in line[0], err
            continue
        assert rc == 0, (kind, err)
        assert sorted(records(run)) == [1, 2] and all(math.isfinite(v) for v in records(run).values())
        spec_eval_is_lossless(target, run, tmp_path, kind)
