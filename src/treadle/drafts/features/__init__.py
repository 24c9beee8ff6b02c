"""Offline target features: what a draft reads from its frozen target, stored once and read for many epochs."""
