"""rgc: randomized gradient compression for full-weight RL post-training of LLMs."""

from rgc import compute, distributed, memory
from rgc.calibrate import calibrate_lr
from rgc.control import PredictedKL
from rgc.distributed import DistributedRGCOptimizer
from rgc.memory import estimate_memory
from rgc.nn import CompressedLinear, compressed_layers, unwrap, wrap
from rgc.optim import RGCOptimizer, RowAdam
from rgc.projection import PROJECTION_KINDS, make_projection
from rgc.rounding import stochastic_round
from rgc.sync import apply_update

__version__ = "0.1.0"

__all__ = [
    "PROJECTION_KINDS",
    "CompressedLinear",
    "DistributedRGCOptimizer",
    "PredictedKL",
    "RGCOptimizer",
    "RowAdam",
    "apply_update",
    "calibrate_lr",
    "compressed_layers",
    "compute",
    "distributed",
    "estimate_memory",
    "make_projection",
    "memory",
    "stochastic_round",
    "unwrap",
    "wrap",
]
