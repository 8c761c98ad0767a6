"""Predict (:func:`estimate_memory`) and measure (:func:`track`) training memory."""

from rgc.memory.estimate import (
    METHODS,
    MemoryEstimate,
    ModelSpec,
    estimate_memory,
    spec_from_config,
    spec_from_module,
)
from rgc.memory.track import Allocation, Tracker, track

__all__ = [
    "METHODS",
    "Allocation",
    "MemoryEstimate",
    "ModelSpec",
    "Tracker",
    "estimate_memory",
    "spec_from_config",
    "spec_from_module",
    "track",
]
