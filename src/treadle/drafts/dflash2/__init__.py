"""DFlash2: DFlash with grouped in-block convolutions and a selector that walks a path through each slot's candidates."""
