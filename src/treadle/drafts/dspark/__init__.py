"""DSpark: a semi-autoregressive block draft (a DFlash backbone, a Markov head and a confidence head)."""
