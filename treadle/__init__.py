"""treadle: a PyTorch training loop for LLMs and their speculative-decoding draft models."""

__version__ = "0.1.0"
