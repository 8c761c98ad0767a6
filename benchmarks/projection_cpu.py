"""CPU: the parts of a projection refresh, compiled loops vs torch, for one layer each.

For each (k, r): the compiled Box-Muller loop writing G (``rgc_gaussian``), the compiled
CholeskyQR (``rgc_cholesky_qr``: Gram, Cholesky, ``R^-1``, ``G R^-1``, BF16 rounding) and the same
CholeskyQR through torch (``rgc.projection.orthonormalize`` then ``copy_`` to BF16, the path of
machines without a C compiler) on the same G, and their ratio. One torch thread, CPU time,
median of ``--reps`` calls. The compiled loops are built with the flags ``rgc._native`` picks
(``CC`` may name a wrapper that adds flags, e.g. ``-mno-avx512f``).

    python benchmarks/projection_cpu.py [--reps 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchmarks.common import write_results  # noqa: E402
from rgc import _native  # noqa: E402
from rgc import projection as pj  # noqa: E402
from rgc.rounding import seed_words  # noqa: E402

SHAPES = [(512, 64), (1536, 64), (4096, 64), (2048, 128), (4096, 256)]


def _median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1e6 * statistics.median(times)


def measure(lib, k: int, r: int, reps: int) -> dict:
    """One row: the three timings for a k x r BF16 projection."""
    ws = pj._cpu_workspace(k, r)
    words = seed_words(1, pj._LABEL)
    out = torch.empty(k, r, dtype=torch.bfloat16)
    scale = math.sqrt(k / r)
    g = pj.gaussian_matrix(k, r, seed=1, out=ws.g_rows)
    gauss = _median_us(lambda: lib.rgc_gaussian(ws.g_ptr, k, (r + 1) // 2, ws.ldg, *words),
                       reps)
    compiled = _median_us(lambda: lib.rgc_cholesky_qr(
        ws.g_ptr, k, r, ws.ldg, 0, scale, out.data_ptr(), 1, ws.work_ptr), reps)
    plain = _median_us(lambda: out.copy_(pj.orthonormalize(g, scale, gram_dtype=torch.float32)),
                       reps)
    return dict(k=k, r=r, gaussian_us=gauss, cholesky_qr_compiled_us=compiled,
                cholesky_qr_torch_us=plain, compiled_vs_torch=compiled / plain)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--shapes", default=",".join(f"{k}x{r}" for k, r in SHAPES),
                    help="comma-separated k x r")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    args = ap.parse_args(argv)
    lib = _native.library()
    if lib is None or not lib.fast_fma:
        raise SystemExit("needs the compiled loops with hardware fused multiply-adds")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for shape in args.shapes.split(","):
            k, r = (int(v) for v in shape.split("x"))
            rows.append(measure(lib, k, r, args.reps))
    finally:
        torch.set_num_threads(threads)
    notes = (f"BF16 P, one torch thread, CPU time, median of {args.reps} calls; the compiled "
             "and torch CholeskyQR run on the same G. compiled_vs_torch < 1: the compiled "
             "routine is faster.")
    kwargs = {} if args.out is None else dict(directory=args.out)
    write_results("projection_cpu", rows, title="Projection refresh on the CPU: compiled vs torch",
                  notes=notes, **kwargs)
    return rows


if __name__ == "__main__":
    main()
