"""Sketched mixture-of-experts layers: 3-D expert weights trained from per-expert sketches.

See :mod:`rgc.experts.module` (owners, the sketched experts forward), :mod:`rgc.experts.autograd`
(the Function saving ``X P``) and :mod:`rgc.experts.grouped` (grouped GEMM or per-expert loop).
"""

from rgc.experts.module import (
    ExpertWeight,
    SketchedExperts,
    expert_weight_names,
    is_sketched_experts,
    sketch_experts,
    unsketch_experts,
)

__all__ = [
    "ExpertWeight",
    "SketchedExperts",
    "expert_weight_names",
    "is_sketched_experts",
    "sketch_experts",
    "unsketch_experts",
]
