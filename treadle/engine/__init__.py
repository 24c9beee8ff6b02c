"""How a model is wrapped and stepped. Only the local engine exists so far."""

from treadle.engine.local import LocalEngine

__all__ = ["LocalEngine"]
