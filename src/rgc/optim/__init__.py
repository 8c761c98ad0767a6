"""Optimizers that update weights from rgc sketches."""

from rgc.optim.base import SketchOptimizer
from rgc.optim.rgc import RGCOptimizer
from rgc.optim.rowadam import RowAdam
from rgc.updates import DenseUpdate, LowRankUpdate

__all__ = ["DenseUpdate", "LowRankUpdate", "RGCOptimizer", "RowAdam", "SketchOptimizer"]
