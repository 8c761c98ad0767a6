"""Optimizers that update weights from rgc sketches."""

from rgc.optim.rgc import RGCOptimizer

__all__ = ["RGCOptimizer"]
