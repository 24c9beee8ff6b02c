"""XPress: a DFlash block draft plus a small causal refiner whose logit bias Jacobi passes resolve over the block."""
