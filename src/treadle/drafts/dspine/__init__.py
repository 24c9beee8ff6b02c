"""DSpine: a DFlash block draft whose layers pass each slot's predicted feature on to the next slot."""
