"""Every target family trains: a tiny random model of each (tests/families.py), saved as a Hugging Face directory
with the test tokenizer, runs two steps of pretraining through ``treadle train --model.path``, with the plain loss
and with the chunked loss (model.loss_chunk_tokens), which must agree.

Gemma 2/3 soft-cap their logits and Granite scales them: the chunked head applies that inside each chunk, so the
chunked loss is still the model's own (the plain run's loss comes from the model's own logits). fp32: step 1 is
computed on the same weights, so the two agree to fp32's rounding; step 2 after one (equal up to rounding) update.
"""

from __future__ import annotations

import math

import pytest

from tests.families import FAMILIES, build_family
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
