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
    never reads data files does not pay its import)."""
    from transformers.utils import logging as hf_logging

    datasets = sys.modules.get("datasets")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if datasets is not None:
        ds_bars, ds_level = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        if datasets is not None:
            datasets.logging.set_verbosity(ds_level)
            if ds_bars:
                datasets.enable_progress_bars()
        if bars:
            hf_logging.enable_progress_bar()
