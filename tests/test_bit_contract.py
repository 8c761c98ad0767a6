"""One bit contract (docs/design.md): the reductions that feed a coefficient have a fixed
order, or the weight norm's precision, so rgc's results do not depend on the CPU's vector
width, on dynamo, or on batching.

``pairwise_sums`` is checked against the halving order written out plainly in numpy, the
weight norm against the exact sum of squares; the
whole contract by running ``tests/bit_contract.py`` (fixed inputs, digests of every result)
in this process and in fresh ones under each other CPU capability, with dynamo off, and with
MKL on the AVX2 code path an AVX2-only CPU takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rgc import ops
from rgc.ops import reference
from tests.halving import exact_square_sums, halving_sums

ROOT = Path(__file__).resolve().parents[1]

@given(rows=st.integers(1, 6), n=st.integers(1, 300), square=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
       seed=st.integers(0, 2**31 - 1))
def test_pairwise_sums_add_in_the_halving_order(rows, n, square, dtype, seed):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = ops.pairwise_sums(x, square=square)
    want = halving_sums(x, square)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert np.array_equal(got.numpy().view(np.uint8), want.view(np.uint8))
    exact = (x.double() ** 2 if square else x.double()).sum(-1)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * n)


@given(layout=st.sampled_from(["rows", "columns", "column slice"]), e=st.integers(1, 3),
       d=st.integers(1, 60), k=st.integers(1, 400), chunk_rows=st.sampled_from([1, 7, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]), seed=st.integers(0, 2**31 - 1))
def test_sum_squares_is_the_exact_sum_rounded_once(layout, e, d, k, chunk_rows, dtype, scale,
                                                    seed):
    """The weight norm is the FP32 rounding of the exact sum of squares, whatever the layout,
    the chunk and the magnitude (FP32 squares that would over- or underflow included): float64
    squares and sums, whose order can move the FP32 result only where the exact sum lies
    within the float64 error of an FP32 rounding boundary (a chance far below 1e-6 per
    matrix; the suite's draws are fixed)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        w = torch.randn(e, d, k, generator=g)
    elif layout == "columns":
        w = torch.randn(e, k, d, generator=g).transpose(1, 2)
    else:
        w = torch.randn(e, d, k + 5, generator=g)[:, :, 2:k + 2]
    w = (w * scale).to(dtype)
    got = ops.sum_squares([w], chunk_rows)[0]
    want = exact_square_sums(w)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.slow
def test_compiled_and_eager_pairwise_sums_have_the_same_bits():
    """Rows large enough for the compiled loop: its bits are the eager loop's."""
    g = torch.Generator().manual_seed(2)
    for x in [torch.randn(300, 700, generator=g).bfloat16(), torch.randn(9, 5000, generator=g)]:
        got = ops.pairwise_sums(x, square=True)
        eager = reference._halving_sums(x, reference.pairwise_width(x.shape[1]), True)
        assert torch.equal(got.view(torch.int32), eager.view(torch.int32))
        assert np.array_equal(got.numpy(), halving_sums(x, True))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


#: The settings a run of ``tests/bit_contract.py`` chooses; a process started with none of them
#: set is the native run.
SETTINGS = ("ATEN_CPU_CAPABILITY", "TORCHDYNAMO_DISABLE", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def _digests(env: dict[str, str]) -> dict:
    if not env and not any(k in os.environ for k in SETTINGS):
        # the native run is this process (whatever the tests before it compiled or set):
        # a fresh interpreter would cost ~10 s of CPU here
        from tests import bit_contract

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no loop fell back to eager
            return bit_contract.main()
    full = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    full.update(env, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "bit_contract.py")], env=full,
                         capture_output=True, text=True, timeout=600, check=True)
    assert "RuntimeWarning" not in out.stderr, out.stderr  # no loop fell back to eager
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_same_bits_on_every_cpu_capability_and_with_dynamo_off():
    """rgc's own results are bit-identical under ATEN_CPU_CAPABILITY=default and the
    machine's own (avx2 too where the CPU has it) and with dynamo off. Whole steps, which
    also pass through BLAS and LAPACK (the rebuild ``U P^T``, CholeskyQR), are identical
    wherever MKL takes one code path: under every capability and dynamo setting on one
    machine, and between an AVX2-only CPU (emulated: MKL_ENABLE_INSTRUCTIONS=AVX2) and any
    newer one given MKL_CBWR=AVX2."""
    runs = {"native": {}, "default": {"ATEN_CPU_CAPABILITY": "default"},
            "dynamo off": {"TORCHDYNAMO_DISABLE": "1"}}
    flags = _cpu_flags()
    avx2 = "avx2" in flags
    if avx2:
        runs["native, MKL_CBWR=AVX2"] = {"MKL_CBWR": "AVX2"}
        # without AVX-512 or AVX-VNNI, torch and MKL take their AVX2 paths: that run would be
        # the native one
        if flags & {"avx512f", "avx_vnni"}:
            runs["avx2 cpu"] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    got = {name: _digests(env) for name, env in runs.items()}
    for name, digests in got.items():
        assert digests["own"] == got["native"]["own"], name
    for name in ("default", "dynamo off"):
        assert got[name]["step"] == got["native"]["step"], name
    if avx2:
        avx2_cpu = got.get("avx2 cpu", got["native"])
        assert avx2_cpu["step"] == got["native, MKL_CBWR=AVX2"]["step"]
