"""GPU: the fused low-rank update kernel against copy bandwidth, the chunked torch path and AdamW.

For W (d x k, BF16) in {4096x4096, 4096x12288, 12288x4096} and r in {64, 128, 256}:

* ``copy``: measured device copy bandwidth (read + write of a 1 GiB buffer): the ceiling;
* ``fused``: :func:`rgc.kernels.lowrank_update_` (H = C P^T tile by tile on chip, W - coef H
  in FP32, stochastic rounding, one store); achieved GB/s counts 4 bytes per element
  (read + write BF16 W) and is given as a fraction of the copy bandwidth (target >= 0.8);
* ``torch``: :func:`rgc.reference.lowrank_update_reference`, H rebuilt 128 rows at a time
  (target: fused >= 2x faster);
* ``adamw``: one ``torch.optim.AdamW(fused=True)`` step on a BF16 parameter of the same shape;
* ``norm``: :func:`rgc.reference.frobenius_norm_reference` (the optimizer's other pass over W,
  to judge whether fusing ||W||^2 into the update is worth it);
* ``mismatch_vs_torch``: fraction of elements where the fused and torch paths differ (the
  same seed; they differ only where FP32 summation order moves a value across a rounding
  threshold).

A second table sweeps tile sizes and the number of BF16 parts of C (precision vs time).
Every timing is the median over repetitions with the L2 cache flushed before each.

    python benchmarks/gpu_kernels.py [--reps 20] [--no-sweep] [--out DIR]
    python benchmarks/gpu_kernels.py --smoke   # tiny shapes on the CPU, Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the first Triton kernel definition
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchmarks.common import write_results  # noqa: E402
from rgc.reference import frobenius_norm_reference, lowrank_update_reference  # noqa: E402

SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]
RANKS = [64, 128, 256]
SMOKE_SHAPES = [(48, 80), (33, 130)]
SMOKE_RANKS = [1, 24]
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
         for bm, bn, w, s in [(64, 128, 4, 2), (128, 128, 8, 2), (64, 256, 8, 2),
                              (128, 64, 4, 3), (32, 256, 4, 2), (128, 256, 8, 3)]]


class Timer:
    """Median wall time of ``fn`` in seconds; CUDA events and an L2 flush on the GPU."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.flush = (torch.empty(256 * 2**20, dtype=torch.int8, device=device)
                      if device.type == "cuda" else None)

    def __call__(self, fn) -> float:
        fn()  # warm-up (compilation, autotuning caches)
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                self.flush.zero_()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=timer.device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src))


def problem(d: int, k: int, r: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(d, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    sketch = torch.randn(d, r, generator=g, device=device)
    projection = (torch.randn(k, r, generator=g, device=device) / r**0.5).to(torch.bfloat16)
    return weight, sketch, projection


def bench_shape(timer: Timer, d: int, k: int, r: int, copy_bps: float, kernels) -> dict:
    device = timer.device
    weight, sketch, projection = problem(d, k, r, device)
    coef = 2e-5  # |coef H| ~ 0.1% of |W|: a training-sized step
    t_fused = timer(lambda: kernels.lowrank_update_(weight, sketch, projection, coef, seed=1))
    t_torch = timer(lambda: lowrank_update_reference(weight, sketch, projection, coef, seed=1))
    t_norm = timer(lambda: frobenius_norm_reference(weight))

    param = torch.nn.Parameter(weight.clone())
    param.grad = torch.randn_like(param) * 1e-3
    adamw = torch.optim.AdamW([param], lr=1e-6, fused=True)
    t_adamw = timer(adamw.step)
    del param, adamw

    start = weight.clone()
    fused, ref = start.clone(), start.clone()
    # A 1% step (a few BF16 ulps), so that every rounding decision matters.
    kernels.lowrank_update_(fused, sketch, projection, 2e-4, seed=7)
    lowrank_update_reference(ref, sketch, projection, 2e-4, seed=7)
    mismatch = (fused.view(torch.int16) != ref.view(torch.int16)).double().mean().item()

    gbps = 4 * d * k / t_fused / 1e9
    return dict(d=d, k=k, r=r, fused_us=t_fused * 1e6, fused_GBps=gbps,
                fused_vs_copy=gbps / (copy_bps / 1e9), torch_us=t_torch * 1e6,
                fused_speedup_vs_torch=t_torch / t_fused, adamw_fused_us=t_adamw * 1e6,
                norm_us=t_norm * 1e6, mismatch_vs_torch=mismatch)


def sweep(timer: Timer, d: int, k: int, ranks, configs, backend) -> list[dict]:
    rows = []
    for r in ranks:
        weight, sketch, projection = problem(d, k, r, timer.device)
        for c_parts in (1, 2, 3):
            for cfg in configs:
                config = dict(cfg, C_PARTS=c_parts)
                try:
                    t = timer(lambda: backend.lowrank_update_triton(  # noqa: B023
                        weight, sketch, projection, 2e-5, seed=1, config=config))  # noqa: B023
                except Exception as exc:  # e.g. out of shared memory for this tile
                    print(f"config {config} failed: {type(exc).__name__}: {exc}")
                    continue
                rows.append(dict(d=d, k=k, r=r, **config, us=t * 1e6,
                                 GBps=4 * d * k / t / 1e9))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU through the Triton interpreter")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile/precision sweep")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    args = ap.parse_args(argv)

    import rgc.kernels as kernels
    from rgc.kernels import _triton as backend

    if args.smoke:
        device, shapes, ranks, reps = torch.device("cpu"), SMOKE_SHAPES, SMOKE_RANKS, 1
        nbytes = 2**20
        if not backend.INTERPRETED:
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 before the kernels are loaded")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke for the CPU interpreter check")
        device, shapes, ranks, reps, nbytes = torch.device("cuda"), SHAPES, RANKS, args.reps, 2**30
    timer = Timer(device, reps)
    copy_bps = copy_bandwidth(timer, nbytes)
    print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s")
    rows = [bench_shape(timer, d, k, r, copy_bps, kernels) for d, k in shapes for r in ranks]
    mode = "smoke run (CPU, Triton interpreter: timings meaningless)" if args.smoke else "GPU"
    notes = (f"{mode}. Copy bandwidth (read + write, {nbytes / 2**20:.0f} MiB): "
             f"{copy_bps / 1e9:.1f} GB/s. fused_GBps counts 4 bytes per element of W. "
             "Targets: fused_vs_copy >= 0.8, fused_speedup_vs_torch >= 2. Median of "
             f"{reps} repetitions, L2 flushed before each.")
    kwargs = {} if args.out is None else dict(directory=args.out)
    write_results("gpu_kernels" + ("_smoke" if args.smoke else ""), rows,
                  title="Fused low-rank update kernel", notes=notes, **kwargs)
    if not args.no_sweep:
        configs = SWEEP[:2] if args.smoke else SWEEP
        sweep_rows = sweep(timer, *shapes[0], ranks[:1] if args.smoke else ranks, configs,
                           backend)
        default = backend.default_config(*shapes[0], 64, torch.bfloat16, torch.bfloat16)
        write_results("gpu_kernels_sweep" + ("_smoke" if args.smoke else ""), sweep_rows,
                      title="Fused update: tiles and number of BF16 parts of C",
                      notes=f"{mode}. Current default (r = 64): {default}", **kwargs)
    return rows


if __name__ == "__main__":
    main()
