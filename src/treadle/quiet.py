"""Quiet Hugging Face libraries for the length of one call, then put their settings back.

A per-tensor loading bar or a datasets progress bar is noise in a run's output, but the switches are
process-wide: a notebook that called ``treadle.fit`` must find its own bars and verbosity as they were.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def hf_quiet() -> Iterator[None]:
    import datasets
    from transformers.utils import logging as hf_logging

    bars, ds_bars, ds_level = hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(ds_level)
        if ds_bars:
            datasets.enable_progress_bars()
        if bars:
            hf_logging.enable_progress_bar()
