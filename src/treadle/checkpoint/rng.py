"""Every RNG a run draws from (Python, NumPy, torch, CUDA), captured as JSON-able lists and restored:
a checkpoint's ``rng/rank_<r>.json``."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    rng = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
