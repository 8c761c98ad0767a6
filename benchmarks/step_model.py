"""Bytes moved and kernels launched per RGC optimizer step on a GPU, phase by phase.

A model, not a measurement: for a model config.json and a rank r it counts, for every
compressed linear layer (the projections of each decoder layer), the HBM bytes and kernel
launches of each phase of ``RGCOptimizer.step()`` as the library runs it on a GPU, and the time
they imply at a given memory bandwidth (H100 3.35 TB/s, H200 4.8 TB/s), beside the physical
floor (read and write each BF16 weight once) and a fused AdamW step on the same weights.

    python benchmarks/step_model.py [--config benchmarks/configs/qwen3-8b.json ...]
                                    [--ranks 64 128 256] [--out DIR]

All formulas are in :func:`layer_phases`. Byte counts assume every operand is read from HBM
once per phase (re-reads of C and P by the update kernel's tiles hit L2 and are given
separately as ``l2_bytes``); launches are per layer and assume no CUDA graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, write_results  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIGS = [CONFIGS / "qwen3-1.7b.json", CONFIGS / "qwen3-8b.json"]
DEFAULT_RANKS = [64, 128, 256]
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s (SXM, HBM3 / HBM3e)
BF16_TENSOR_FLOPS = 989e12  # dense BF16 tensor-core peak, H100 and H200 SXM
FP32_FLOPS = 67e12  # FP32 without tensor cores, H100 and H200 SXM
LAUNCH_US = 3.0  # a typical kernel launch gap without CUDA graphs

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
      tiles are L2 traffic), writes one FP32 partial sum of squares per tile and sums them
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
        Phase("norm of H (r x r Grams)", c_bytes + p_total, 3, flops=2.0 * r * r * (d + k)),
        Phase("update (fused)", 2 * w_bytes * d * k + c_bytes + p_total + 2 * 4 * tiles, 2,
              flops=2.0 * d * k * r * UPDATE_DOTS[p_bytes], tensor_cores=True, l2_bytes=l2),
        Phase("sketch zero", c_bytes, 1),
        Phase("P refresh (CholeskyQR)", 5 * g + p_total + (0 if p_bytes == 2 else 4 * g),
              7 if p_bytes == 2 else 9,
              flops=2 * (2.0 * k * r * r) + 4 * r**3 / 3),
    ]


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
        rows.append(dict(config=name, r=r, phase=label, GB=nbytes / 1e9, launches=launches,
                         GFLOP=flops / 1e9, L2_GB=l2 / 1e9,
                         **{f"{gpu}_ms": t * 1e3 for gpu, t in times.items()},
                         launch_ms=launches * LAUNCH_US / 1e3))

    all_phases = [p for phases in totals.values() for p in phases]
    for label, phases in totals.items():
        row(label, sum(p.bytes for p in phases), sum(p.launches for p in phases),
            {gpu: sum(_time(p, bw) for p in phases) for gpu, bw in BANDWIDTH.items()},
            sum(p.flops for p in phases), sum(p.l2_bytes for p in phases))
    row("total RGC step", sum(p.bytes for p in all_phases),
        sum(p.launches for p in all_phases),
        {gpu: sum(_time(p, bw) for p in all_phases) for gpu, bw in BANDWIDTH.items()},
        sum(p.flops for p in all_phases), sum(p.l2_bytes for p in all_phases))
    floor = sum(4 * d * k for _, d, k in shapes)
    row("floor (read + write BF16 W once)", floor, 0,
        {gpu: floor / bw for gpu, bw in BANDWIDTH.items()})
    adamw = sum(adamw_bytes(d, k) for _, d, k in shapes)
    row("AdamW fused (BF16 states), same weights", adamw, 0,
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
        f"solves and Cholesky). launch_ms: launches x {LAUNCH_US:g} us, the cost of launching "
        "them one by one without CUDA graphs (overlaps the others when the GPU is busy). "
        "L2_GB: re-reads of C and P by the update kernel's 64 x 64 tiles, served by L2. "
        "Floor and AdamW rows: launches not modelled (0). "
        "Formulas: benchmarks/step_model.py, layer_phases().")
    write_results("step_model", rows, title="RGC step on a GPU: bytes, launches, time by phase",
                  notes=notes, directory=args.out)
    return rows


if __name__ == "__main__":
    main()
