"""Bits of rgc's step on fixed inputs, printed as one JSON object of SHA-256 digests.

Run as a script by ``tests/test_bit_contract.py`` under several CPU capabilities, MKL code
paths and dynamo settings; every digest names the bytes of one result. ``own`` results come
from rgc's own loops and reductions alone (hash, rounding, Gaussians, Rademacher signs, norms,
RowAdam's moments from given sketches); ``step`` results also pass through BLAS/LAPACK (the
rebuild ``U P^T``, CholeskyQR), whose bits follow the library's code path.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

import rgc
from rgc import ops


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def randn(gen: np.random.Generator, *shape: int) -> torch.Tensor:
    """FP32 Gaussians from numpy: torch's own CPU sampler vectorises, and its values depend on
    the CPU capability."""
    return torch.from_numpy(gen.standard_normal(shape, dtype=np.float32))


def stacks(gen: np.random.Generator) -> list[torch.Tensor]:
    """BF16 and FP32 stacks of several layouts: sizes not powers of two, experts, a transposed
    stack and a column slice."""
    out = [randn(gen, e, d, k).mul_(0.05).to(dtype)
           for e, d, k in [(1, 37, 300), (1, 256, 512), (3, 24, 65), (1, 1, 7)]
           for dtype in (torch.bfloat16, torch.float32)]
    out.append(randn(gen, 2, 40, 33).bfloat16().transpose(1, 2))
    out.append(randn(gen, 1, 50, 90).bfloat16()[:, :, 10:73])
    return out


def layers(kind: str, gen: np.random.Generator) -> list[rgc.CompressedLinear]:
    shapes = [(96, 64, 8), (64, 160, 16), (200, 96, 4)]
    out = []
    for i, (d, k, r) in enumerate(shapes):
        linear = torch.nn.Linear(k, d, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(randn(gen, d, k) * 0.05)
        out.append(rgc.CompressedLinear.from_linear(linear, r, projection=kind, seed=10 + i))
    return out


def train(optimizer_cls, kind: str, gen: np.random.Generator, **kwargs) -> list[torch.Tensor]:
    model = layers(kind, gen)
    opt = optimizer_cls([m.weight for m in model], **kwargs)
    for _ in range(3):
        for m in model:
            m.sketch = randn(gen, m.weight.shape[0], m.rank)
        opt.step()
        opt.zero_grad()
    state = [t for m in model for t in opt.state[m.weight].values() if torch.is_tensor(t)]
    return [m.weight for m in model] + state


def main() -> dict[str, str]:
    gen = np.random.default_rng(0)
    own: dict[str, str] = {}
    ws = stacks(gen)
    own["sum_squares"] = digest(*[ops.sum_squares([w], 128) for w in ws])
    sketches = [randn(gen, 2, 70, 8), randn(gen, 2, 300, 64)]
    projections = [rgc.make_projection("rademacher", 50, 8, seed=1),
                   rgc.make_projection("gaussian", 120, 64, seed=2)]
    own["sketch_stats"] = digest(*ops.sketch_stats(sketches, projections))
    own["rounding"] = digest(rgc.stochastic_round(randn(gen, 5000), seed=3,
                                                   offset=7))
    own["gaussians"] = digest(ops.gaussian_matrices(100, 12, [5, 6], "cpu"))
    own["rademacher"] = digest(rgc.make_projection("rademacher", 64, 8, seed=4))
    # RowAdam's moments and direction from given sketches (no BLAS)
    s = [randn(gen, 3, 33, 24)]
    m, v = [randn(gen, 3, 33, 24)], [torch.from_numpy(gen.random((3, 33), dtype=np.float32))]
    ops.row_adam_(s, m, v, torch.ones(1, 3, dtype=torch.bool), torch.full((1, 3), 4),
                  0.9, 0.999, 1e-8, False)
    own["row_adam"] = digest(s[0], m[0], v[0])

    step = {
        "rgc_orthonormal": digest(*train(rgc.RGCOptimizer, "orthonormal", gen, lr=0.01)),
        "rgc_rademacher": digest(*train(rgc.RGCOptimizer, "rademacher", gen, lr=0.01)),
        "rowadam": digest(*train(rgc.RowAdam, "rademacher", gen, lr=1e-3,
                                 weight_decay=0.1)),
    }
    return {"own": own, "step": step}


if __name__ == "__main__":
    print(json.dumps(main()))
