"""Optimizers that update weights from rgc sketches."""

from rgc.optim.base import DenseUpdate, LowRankUpdate, SketchOptimizer
from rgc.optim.rgc import RGCOptimizer
from rgc.optim.rowadam import RowAdam

__all__ = ["DenseUpdate", "LowRankUpdate", "RGCOptimizer", "RowAdam", "SketchOptimizer"]
