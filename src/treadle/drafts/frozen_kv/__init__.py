"""Frozen-KV drafts: Gemma 4's assistant (Q-only layers over the target's K/V) fine-tuned against its target."""
