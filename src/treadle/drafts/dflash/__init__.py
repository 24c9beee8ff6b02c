"""DFlash: a block draft that proposes a whole block of tokens in one forward over the target's fused features."""
