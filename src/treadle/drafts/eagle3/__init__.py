"""EAGLE-3: one layer over three fused target hidden states, with its own reduced-vocabulary head."""
