"""CPU: one RGCOptimizer step (PyTorch reference path) vs one torch.optim.AdamW(foreach) step.

Both optimizers update the same set of layers: the seven projections (q, k, v, o, gate, up,
down) of Qwen3-1.7B decoder layers (hidden 2048, 16 query and 8 key/value heads of 128,
intermediate 6144), every dimension divided by ``--scale`` to fit a small CPU. The RGC step
includes everything ``step()`` does (||H|| from the Gram, ||W||, the chunked rebuild with
stochastic rounding, clearing C, regenerating P); a third row times only the FP32 GEMMs of
the rebuild (2 r flops per weight element); a fourth only the regeneration of every layer's P
(what refresh='every_step' adds); a fifth the GEMMs and the stochastically rounded write of
each chunk and nothing else, the floor of a fixed-P step under rgc's bit convention (the
counter hash of every element is part of it).
AdamW gets the same BF16 weights with BF16 gradients (its state in BF16, as torch keeps it),
and FP32 weights with FP32 gradients.
Timings are medians over interleaved repetitions, the order of the methods rotated at each one;
the ratios (medians of the ratios within each repetition) are what to read. The default clock
is the CPU time of the calling thread (every method runs on it with one torch thread), which a
machine shared with other jobs disturbs far less than wall time; ``--clock wall`` for wall time.

``--previous DIR`` measures another version side by side in the same run: DIR is a checkout
of it (``git worktree add DIR 7982e6c``, or ``git archive 7982e6c | tar -x -C DIR``), whose
``rgc`` a worker process imports; the worker builds the same layers and its own AdamW, and its
steps take their turns in the rotation with this version's (each process times its own
thread). Those rows are written beside this version's and, as the other version's own table,
under ``optimizer_step_cpu_previous/``.

    python benchmarks/optimizer_step_cpu.py [--scale 4] [--layers 2] [--rank 64] [--reps 35]
        [--threads 1] [--clock cpu|wall] [--previous DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# a worker of --previous imports the other checkout's rgc (its src first on the path)
sys.path.insert(0, os.environ.get("RGC_BENCH_SRC", str(ROOT / "src")))

from benchmarks.common import write_results  # noqa: E402
from rgc import CompressedLinear, RGCOptimizer  # noqa: E402

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]

QWEN3_1_7B = dict(hidden=2048, q_out=16 * 128, kv_out=8 * 128, intermediate=6144)


def layer_shapes(scale: int) -> list[tuple[str, int, int]]:
    """(name, d, k) of one decoder layer's projections, every dimension divided by ``scale``."""
    h, q, kv, i = (QWEN3_1_7B[n] // scale for n in ("hidden", "q_out", "kv_out", "intermediate"))
    return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]


def build_rgc(shapes, rank: int, seed: int = 0):
    """``step(refresh)``: one RGCOptimizer step on the same layers, with a new P after the
    update (``refresh=True``) or keeping P. Both rows use these layers, so they share memory
    placement: two identical sets of fixed-P layers built apart were measured up to 5% apart."""
    layers = []
    for n, (_, d, k) in enumerate(shapes):
        layer = CompressedLinear(k, d, bias=False, rank=rank, seed=seed + n, dtype=torch.bfloat16)
        layer.sketch = torch.zeros(d, rank)
        layers.append(layer)
    sketches = [torch.randn(layer.sketch.shape, generator=torch.Generator().manual_seed(n))
                for n, layer in enumerate(layers)]
    opt = RGCOptimizer([layer.weight for layer in layers], lr=1e-3)

    def step(refresh: bool):
        for layer, c in zip(layers, sketches, strict=True):
            layer.refresh = "every_step" if refresh else "never"
            layer.sketch.copy_(c)
        t = clock()
        opt.step()
        return clock() - t
    return step


def build_refresh_only(shapes, rank: int, seed: int = 0):
    """Only the regeneration of every layer's P, as ``refresh='every_step'`` does after a step:
    as the optimizer does it, every P (grouped by shape where the version has
    ``rgc.projection.advance_projections``, layer by layer before), then every sketch slot."""
    layers = [CompressedLinear(k, d, bias=False, rank=rank, seed=seed + n, dtype=torch.bfloat16)
              for n, (_, d, k) in enumerate(shapes)]
    try:
        from rgc.projection import advance_projections
    except ImportError:  # a version that refreshed one layer at a time
        def advance_projections(owners):
            for layer in owners:
                layer.set_projection_version(layer.projection_version + 1,
                                             renew_sketch_slot=False)

    def step():
        t = clock()
        advance_projections(layers)
        for layer in layers:
            layer._new_sketch_slot()
        return clock() - t
    return step


def build_rebuild(shapes, rank: int, *, write: bool = False, seed: int = 0):
    """The FP32 GEMMs that rebuild H chunk by chunk (the optimizer's default chunks), and only
    them: the floor of any CPU RGC step. ``write=True``: each chunk of H is then written into
    W with stochastic rounding by the compiled pass (:func:`rgc.ops.reference._write_rows`),
    and nothing else (no norms, no Gram, no step bookkeeping): as the counter hash of every
    element is fixed by the bit convention, the floor of the fixed-P step of any CPU
    implementation of that convention."""
    from rgc.ops.reference import _write_rows
    from rgc.updates import default_chunk_rows

    mats = [(torch.randn(d, k).to(torch.bfloat16), torch.randn(d, rank),
             torch.randn(k, rank).to(torch.bfloat16)) for _, d, k in shapes]

    def step():
        t = clock()
        for n, (w, c, p) in enumerate(mats):
            d, k = w.shape
            p_t = p.to(torch.float32).t()
            chunk_rows = default_chunk_rows(k)
            h = torch.empty(min(chunk_rows, d), k) if write else None
            for start in range(0, d, chunk_rows):
                rows, c_rows = w[start:start + chunk_rows], c[start:start + chunk_rows]
                if not write:
                    torch.addmm(rows.to(torch.float32), c_rows, p_t, alpha=-1e-3)
                    continue
                part = torch.mm(c_rows, p_t, out=h[:rows.shape[0]])
                _write_rows(rows, part, None, None, seed=seed + n, offset=start * k, row_length=k,
                            stochastic_rounding=True)
        return clock() - t
    return step


def build_sketch_stats(shapes, rank: int):
    """``||C P^T||^2`` of every layer from its two r x r Grams in float64, and only that
    (``rgc.ops.sketch_stats``, what the step's coefficients read): the price of the bit
    contract's order-independent norm, against an FP32 GEMM's."""
    from rgc import ops

    sketches = [torch.randn(1, d, rank) for _, d, _ in shapes]
    projections = [torch.randn(k, rank).to(torch.bfloat16) for _, _, k in shapes]

    def step():
        t = clock()
        ops.sketch_stats(sketches, projections)
        return clock() - t
    return step


def build_adamw(shapes, dtype: torch.dtype):
    params = [nn.Parameter(torch.randn(d, k, dtype=dtype) * 0.02) for _, d, k in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    opt.step()  # create the state outside the timing

    def step():
        t = clock()
        opt.step()
        return clock() - t
    return step


#: The rows of the table, in order.
ROWS = ["rgc (P refreshed every step)", "rgc (P fixed)", "of which: rebuild GEMMs only",
        "of which: GEMMs + rounding pass (floor)", "of which: ||C P^T||^2 (float64 Grams)",
        "of which: P refresh only", "adamw foreach, bf16 params", "adamw foreach, fp32 params"]
#: The rows a --previous worker measures (those every version has), and its prefix.
PREVIOUS_ROWS = ["rgc (P refreshed every step)", "rgc (P fixed)", "of which: P refresh only",
                 "adamw foreach, bf16 params"]
PREVIOUS = "previous: "


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=35,
                    help="repetitions (a multiple of the number of methods, 7 or 11 with "
                         "--previous, puts every method at every position)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: stable figures on a shared machine)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: CPU time of this thread (default); wall: elapsed time")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    ap.add_argument("--previous", type=Path, default=None,
                    help="a checkout of another version, measured side by side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global clock
    threads, previous_clock = torch.get_num_threads(), clock
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    try:
        return serve(args) if args.worker else run(args)
    finally:
        torch.set_num_threads(threads)
        clock = previous_clock


def build_runs(args, names) -> dict:
    shapes = layer_shapes(args.scale) * args.layers
    builders = {
        "rgc (P refreshed every step)": None, "rgc (P fixed)": None,
        "of which: rebuild GEMMs only": lambda: build_rebuild(shapes, args.rank),
        "of which: GEMMs + rounding pass (floor)":
            lambda: build_rebuild(shapes, args.rank, write=True),
        "of which: ||C P^T||^2 (float64 Grams)": lambda: build_sketch_stats(shapes, args.rank),
        "of which: P refresh only": lambda: build_refresh_only(shapes, args.rank),
        "adamw foreach, bf16 params": lambda: build_adamw(shapes, torch.bfloat16),
        "adamw foreach, fp32 params": lambda: build_adamw(shapes, torch.float32),
    }
    rgc_step = build_rgc(shapes, args.rank)
    builders["rgc (P refreshed every step)"] = lambda: lambda: rgc_step(True)
    builders["rgc (P fixed)"] = lambda: lambda: rgc_step(False)
    return {name: builders[name]() for name in names}


def serve(args) -> list[dict]:
    """The --previous worker: builds the rows every version has, then runs the one named on
    each line of stdin and answers its time on stdout."""
    runs = build_runs(args, PREVIOUS_ROWS)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else on the answer channel
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        out.write(f"{runs[line.strip()]()!r}\n")
        out.flush()
    return []


class Previous:
    """A worker process running another checkout's rgc (see :func:`serve`)."""

    def __init__(self, checkout: Path, args):
        env = dict(os.environ, RGC_BENCH_SRC=str(checkout.resolve() / "src"))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--scale",
               str(args.scale), "--layers", str(args.layers), "--rank", str(args.rank),
               "--threads", str(args.threads), "--clock", args.clock]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker for {checkout} did not start")
        self.commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short",
                                      "HEAD"], capture_output=True, text=True).stdout.strip()
        # an archive has no git directory: its directory's name says the version
        self.commit = self.commit or checkout.name

    def step(self, name: str) -> float:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(args) -> list[dict]:
    shapes = layer_shapes(args.scale) * args.layers
    numel = sum(d * k for _, d, k in shapes)
    # Interleaved, so drifting machine load hits every method. Each RGC row runs right after an
    # AdamW step, which streams far more than the caches hold: both rows use the same layers,
    # and the one run right after the other found them in cache (up to 10% faster). The order is
    # rotated at each repetition, so no method always runs first.
    names = ["adamw foreach, bf16 params", "rgc (P refreshed every step)",
             "adamw foreach, fp32 params", "rgc (P fixed)", "of which: rebuild GEMMs only",
             "of which: P refresh only", "of which: GEMMs + rounding pass (floor)",
             "of which: ||C P^T||^2 (float64 Grams)"]
    runs = build_runs(args, names)
    previous = None
    if args.previous is not None:
        previous = Previous(args.previous, args)
        for name in PREVIOUS_ROWS:
            runs[PREVIOUS + name] = lambda name=name: previous.step(name)
        # each of the worker's RGC rows right after one of its AdamW steps, as above
        names = names[:2] + [PREVIOUS + "adamw foreach, bf16 params",
                             PREVIOUS + "rgc (P refreshed every step)"] + names[2:4] + [
            PREVIOUS + "rgc (P fixed)"] + names[4:] + [PREVIOUS + "of which: P refresh only"]
    try:
        for step in runs.values():  # warm-up
            step()
        times = {name: [] for name in runs}
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(runs[name]())
    finally:
        if previous is not None:
            previous.close()

    def ratio(name, reference):  # median over repetitions of the ratio within each one
        return statistics.median(a / b for a, b in zip(times[name], times[reference]))

    def row(name, prefix=""):
        med = statistics.median(times[prefix + name])
        out = dict(method=name, step_ms=1e3 * med, ns_per_param=1e9 * med / numel,
                   vs_adamw_bf16=ratio(prefix + name, prefix + "adamw foreach, bf16 params"),
                   vs_rgc_fixed=ratio(prefix + name, prefix + "rgc (P fixed)"))
        if previous is not None:
            out["vs_previous"] = (ratio(name, PREVIOUS + name) if name in PREVIOUS_ROWS
                                  else float("nan"))
        return out

    rows = [row(name) for name in ROWS]
    setting = (f"{args.layers} Qwen3-1.7B decoder layers' projections scaled by 1/{args.scale} "
               f"({numel / 1e6:.1f} M weights), rank {args.rank}, {args.threads} torch "
               "thread(s), ")
    how = (f"{args.clock} clock, median of {args.reps} interleaved steps; ratios: "
           "median over the repetitions of the ratio within each. "
           "vs_adamw_bf16 < 1 means faster than AdamW; vs_rgc_fixed is the cost relative to "
           "the step with a fixed P (the refresh row: what refreshing P adds).")
    notes = setting + "reference ops (rgc.ops, CPU hash loop through torch.compile), " + how
    kwargs = {} if args.out is None else dict(directory=args.out)
    if previous is not None:
        prev_rows = [row(name, PREVIOUS) for name in PREVIOUS_ROWS]
        for r in prev_rows:
            r.pop("vs_previous")
        notes += (f" vs_previous: this version's time over the previous version's "
                  f"({previous.commit}), measured in the "
                  "same run by a worker process whose steps take their turns in the rotation "
                  f"(its rows under optimizer_step_cpu_previous/, ratios to its own AdamW).")
        prev_dir = (args.out if args.out is not None else ROOT / "benchmarks" / "results")
        write_results("optimizer_step_cpu", prev_rows,
                      title=f"RGC step vs AdamW step (CPU), previous version {previous.commit}",
                      notes=setting + f"commit {previous.commit}, measured side by side with "
                      "this version in one run (see optimizer_step_cpu.md), " + how,
                      directory=prev_dir / "optimizer_step_cpu_previous")
    write_results("optimizer_step_cpu", rows, title="RGC step vs AdamW step (CPU)",
                  notes=notes, **kwargs)
    return rows


if __name__ == "__main__":
    main()
