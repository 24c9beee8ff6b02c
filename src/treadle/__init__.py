"""treadle: a PyTorch training loop for LLMs and their speculative-decoding draft models."""

__version__ = "0.1.0"

import warnings

# DCP says this on every save/load in a single process, which is exactly how we mean to use it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
