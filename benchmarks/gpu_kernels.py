"""GPU: the rgc.ops Triton kernels against copy bandwidth, the torch path and AdamW.

For W (d x k, BF16) in {4096x4096, 4096x12288, 12288x4096} and r in {64, 128, 256}:

* ``copy``: measured device copy bandwidth (read + write of a 1 GiB buffer): the ceiling;
* ``fused``: ``rgc.ops.triton.lowrank_update_`` on one stack as the optimizer calls it
  (H = U P^T tile by tile on chip, W (1 - decay) - coef H in FP32, stochastic rounding, one
  store, ``||W_new||^2`` from the same pass, coefficients on the device); achieved GB/s counts
  4 bytes per element (read + write BF16 W), also as a fraction of the copy bandwidth
  (target >= 0.8);
* ``grouped``: the same update over 8 stacks of this shape in one launch, per stack
  (``grouped_us_per_stack``; what a model's layers of one shape cost);
* ``torch``: ``rgc.ops.reference.lowrank_update_``, H rebuilt 128 rows at a time
  (target: fused >= 2x faster);
* ``adamw``: one ``torch.optim.AdamW(fused=True)`` step on a BF16 parameter of the same shape;
* ``norm``: ``rgc.ops.triton.sum_squares``, the separate pass over W that the update's
  ``sq_norms`` saves;
* ``mismatch_vs_torch``: fraction of elements where the fused and torch paths differ (the
  same seed; they differ only where FP32 summation order moves a value across a rounding
  threshold).

A second table sweeps tile sizes and the number of BF16 parts of U (precision vs time).
Every timing is the median over repetitions with the L2 cache flushed before each.

``--step`` times a whole ``RGCOptimizer.step()`` on the projections of a model config
(default Qwen3-1.7B: q, k, v, o, gate, up, down of every decoder layer, BF16; public API:
``rgc.wrap`` and ``rgc.RGCOptimizer``) against ``torch.optim.AdamW(fused=True)`` on the same
weights, counts host synchronisations (``aten._local_scalar_dense``) inside one RGC step, and
counts with the torch profiler the CUDA kernels (and memcpy/memset operations) that one step
launches, at full depth and at half depth: with launches grouped by shape the two counts are
equal.

``--registers`` (CPU, no GPU needed) compiles every kernel configuration ahead of time for
sm_80/sm_90/sm_100 and writes the registers and stack bytes of each (the table in
docs/kernels.md).

    python benchmarks/gpu_kernels.py [--reps 20] [--no-sweep] [--out DIR]
    python benchmarks/gpu_kernels.py --step [--config benchmarks/configs/qwen3-1.7b.json]
    python benchmarks/gpu_kernels.py --registers
    python benchmarks/gpu_kernels.py --smoke [--step]   # tiny shapes on the CPU, interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from rgc.ops import reference as R  # noqa: E402

SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]
RANKS = [64, 128, 256]
GROUP = 8  # stacks per grouped launch
SMOKE_SHAPES = [(48, 80), (33, 130)]
SMOKE_RANKS = [1, 24]
CONFIGS = Path(__file__).resolve().parent / "configs"
# Tiles around the default (64 x 64, r-block 16, 8 warps, 1 stage); maxnreg None lets ptxas
# choose (some of these spill: see --registers and docs/kernels.md).
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, num_warps=w, num_stages=s, maxnreg=None)
         for bm, bn, br, w, s in [(64, 64, 16, 8, 1), (64, 64, 32, 8, 1), (64, 64, 16, 4, 2),
                                  (32, 64, 16, 8, 1), (128, 64, 16, 8, 1), (64, 128, 16, 8, 1),
                                  (64, 128, 32, 4, 2), (128, 128, 32, 8, 2)]]


class Timer:
    """Median wall time of ``fn`` in seconds; CUDA events and an L2 flush on the GPU."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.flush = (torch.empty(256 * 2**20, dtype=torch.int8, device=device)
                      if device.type == "cuda" else None)

    def __call__(self, fn) -> float:
        fn()  # warm-up (compilation, autotuning caches)
        return statistics.median(self.once(fn) for _ in range(self.reps))

    def once(self, fn) -> float:
        """Seconds of one call of ``fn``, the L2 flushed first (GPU)."""
        if self.device.type == "cuda":
            self.flush.zero_()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=timer.device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src))


@dataclasses.dataclass
class Update:
    """The arguments of ``lowrank_update_`` for ``count`` stacks of one d x k matrix."""
    weights: list
    factors: list
    projections: list
    coefs: torch.Tensor
    decays: torch.Tensor
    sq_norms: torch.Tensor

    @classmethod
    def build(cls, d: int, k: int, r: int, device, count: int = 1, seed: int = 0,
              coef: float = 2e-5):
        g = torch.Generator(device=device).manual_seed(seed)
        ws = [(torch.randn(1, d, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
              for _ in range(count)]
        us = [torch.randn(1, d, r, generator=g, device=device) for _ in range(count)]
        ps = [(torch.randn(k, r, generator=g, device=device) / r**0.5).to(torch.bfloat16)
              for _ in range(count)]
        # |coef H| ~ 0.1% of |W|: a training-sized step
        coefs = torch.full((count, 1), coef, device=device)
        return cls(ws, us, ps, coefs, torch.full((count, 1), 1e-4, device=device),
                   torch.empty(count, 1, device=device))

    def args(self, seed: int = 1, sq_norms: bool = True) -> tuple:
        n = len(self.weights)
        return (self.weights, self.factors, self.projections, self.coefs, self.decays,
                [seed + m for m in range(n)], [0] * n, [w.shape[2] for w in self.weights],
                True, 128, self.sq_norms if sq_norms else None)


def bench_shape(timer: Timer, d: int, k: int, r: int, copy_bps: float, kernels,
                group_size: int = GROUP) -> dict:
    device = timer.device
    one = Update.build(d, k, r, device)
    t_fused = timer(lambda: kernels.lowrank_update_(*one.args()))
    t_torch = timer(lambda: R.lowrank_update_(*one.args()))
    t_norm = timer(lambda: kernels.sum_squares(one.weights, 128))
    group = Update.build(d, k, r, device, count=group_size)
    t_group = timer(lambda: kernels.lowrank_update_(*group.args()))

    param = torch.nn.Parameter(one.weights[0][0].clone())
    param.grad = torch.randn_like(param) * 1e-3
    adamw = torch.optim.AdamW([param], lr=1e-6, fused=device.type == "cuda")
    t_adamw = timer(adamw.step)
    del param, adamw

    # A 1% step (a few BF16 ulps), so that every rounding decision matters.
    fused = Update.build(d, k, r, device, seed=3, coef=2e-4)
    ref = Update.build(d, k, r, device, seed=3, coef=2e-4)
    kernels.lowrank_update_(*fused.args(seed=7))
    R.lowrank_update_(*ref.args(seed=7))
    mismatch = (fused.weights[0].view(torch.int16) != ref.weights[0].view(torch.int16))
    mismatch = mismatch.double().mean().item()

    gbps = 4 * d * k / t_fused / 1e9
    return dict(d=d, k=k, r=r, fused_us=t_fused * 1e6, fused_GBps=gbps,
                fused_vs_copy=gbps / (copy_bps / 1e9),
                grouped_us_per_stack=t_group / group_size * 1e6, torch_us=t_torch * 1e6,
                fused_speedup_vs_torch=t_torch / t_fused, adamw_fused_us=t_adamw * 1e6,
                norm_us=t_norm * 1e6, mismatch_vs_torch=mismatch)


def run(launches: list[tuple]) -> None:
    """Run launches built by a ``*_launches`` function of rgc.ops.triton."""
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)


def sweep(timer: Timer, d: int, k: int, ranks, configs, kernels) -> list[dict]:
    rows = []
    for r in ranks:
        one = Update.build(d, k, r, timer.device)
        for c_parts in (1, 2, 3):
            for cfg in configs:
                config = dict(cfg, C_PARTS=c_parts)
                a = one.args()
                launches = kernels.update_launches(*a[:9], a[10], config=config)
                try:
                    t = timer(lambda: run(launches))  # noqa: B023
                except Exception as exc:  # e.g. out of shared memory for this tile
                    print(f"config {config} failed: {type(exc).__name__}: {exc}")
                    continue
                rows.append(dict(d=d, k=k, r=r, **config, us=t * 1e6,
                                 GBps=4 * d * k / t / 1e9))
    return rows


class Projections(torch.nn.Module):
    """The compressed linears of a decoder stack (Qwen/Llama names), chained cheaply.

    Each block maps x (n, h) to ``x + o(q(x)) + down(gate(x) * up(x))`` and adds the mean of
    ``k(x)`` and ``v(x)`` to the output, so every projection receives a gradient.
    """

    def __init__(self, config: dict):
        super().__init__()
        from benchmarks.step_model import linear_shapes

        self.blocks = torch.nn.ModuleList()
        for _ in range(config["num_hidden_layers"]):
            block = torch.nn.Module()
            for name, d, k in linear_shapes(config):
                setattr(block, name, torch.nn.Linear(k, d, bias=False))
            self.blocks.append(block)

    def forward(self, x):
        for b in self.blocks:
            extra = (b.k_proj(x).mean() + b.v_proj(x).mean()) * 1e-3
            x = x + b.o_proj(b.q_proj(x)) * 1e-2 + b.down_proj(b.gate_proj(x) * b.up_proj(x)) \
                * 1e-2 + extra
        return x


class _CountSyncs:
    """Counts ``aten._local_scalar_dense`` (host reads of device values) while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self._mode = 0, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def profiled_launches(fn) -> dict:
    """CUDA kernels, memcpy and memset operations that ``fn()`` puts on the GPU, counted by
    the torch profiler (``None`` each without CUDA)."""
    if not torch.cuda.is_available():
        return dict(cuda_kernels=None, memcpys=None, memsets=None)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    memcpys = sum(n.startswith("Memcpy") for n in names)
    memsets = sum(n.startswith("Memset") for n in names)
    return dict(cuda_kernels=len(names) - memcpys - memsets, memcpys=memcpys, memsets=memsets)


def _backward(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()


def _step_time(timer: Timer, model, opt, x) -> float:
    """Median time of ``opt.step()`` alone, a fresh forward/backward before each (untimed)."""
    times = []
    for _ in range(timer.reps + 1):  # the first is a warm-up (compilation)
        _backward(model, opt, x)
        times.append(timer.once(opt.step))
    return statistics.median(times[1:])


def bench_step(timer: Timer, config: dict, name: str, ranks, tokens: int) -> list[dict]:
    """Whole ``RGCOptimizer.step()`` vs ``AdamW(fused=True)`` on the projections of ``config``,
    with its launches counted; the first rank also at half depth."""
    import rgc

    device = timer.device
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, config["hidden_size"], generator=g).to(device, torch.bfloat16)
    rows = []
    depths = [config["num_hidden_layers"], max(1, config["num_hidden_layers"] // 2)]
    for depth in depths:
        cfg = dict(config, num_hidden_layers=depth)
        torch.manual_seed(0)
        dense = Projections(cfg).to(device, torch.bfloat16)
        n_params = sum(p.numel() for p in dense.parameters())
        adamw = torch.optim.AdamW(dense.parameters(), lr=1e-6, fused=device.type == "cuda")
        t_adamw = _step_time(timer, dense, adamw, x)
        del adamw
        for r in ranks if depth == depths[0] else ranks[:1]:
            model = Projections(cfg).to(device, torch.bfloat16)
            model.load_state_dict(dense.state_dict())
            rgc.wrap(model, rank=r, seed=1)
            opt = rgc.RGCOptimizer(model.parameters(), lr=1e-3, seed=5)
            t_rgc = _step_time(timer, model, opt, x)
            _backward(model, opt, x)
            with _CountSyncs() as syncs:
                opt.step()
            _backward(model, opt, x)
            launches = profiled_launches(opt.step)
            rows.append(dict(config=name, layers=depth, r=r, params=n_params,
                             rgc_step_ms=t_rgc * 1e3, adamw_fused_step_ms=t_adamw * 1e3,
                             rgc_vs_adamw=t_rgc / t_adamw,
                             floor_ms_at_copy_bw=4 * n_params / timer.copy_bps * 1e3,
                             syncs_per_step=syncs.count, **launches))
            del model, opt
        del dense
    return rows


def registers(out) -> list[dict]:
    """Registers and stack bytes of every kernel configuration, compiled ahead of time."""
    from tools import aot

    reason = aot.toolchain_missing()
    if reason is not None:
        raise SystemExit(f"cannot compile ahead of time: {reason}")
    rows = [dataclasses.asdict(u) for u in aot.all_usage(aot.supported_archs())]
    kwargs = {} if out is None else dict(directory=out)
    write_results("kernel_registers", rows, title="Kernel resources, compiled ahead of time",
                  notes="Per thread: registers and stack bytes (a spill needs stack; 0 = "
                  "spill-free); local and shared bytes per block. Compiled with the Triton "
                  "wheel's ptxas, read with its cuobjdump (tools/aot.py); one row per distinct "
                  "specialisation, named by the first case that needs it.", **kwargs)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU through the Triton interpreter")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile/precision sweep")
    ap.add_argument("--step", action="store_true",
                    help="time whole optimizer steps (RGC vs fused AdamW) instead of kernels")
    ap.add_argument("--config", type=Path, default=CONFIGS / "qwen3-1.7b.json",
                    help="model config.json for --step")
    ap.add_argument("--tokens", type=int, default=512, help="batch tokens for --step")
    ap.add_argument("--registers", action="store_true",
                    help="AOT-compile every kernel configuration and tabulate its registers")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    args = ap.parse_args(argv)
    kwargs = {} if args.out is None else dict(directory=args.out)
    if args.registers:
        return registers(args.out)

    from rgc.ops import triton as kernels

    if args.smoke:
        device, shapes, ranks, reps = torch.device("cpu"), SMOKE_SHAPES, SMOKE_RANKS, 1
        nbytes = 2**20
        if not kernels.INTERPRETED:
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 before the kernels are loaded")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke for the CPU interpreter check")
        device, shapes, ranks, reps, nbytes = torch.device("cuda"), SHAPES, RANKS, args.reps, 2**30
    timer = Timer(device, reps)
    copy_bps = timer.copy_bps = copy_bandwidth(timer, nbytes)
    print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s")
    mode = "smoke run (CPU, Triton interpreter: timings meaningless)" if args.smoke else "GPU"

    if args.step:
        config = json.loads(args.config.read_text())
        name = args.config.stem
        if args.smoke:
            config = dict(config, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
            name += " (smoke: tiny shapes)"
        rows = bench_step(timer, config, name, ranks, 8 if args.smoke else args.tokens)
        notes = (f"{mode}. Whole optimizer steps on the projections of {args.config.name} "
                 f"(BF16 weights, {args.tokens} tokens per backward, untimed): median of "
                 f"{reps} opt.step() timings with CUDA events, L2 flushed before each. "
                 "AdamW: torch.optim.AdamW(fused=True), BF16 states. floor_ms_at_copy_bw: "
                 "read + write every BF16 weight once at the measured copy bandwidth "
                 f"({copy_bps / 1e9:.1f} GB/s). syncs_per_step: aten._local_scalar_dense "
                 "calls in one RGC step (host synchronisations). cuda_kernels, memcpys, "
                 "memsets: what one opt.step() puts on the GPU, counted by the torch profiler "
                 "(empty without CUDA); the half-depth row has the same shapes and half the "
                 "layers.")
        write_results("gpu_step" + ("_smoke" if args.smoke else ""), rows,
                      title="Whole optimizer step: RGC vs fused AdamW", notes=notes, **kwargs)
        return rows

    group_size = 2 if args.smoke else GROUP
    rows = [bench_shape(timer, d, k, r, copy_bps, kernels, group_size) for d, k in shapes
            for r in ranks]
    notes = (f"{mode}. Copy bandwidth (read + write, {nbytes / 2**20:.0f} MiB): "
             f"{copy_bps / 1e9:.1f} GB/s. fused_GBps counts 4 bytes per element of W. "
             f"grouped: {group_size} stacks of the shape in one launch, per stack. "
             "Targets: fused_vs_copy >= 0.8, fused_speedup_vs_torch >= 2. Median of "
             f"{reps} repetitions, L2 flushed before each.")
    write_results("gpu_kernels" + ("_smoke" if args.smoke else ""), rows,
                  title="Fused low-rank update kernel", notes=notes, **kwargs)
    if not args.no_sweep:
        configs = SWEEP[:2] if args.smoke else SWEEP
        sweep_rows = sweep(timer, *shapes[0], ranks[:1] if args.smoke else ranks, configs,
                           kernels)
        one = Update.build(*shapes[0], 64, device)
        default = kernels.update_config(one.weights[0], one.factors[0], one.projections[0],
                                         True, None)
        write_results("gpu_kernels_sweep" + ("_smoke" if args.smoke else ""), sweep_rows,
                      title="Fused update: tiles and number of BF16 parts of U",
                      notes=f"{mode}. Default (aligned, r = 64): {default}", **kwargs)
    return rows


if __name__ == "__main__":
    main()
