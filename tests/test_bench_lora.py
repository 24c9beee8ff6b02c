"""bench/memory_lora_cases.py's sizes (issue 42): its 'large' case is one full training cannot fit on a 24 GiB
machine and LoRA r = 16 can, counted on the meta device (nothing allocated)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import memory_lora_cases as cases  # noqa: E402


def test_the_large_case_cannot_train_in_full_in_24_gib_and_fits_with_lora():
    full, lora = cases.state_bytes("large", "full"), cases.state_bytes("large", "lora")
    assert full["state_bytes"] > 24 * 2**30  # weights, gradients and AdamW state alone, before activations
    assert lora["state_bytes"] < 8 * 2**30 and lora["trainable"] < 0.02 * lora["params"]
    medium = cases.state_bytes("medium", "lora")
    # rank 16 on q, k, v, o, gate, up, down of 16 layers: r x (in + out) each
    h, i, kv = 1024, 2816, 512
    assert medium["trainable"] == 16 * 16 * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
