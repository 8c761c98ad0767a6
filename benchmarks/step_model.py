"""Bytes moved and kernels launched per RGC optimizer step on a GPU, phase by phase.

Bytes are a model, launches a count: for a model config.json and a rank r it models, for every
compressed linear layer (the projections of each decoder layer), the HBM bytes of each phase of
``RGCOptimizer.step()`` as the library runs it on a GPU, and the time
they imply at a given memory bandwidth (H100 3.35 TB/s, H200 4.8 TB/s), beside the physical
floor (read and write each BF16 weight once) and a fused AdamW step on the same weights.

    python benchmarks/step_model.py [--config benchmarks/configs/qwen3-8b.json ...]
                                    [--ranks 64 128 256] [--out DIR]

All formulas are in :func:`layer_phases`. Byte counts assume every operand is read from HBM
once per phase (re-reads of C and P by the update kernel's tiles hit L2 and are given
separately as ``l2_bytes``). The step's launches do not depend on the layer sizes or count,
only on how the layers group (distinct (d, k) shapes; distinct k for the projection refresh):
:func:`counted_launches` counts them on a copy of the model with every dimension scaled down
and two decoder layers, its Triton kernels run by Triton's interpreter and every torch op that
would be a CUDA kernel counted (``tests/launches.py``), i.e. what ``opt.step()`` launches
without CUDA graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, python_last_line, write_results  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIGS = [CONFIGS / "qwen3-1.7b.json", CONFIGS / "qwen3-8b.json"]
DEFAULT_RANKS = [64, 128, 256]
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s (SXM, HBM3 / HBM3e)
BF16_TENSOR_FLOPS = 989e12  # dense BF16 tensor-core peak, H100 and H200 SXM
FP32_FLOPS = 67e12  # FP32 without tensor cores, H100 and H200 SXM
LAUNCH_US = 3.0  # a typical kernel launch gap without CUDA graphs
ROOT = Path(__file__).resolve().parents[1]

# The update kernel's tile (rgc.ops.triton.UPDATE_TILE) and BF16 products per r-block:
# C split in three BF16 parts times P0 (BF16 P), or six products for an FP32 P.
TILE_M = TILE_N = 64
UPDATE_DOTS = {2: 3, 4: 6}  # P bytes per element -> BF16 tensor-core products


@dataclasses.dataclass
class Phase:
    name: str
    bytes: float  # HBM bytes
    launches: int
    flops: float = 0.0
    tensor_cores: bool = False  # flops on BF16 tensor cores (else FP32 units)
    l2_bytes: float = 0.0  # re-reads served by L2, not in ``bytes``


def layer_phases(d: int, k: int, r: int, *, w_bytes: int = 2, p_bytes: int = 2) -> list[Phase]:
    """Phases of one compressed layer's step: W d x k, C d x r FP32, P k x r.

    * ``norm of H (r x r Grams)``: ``||C P^T||_F^2 = <C^T C, P^T P>``; two Gram products read C
      (4 d r bytes) and P (``p_bytes`` k r), then one small kernel forms ``||H||`` and the step
      coefficient on the device (isfinite, ``lr ||W|| / ||H||``, 0 for a non-finite sketch)
      from ``||W||^2`` left by the previous update: 3 launches.
    * ``update (fused)``: ``rgc.ops.lowrank_update_``: reads and writes W once
      (2 ``w_bytes`` d k), reads C and P once from HBM (their re-reads by the d/64 x k/64
      tiles are L2 traffic), writes one float64 partial sum of squares per tile and sums them
      into ``||W_new||^2`` (second launch). No separate ``||W||`` pass.
    * ``sketch zero``: ``C.zero_()``, 4 d r bytes written.
    * ``P refresh (CholeskyQR)``, ``rgc.projection`` for k >= 4r: G (k x r FP32) written
      once by one kernel (``rgc.ops.gaussian_matrices``), ``A = G^T G`` (read G; FP32 for a
      BF16 P, else from a float64 copy of G: write and read 8 k r more), ``R = chol(A)`` and
      ``sqrt(k/r) R^-1`` (r x r, no HBM term), ``Q = G R^-1`` (read G, write Q FP32), then P in
      its dtype (read Q, write P): 7 launches (the Cholesky and the triangular solve count
      two each; two more casts for an FP32 P).
    """
    c_bytes = 4 * d * r
    p_total = p_bytes * k * r
    g = 4 * k * r  # one FP32 k x r pass
    tiles = math.ceil(d / TILE_M) * math.ceil(k / TILE_N)
    # Every tile reads its BLOCK_M rows of C and BLOCK_N rows of P.
    l2 = tiles * (TILE_M * 4 + TILE_N * p_bytes) * r - c_bytes - p_total
    return [
        Phase("norm of H (r x r Grams)", c_bytes + p_total, 0, flops=2.0 * r * r * (d + k)),
        Phase("update (fused)", 2 * w_bytes * d * k + c_bytes + p_total + 2 * 8 * tiles, 0,
              flops=2.0 * d * k * r * UPDATE_DOTS[p_bytes], tensor_cores=True, l2_bytes=l2),
        Phase("sketch zero", c_bytes, 0),
        Phase("P refresh (CholeskyQR)", 5 * g + p_total + (0 if p_bytes == 2 else 4 * g), 0,
              flops=2 * (2.0 * k * r * r) + 4 * r**3 / 3),
    ]


def scaled_shapes(config: dict, r: int) -> tuple[list[tuple[str, int, int]], int]:
    """One decoder layer's shapes with every dimension divided by the same factor (so equal
    dimensions stay equal and different ones different), and a rank that keeps each layer on
    the same side of ``k >= 4 r`` (which selects the CholeskyQR variant)."""
    shapes = linear_shapes(config)
    dims = sorted({x for _, d, k in shapes for x in (d, k)})
    scale = max(1, min(dims) // 8)
    while len({x // scale for x in dims}) < len(dims):
        scale //= 2
    small = [(n, d // scale, k // scale) for n, d, k in shapes]
    rank = max(1, r // scale)
    for (_, _, k), (_, _, ks) in zip(shapes, small, strict=True):
        if (k >= 4 * r) != (ks >= 4 * rank):
            raise ValueError(f"cannot scale {shapes} at rank {r} keeping the CholeskyQR variant")
    return small, rank


def counted_launches(config: dict, r: int) -> int:
    """Kernel launches of one ``RGCOptimizer.step()`` on the config's projections (BF16),
    counted on a scaled copy (see the module docstring) in a subprocess running the Triton
    kernels in Triton's interpreter."""
    shapes, rank = scaled_shapes(config, r)
    env = {**os.environ, "TRITON_INTERPRET": "1", "RGC_IMPL": "triton",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    return int(python_last_line(_COUNT_SCRIPT, json.dumps(shapes), str(rank), env=env))


_COUNT_SCRIPT = """
import json, sys
import torch
import rgc
from tests.launches import CountLaunches
shapes, rank = json.loads(sys.argv[1]), int(sys.argv[2])
layers = [rgc.CompressedLinear(k, d, bias=False, rank=rank, seed=n, dtype=torch.bfloat16)
          for n, (_, d, k) in enumerate(shapes * 2)]
opt = rgc.RGCOptimizer([layer.weight for layer in layers], lr=1e-3)
for step in range(2):  # the second step: the cached ||W||^2 (the steady state)
    for layer in layers:
        layer(torch.randn(3, layer.in_features, dtype=torch.bfloat16)).float().sum().backward()
    with CountLaunches() as count:
        opt.step()
print(count.total)
"""


def adamw_bytes(d: int, k: int, *, w_bytes: int = 2) -> float:
    """Fused AdamW on a d x k weight, states in the weight's dtype: read W, G, m, v; write W,
    m, v."""
    return 7 * w_bytes * d * k


def linear_shapes(config: dict) -> list[tuple[str, int, int]]:
    """``(name, d, k)`` of the compressed linear layers of one decoder layer (Qwen/Llama)."""
    h = config["hidden_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * hd
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * hd
    i = config["intermediate_size"]
    return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]


def _time(phase: Phase, bandwidth: float) -> float:
    rate = BF16_TENSOR_FLOPS if phase.tensor_cores else FP32_FLOPS
    return max(phase.bytes / bandwidth, phase.flops / rate)


def step_rows(name: str, config: dict, r: int) -> list[dict]:
    """One row per phase, summed over every compressed layer, plus total, floor and AdamW."""
    shapes = linear_shapes(config) * config["num_hidden_layers"]
    totals: dict[str, list[Phase]] = {}
    for _, d, k in shapes:
        for phase in layer_phases(d, k, r):
            totals.setdefault(phase.name, []).append(phase)
    rows = []

    def row(label, nbytes, launches, times, flops=0.0, l2=0.0):
        rows.append(dict(config=name, r=r, phase=label, GB=nbytes / 1e9,
                         launches=launches if launches is not None else "",
                         GFLOP=flops / 1e9, L2_GB=l2 / 1e9,
                         **{f"{gpu}_ms": t * 1e3 for gpu, t in times.items()},
                         launch_ms=(launches or 0) * LAUNCH_US / 1e3))

    all_phases = [p for phases in totals.values() for p in phases]
    for label, phases in totals.items():
        row(label, sum(p.bytes for p in phases), None,
            {gpu: sum(_time(p, bw) for p in phases) for gpu, bw in BANDWIDTH.items()},
            sum(p.flops for p in phases), sum(p.l2_bytes for p in phases))
    row("total RGC step", sum(p.bytes for p in all_phases), counted_launches(config, r),
        {gpu: sum(_time(p, bw) for p in all_phases) for gpu, bw in BANDWIDTH.items()},
        sum(p.flops for p in all_phases), sum(p.l2_bytes for p in all_phases))
    floor = sum(4 * d * k for _, d, k in shapes)
    row("floor (read + write BF16 W once)", floor, None,
        {gpu: floor / bw for gpu, bw in BANDWIDTH.items()})
    adamw = sum(adamw_bytes(d, k) for _, d, k in shapes)
    row("AdamW fused (BF16 states), same weights", adamw, None,
        {gpu: adamw / bw for gpu, bw in BANDWIDTH.items()})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, nargs="+", default=DEFAULT_CONFIGS,
                    help="model config.json files")
    ap.add_argument("--ranks", type=int, nargs="+", default=DEFAULT_RANKS)
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = ap.parse_args(argv)
    rows = []
    for path in args.config:
        config = json.loads(path.read_text())
        for r in args.ranks:
            rows += step_rows(path.stem, config, r)
    notes = (
        "A model (no measurement): HBM bytes and kernel launches per optimizer step, summed "
        "over the compressed projections (q, k, v, o, gate, up, down of every decoder layer; "
        "BF16 W and P, FP32 C). Times: per phase the larger of bytes / bandwidth "
        f"({', '.join(f'{g} {bw / 1e12:.2f} TB/s' for g, bw in BANDWIDTH.items())}) and "
        f"flops / peak (BF16 tensor cores {BF16_TENSOR_FLOPS / 1e12:.0f} TFLOP/s for the "
        f"update's split products, FP32 {FP32_FLOPS / 1e12:.0f} TFLOP/s for the Grams, "
        f"solves and Cholesky). launches: of the whole step, counted (not modelled) on a "
        "scaled copy of the layers with the same grouping, Triton kernels in the interpreter "
        "plus the torch ops that would be CUDA kernels (the step's launches depend on the "
        "number of distinct shapes, not on the sizes or the number of layers); launch_ms: "
        f"launches x {LAUNCH_US:g} us, the cost of launching them one by one without CUDA "
        "graphs (overlaps the others when the GPU is busy). L2_GB: re-reads of C and P by the "
        "update kernel's 64 x 64 tiles, served by L2. Formulas: benchmarks/step_model.py, "
        "layer_phases(); counting: counted_launches().")
    write_results("step_model", rows, title="RGC step on a GPU: bytes, launches, time by phase",
                  notes=notes, directory=args.out)
    return rows


if __name__ == "__main__":
    main()
