"""Speculative decoding: the greedy verification loop, drafters, prompts and the spec-eval command."""
