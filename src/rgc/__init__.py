"""rgc: randomized gradient compression for full-weight RL post-training of LLMs."""

from rgc import compute, experts, memory
from rgc.calibrate import calibrate_lr
from rgc.control import PredictedKL
from rgc.coverage import wrap_summary
from rgc.memory import estimate_memory
from rgc.nn import (
    DEFAULT_TARGETS,
    CompressedLinear,
    compressed_layers,
    router_parameters,
    sketched_weights,
    unwrap,
    wrap,
)
from rgc.optim import RGCOptimizer, RowAdam
from rgc.projection import PROJECTION_KINDS, make_projection
from rgc.rounding import stochastic_round
from rgc.sync import apply_update

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGETS",
    "PROJECTION_KINDS",
    "CompressedLinear",
    "DistributedRGCOptimizer",
    "DistributedRowAdam",
    "PredictedKL",
    "RGCOptimizer",
    "RowAdam",
    "apply_update",
    "calibrate_lr",
    "compressed_layers",
    "compute",
    "distributed",
    "estimate_memory",
    "experts",
    "make_projection",
    "memory",
    "router_parameters",
    "sketched_weights",
    "stochastic_round",
    "unwrap",
    "wrap",
    "wrap_summary",
]

#: Loaded on first use: :mod:`rgc.distributed` imports torch.distributed's tensor package
#: (about 0.8 s), which a single process never needs.
_DISTRIBUTED = ("distributed", "DistributedRGCOptimizer", "DistributedRowAdam")


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        import importlib

        module = importlib.import_module("rgc.distributed")
        return module if name == "distributed" else getattr(module, name)
    raise AttributeError(f"module 'rgc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_DISTRIBUTED})
