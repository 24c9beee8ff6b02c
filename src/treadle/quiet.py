"""Quiet Hugging Face libraries for the length of one call, then put their settings back.

A per-tensor loading bar or a datasets progress bar is noise in a run's output, but the switches are
process-wide: a notebook that called ``treadle.fit`` must find its own bars and verbosity as they were.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def hf_quiet() -> Iterator[None]:
    """transformers' progress bars off; datasets' bars and verbosity too when datasets is loaded (a call that
    never reads data files does not pay its import); DeepSpeed's accelerator warning (``deepspeed_probe_quiet``)."""
    from transformers.utils import logging as hf_logging

    datasets = sys.modules.get("datasets")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if datasets is not None:
        ds_bars, ds_level = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    try:
        with deepspeed_probe_quiet():
            yield
    finally:
        if datasets is not None:
            datasets.logging.set_verbosity(ds_level)
            if ds_bars:
                datasets.enable_progress_bars()
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def deepspeed_probe_quiet() -> Iterator[None]:
    """For a call that may import DeepSpeed without using it: with accelerate installed (PEFT needs it), transformers'
    ``save_pretrained`` unwraps the model through accelerate, which imports DeepSpeed whenever it is installed, and
    DeepSpeed's import warns "Setting accelerator to CPU" on a machine without CUDA. Naming the CPU accelerator
    (``DS_ACCELERATOR``, for this call only, when nobody set it and DeepSpeed is not loaded yet) keeps it quiet."""
    import os

    set_here = "deepspeed" not in sys.modules and "DS_ACCELERATOR" not in os.environ
    if set_here:
        import torch

        set_here = not torch.cuda.is_available()
    if set_here:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if set_here:
            os.environ.pop("DS_ACCELERATOR", None)
