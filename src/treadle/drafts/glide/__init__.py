"""GLIDE: a draft block cross-attending to the frozen target's last-layer K/V (LongSpec's design)."""
