"""CPU: what the pieces of the reference step cost, one at a time (the parts of the rows of
``optimizer_step_cpu.py``).

Per call (the mean of 100 in a row): one call of a compiled loop on 64 elements (dynamo,
the AOT wrapper and rgc's variant key: what every chunk pays once) beside one eager torch
operation. Per element, on one chunk of ``2**18`` elements held in cache
(``rgc.updates.CHUNK_ELEMENTS``): the counter hash alone, the compiled update pass
(multiply-subtract, hash, rounding to BF16 patterns), the narrowing of the patterns into W,
and the float64 weight norm of the stored chunk. Per refresh, for the projections of the
benchmark's layers (grouped by shape, as the optimizer refreshes them): the Box-Muller
Gaussians and their CholeskyQR into BF16 P.

``--first-use`` adds what a new process pays for its first refresh of the same projections
(CPU time, its compiler processes included): with an empty inductor cache (rgc's loops
compiled, the Box-Muller loop foremost), again with that cache warm (traced, then loaded), and
with dynamo off (``TORCHDYNAMO_DISABLE=1``: the loops run as eager torch operations, with the
same bits), and with dynamo off the refresh itself (the median of five after the first).

``--previous DIR`` adds the same pieces of the previous version (DIR a checkout of 7982e6c,
as for ``optimizer_step_cpu.py --previous``), whose loops were C compiled at run time and called
through ctypes: one call, its rounding loop without and with its float64 norm lanes, and its
Gaussians (it rounded FP32 values, so its loop has no multiply-subtract).

Times are the CPU time of the calling thread with one torch thread, medians over interleaved
repetitions.

    python benchmarks/cpu_loop_costs.py [--scale 4] [--layers 2] [--rank 64] [--reps 31]
        [--first-use] [--previous DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks.common import python_last_line, write_results  # noqa: E402
from benchmarks.optimizer_step_cpu import layer_shapes  # noqa: E402
from rgc.ops import reference  # noqa: E402
from rgc.updates import CHUNK_ELEMENTS  # noqa: E402

#: Calls timed together where one call's cost is measured.
CALLS = 100
SCALE = {"us": 1e6, "ns": 1e9, "ms": 1e3, "s": 1.0}

#: What a new process runs for ``--first-use``: P of each k (BF16, k x rank) refreshed once,
#: then five times more; it prints the first refresh's CPU seconds (its own and its waited-for
#: children's, with inductor compiling in the process) and the later ones' median.
FIRST_REFRESH = """
import json, resource, statistics, sys, time
sys.path.insert(0, {src!r})
import torch
torch.set_num_threads(1)
from rgc.ops import make_projections_

def cpu():
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

outs = [torch.empty(k, {rank}, dtype=torch.bfloat16) for k in {ks!r}]
seeds = list(range(len(outs)))
with torch.no_grad():
    start = cpu()
    make_projections_(outs, "orthonormal", seeds)
    first = cpu() - start
    later = []
    for _ in range(5):
        start = time.thread_time()
        make_projections_(outs, "orthonormal", seeds)
        later.append(time.thread_time() - start)
print(json.dumps({{"first": first, "later": statistics.median(later)}}))
"""


def calls(fn):
    """``fn`` called :data:`CALLS` times in a row."""
    def work():
        for _ in range(CALLS):
            fn()
    return work


def build(counts: dict[int, int], rank: int) -> dict:
    """name -> (work, unit count, unit[, (name, unit count, unit) of a second row from the same
    timing]): each work function runs the piece once. ``counts``: projections per in_features
    k, grouped as the optimizer refreshes them."""
    n = CHUNK_ELEMENTS
    keys = torch.tensor([1, 2, 3], dtype=torch.int32)
    small, words = torch.empty(64, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    hash_loop = reference._compiled(reference._hash_words)
    update_loop = reference._compiled(reference._update_words)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    h0 = torch.randn(n, generator=gen) * 1e-3
    h, one = h0.clone(), torch.ones(())
    buffer = torch.empty(n // 2, dtype=torch.float64)
    four = torch.randn(4, generator=gen)

    def update():
        h.copy_(h0)  # the pass consumes its chunk of H
        update_loop(w, h, one, keys)

    def copy_only():
        h.copy_(h0)

    outs = {k: [torch.empty(k, rank, dtype=torch.bfloat16) for _ in range(count)]
            for k, count in counts.items()}
    g = {k: reference._gaussians(k, rank, list(range(count)), torch.device("cpu"))[:, :, :rank]
         for k, count in counts.items()}

    def make_gaussians():
        for k, count in counts.items():
            reference._gaussians(k, rank, list(range(count)), torch.device("cpu"))

    def orthonormalize():
        for k in counts:
            reference._orthonormal_into(outs[k], g[k], (k / rank) ** 0.5, False)

    return {
        "compiled loop, one call (64 elements)": (calls(lambda: hash_loop(small, keys)),
                                                  CALLS, "us"),
        "eager torch op, one call (torch.dot, 4 elements)": (
            calls(lambda: torch.dot(four, four)), CALLS, "us"),
        "counter hash alone (compiled), per element": (lambda: hash_loop(words, keys), n,
                                                       "ns"),
        "update pass (compiled), per element": (update, n, "ns"),
        "  its copy of H (subtracted above)": (copy_only, n, "ns"),
        "patterns narrowed into W, per element": (
            lambda: w.view(torch.int16).copy_(words), n, "ns"),
        "weight norm (square_sum, float64), per element": (
            lambda: reference.square_sum(w.view(-1, 512), buffer), n, "ns"),
        "Box-Muller Gaussians (compiled), per refresh": (make_gaussians, 1, "ms",
                                                         per_gaussian(counts, rank)),
        "CholeskyQR into BF16 P, per refresh": (orthonormalize, 1, "ms"),
    }


def per_gaussian(counts: dict[int, int], rank: int) -> tuple[str, int, str]:
    """The second row of a refresh's Gaussians: per Gaussian (every k x r projection's)."""
    return ("  per Gaussian", sum(count * k * rank for k, count in counts.items()), "ns")


def first_refresh(ks: list[int], rank: int, env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds of the first refresh, median CPU seconds of the next five) of a new process
    refreshing one k x ``rank`` P for each of ``ks``, ``env`` added to this one's environment."""
    code = FIRST_REFRESH.format(src=str(ROOT / "src"), rank=rank, ks=ks)
    result = json.loads(python_last_line(code, env={**os.environ, **env}))
    return result["first"], result["later"]


def first_use_rows(counts: dict[int, int], rank: int) -> list[dict]:
    """The ``--first-use`` rows: new processes, inductor compiling in the process."""
    ks = [k for k, count in counts.items() for _ in range(count)]
    with tempfile.TemporaryDirectory() as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        cold, _ = first_refresh(ks, rank, env)
        warm, _ = first_refresh(ks, rank, env)
    eager_first, eager_later = first_refresh(ks, rank, {"TORCHDYNAMO_DISABLE": "1"})
    return [{"piece": piece, "time": round(seconds * SCALE[unit], 3), "unit": unit}
            for piece, seconds, unit in [
                ("first refresh of a new process, empty inductor cache", cold, "s"),
                ("first refresh of a new process, inductor cache warm", warm, "s"),
                ("first refresh of a new process, dynamo off", eager_first, "s"),
                ("refresh with dynamo off (eager loops), per refresh", eager_later, "ms")]]


def build_previous(checkout: Path, counts: dict[int, int], rank: int) -> dict:
    """The previous version's C loops on the same data (its ``_native`` module, loaded alone:
    it imports nothing of rgc)."""
    spec = importlib.util.spec_from_file_location(
        "previous_native", checkout / "src" / "rgc" / "_native.py")
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    lib = native.library()
    if lib is None:
        raise RuntimeError(f"the C loops of {checkout} did not compile")
    n = CHUNK_ELEMENTS
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out, small = torch.empty(n, dtype=torch.bfloat16), torch.empty(64, dtype=torch.int32)
    lanes = np.zeros(native.LANES)
    half = (rank + 1) // 2
    g = {k: torch.empty(k, 2 * half) for k in counts}

    def round_chunk(with_lanes: bool):
        return lambda: lib.rgc_round_bf16(x.data_ptr(), out.data_ptr(), n, 1, 2, 3, 3, n,
                                          lanes.ctypes.data if with_lanes else None)

    def make_gaussians():
        for k, count in counts.items():
            for seed in range(count):
                lib.rgc_gaussian(g[k].data_ptr(), k, half, 2 * half, seed, seed + 1)

    return {
        "previous: C loop, one call (64 elements)": (
            calls(lambda: lib.rgc_hash_words(small.data_ptr(), 64, 1, 2, 3, 3, 64)), CALLS,
            "us"),
        "previous: C rounding loop, per element": (round_chunk(False), n, "ns"),
        "previous: C rounding loop with its float64 norm, per element": (round_chunk(True), n,
                                                                         "ns"),
        "previous: C Gaussians, per refresh": (make_gaussians, 1, "ms",
                                               per_gaussian(counts, rank)),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    ap.add_argument("--first-use", action="store_true",
                    help="add the first refresh of new processes (a minute or more of CPU)")
    ap.add_argument("--previous", type=Path, default=None,
                    help="a checkout of the previous version, its C loops measured beside")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            counts = collections.Counter(k for _, _, k in layer_shapes(args.scale) * args.layers)
            pieces = build(counts, args.rank)
            if args.previous is not None:
                pieces.update(build_previous(args.previous, counts, args.rank))
            for work, *_ in pieces.values():  # compile and warm up outside the timing
                work(), work()
            times: dict[str, list[float]] = {name: [] for name in pieces}
            for _ in range(args.reps):
                for name, (work, *_) in pieces.items():
                    t = time.thread_time()
                    work()
                    times[name].append(time.thread_time() - t)
    finally:
        torch.set_num_threads(threads)
    copy = statistics.median(times["  its copy of H (subtracted above)"])
    rows = []
    for name, (_, count, unit, *second) in pieces.items():
        seconds = statistics.median(times[name])
        if name.startswith("update pass"):
            seconds -= copy
        for row_name, units, scale in [(name, count, unit), *second]:
            rows.append({"piece": row_name, "time": round(seconds / units * SCALE[scale], 3),
                         "unit": scale})
    notes = (f"{args.layers} Qwen3-1.7B decoder layers' projections scaled by 1/{args.scale}, "
             f"rank {args.rank}; chunks of {CHUNK_ELEMENTS} elements in cache; CPU time of one "
             f"thread, median of {args.reps} interleaved repetitions. The step of "
             "optimizer_step_cpu.py pays the per-call cost once per chunk and loop, and reads W "
             "from memory.")
    if args.first_use:
        rows += first_use_rows(counts, args.rank)
        notes += (" The first-refresh rows: one new process each, the CPU time of its first "
                  "refresh, its compiler subprocesses included; with dynamo off, the median of "
                  "its next five refreshes too.")
    kwargs = {} if args.out is None else {"directory": args.out}
    write_results("cpu_loop_costs", rows, title="Costs of the CPU step's pieces", notes=notes,
                  **kwargs)
    return rows


if __name__ == "__main__":
    main()
