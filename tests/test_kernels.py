"""rgc.kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Triton decides between compiling and interpreting when a kernel is defined, i.e. when
``rgc.kernels._triton`` is imported, so the fixture below sets the variable and (re)loads that
module before any kernel runs, and restores both afterwards.
"""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import rgc
from rgc import RGCOptimizer, stochastic_round

pytest.importorskip("triton")

import rgc.kernels as K  # noqa: E402
from tests.bf16_checks import (  # noqa: E402
    MAX_MISMATCH,
    assert_close_bf16,
    bf16_ulp_distance,
    bits16,
)
from tests.host_reads import CountHostReads  # noqa: E402

BF16_MAX_BITS = 0x7F7F0000


def _reload_backend():
    if "rgc.kernels._triton" in sys.modules:
        importlib.reload(sys.modules["rgc.kernels._triton"])
    else:
        importlib.import_module("rgc.kernels._triton")


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _reload_backend()
        yield
    _reload_backend()


def reference_update(weight, sketch, projection, coef, *, seed, offset, stochastic=True):
    """Dense float64 ``W - coef * C P^T``, rounded once to FP32, then written as W's dtype."""
    new = (weight.double() - coef * (sketch.double() @ projection.double().t())).float()
    if weight.dtype == torch.float32:
        return new
    return stochastic_round(new, seed=seed, offset=offset) if stochastic else new.bfloat16()


def problem(d, k, r, *, p_dtype=torch.bfloat16, w_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=g).to(w_dtype)
    sketch = torch.randn(d, r, generator=g)
    projection = (torch.randn(k, r, generator=g) / math.sqrt(r)).to(p_dtype)
    return weight, sketch, projection


# ---------------------------------------------------------------------------------- rounding

SPECIALS = torch.tensor(
    [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
     BF16_MAX_BITS, BF16_MAX_BITS | 0x80000000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,
     0x00000001, 0x80000001, 0x0000FFFF, 0x00010000, 0x007FFFFF, 0x807FFFFF, 0x00800000,
     0x3F800000, 0x3F800001, 0xBF80FFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)


def random_fp32(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (all classes: normal, subnormal, inf, NaN), Gaussians and specials."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64)
    x = patterns.to(torch.int32).view(torch.float32).clone()
    gauss = torch.rand(n, generator=g) < 0.5
    x[gauss] = torch.randn(int(gauss.sum()), generator=g) * 10.0 ** torch.randint(
        -40, 38, (int(gauss.sum()),), generator=g)
    pos = torch.randint(0, n, (min(n, len(SPECIALS)),), generator=g)
    x[pos] = SPECIALS[: len(pos)]
    return x


def assert_same_rounding(out, ref):
    nan = torch.isnan(ref.float())
    assert torch.equal(torch.isnan(out.float()), nan)
    assert torch.equal(bits16(out)[~nan], bits16(ref)[~nan])


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**63 - 1),
       offset=st.one_of(st.integers(0, 2**20), st.integers(2**32 - 3000, 2**32 + 10),
                        st.integers(0, 2**45)), data_seed=st.integers(0, 2**31))
def test_rounding_kernel_bit_identical(n, seed, offset, data_seed):
    x = random_fp32(n, data_seed)
    assert_same_rounding(K.stochastic_round(x, seed=seed, offset=offset),
                         stochastic_round(x, seed=seed, offset=offset))


def test_rounding_kernel_specials_and_layouts():
    out = K.stochastic_round(SPECIALS, seed=3)
    assert_same_rounding(out, stochastic_round(SPECIALS, seed=3))
    # BF16-representable values (+-0, subnormals, BF16 max, inf) come back unchanged.
    exact = SPECIALS[SPECIALS.bfloat16().float() == SPECIALS]
    assert len(exact) == 9  # +-0, +-inf, +-BF16 max, a subnormal, the smallest normal, 1
    assert torch.equal(bits16(K.stochastic_round(exact, seed=9)), bits16(exact.bfloat16()))
    # A transposed (non-contiguous) input and output: flat index = logical row-major order.
    x = torch.randn(37, 21).t()
    out = torch.empty(33, 37, 21, dtype=torch.bfloat16)[0].t()
    K.stochastic_round_(out, x, seed=5, offset=7)
    assert_same_rounding(out, stochastic_round(x, seed=5, offset=7))
    half = torch.randn(99).half()
    assert_same_rounding(K.stochastic_round(half, seed=1), stochastic_round(half, seed=1))


# ---------------------------------------------------------------------------- fused update

@given(k=st.integers(1, 60), r=st.integers(1, 40), seed=st.integers(0, 2**63 - 1))
def test_gaussian_kernel_has_the_cpu_bits(k, r, seed):
    # The kernel performs the CPU definition's float32 operations one by one (the compiled
    # loop and its numpy twin agree bit for bit, tests/test_projection.py).
    from rgc.projection import gaussian_matrix

    got = K.gaussian_matrix(k, r, seed=seed, device="cpu")
    assert got.shape == (k, r) and got.dtype == torch.float32
    assert torch.equal(got, gaussian_matrix(k, r, seed=seed))


def test_gaussian_kernel_covers_several_programs():
    from rgc.projection import gaussian_matrix

    k, r = 70, 33  # 1190 pairs: two programs of 1024
    assert torch.equal(K.gaussian_matrix(k, r, seed=9, device="cpu"),
                       gaussian_matrix(k, r, seed=9))


@pytest.mark.parametrize("d,k,r", [(1, 1, 1), (37, 53, 7), (70, 129, 24), (65, 200, 64),
                                   (33, 150, 100), (130, 17, 1)])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_fused_update_bf16_matches_float64(d, k, r, p_dtype):
    weight, sketch, projection = problem(d, k, r, p_dtype=p_dtype, seed=d * k + r)
    # coef so that the update is several BF16 ulps of W: every rounding decision matters.
    coef = 0.05
    ref = reference_update(weight, sketch, projection, coef, seed=11, offset=3 * k)
    K.lowrank_update_(weight, sketch, projection, coef, seed=11, offset=3 * k)
    assert_close_bf16(weight, ref)


@given(d=st.integers(1, 90), k=st.integers(1, 140), r=st.integers(1, 40),
       seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**40),
       coef=st.floats(-1.0, 1.0), stochastic=st.booleans())
def test_fused_update_random_shapes(d, k, r, seed, offset, coef, stochastic):
    weight, sketch, projection = problem(d, k, r, seed=r)
    ref = reference_update(weight, sketch, projection, coef, seed=seed, offset=offset,
                           stochastic=stochastic)
    K.lowrank_update_(weight, sketch, projection, coef, seed=seed, offset=offset,
                      stochastic_rounding=stochastic)
    assert_close_bf16(weight, ref)


@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_fused_update_fp32_weights(p_dtype):
    d, k, r = 45, 77, 100
    weight, sketch, projection = problem(d, k, r, p_dtype=p_dtype, w_dtype=torch.float32)
    coef = 0.3
    ref64 = weight.double() - coef * (sketch.double() @ projection.double().t())
    scale = weight.double().abs() + coef * (sketch.double().abs() @ projection.double().abs().t())
    K.lowrank_update_(weight, sketch, projection, coef, seed=0)
    # FP32 accuracy: the three-part products are exact to ~2**-24 and the r-term FP32 sum
    # adds at most r roundings.
    assert ((weight.double() - ref64).abs() <= 2.0**-24 * (r + 4) * scale).all()


def test_fused_update_row_and_column_slices():
    d, k, r = 40, 60, 24
    full, sketch, projection = problem(3 * d, k, r)
    sketch = sketch[d:2 * d]
    before = full.clone()
    rows = full[d:2 * d]
    ref = reference_update(rows, sketch, projection, 0.05, seed=2, offset=d * k)
    K.lowrank_update_(rows, sketch, projection, 0.05, seed=2, offset=d * k)
    assert_close_bf16(full[d:2 * d], ref)
    assert torch.equal(bits16(full[:d]), bits16(before[:d]))
    assert torch.equal(bits16(full[2 * d:]), bits16(before[2 * d:]))

    # A column slice: row stride 71 != k; the flat index still uses k = 60.
    wide, _, _ = problem(d, 71, r, seed=1)
    before = wide.clone()
    view = wide[:, 5:5 + k]
    assert view.stride(0) != k
    ref = reference_update(view, sketch, projection, 0.05, seed=4, offset=0)
    K.lowrank_update_(view, sketch, projection, 0.05, seed=4)
    assert_close_bf16(wide[:, 5:5 + k], ref)
    assert torch.equal(bits16(wide[:, :5]), bits16(before[:, :5]))
    assert torch.equal(bits16(wide[:, 5 + k:]), bits16(before[:, 5 + k:]))


def test_fused_update_builds_no_fp32_tensor_of_h_rows():
    # Under the interpreter the launcher allocates no new FP32 storage at all; in particular no
    # FP32 tensor reaches 16 rows of H (16 x 160).
    # On a GPU, tests/test_kernels_gpu.py bounds the peak memory of the compiled kernel.
    d, k, r = 96, 160, 8
    weight, sketch, projection = problem(d, k, r)
    K.lowrank_update_(weight, sketch, projection, 0.1, seed=1)
    with rgc.memory.track() as rec:
        K.lowrank_update_(weight, sketch, projection, 0.1, seed=1)
    fp32 = [math.prod(a.shape) for a in rec.allocations if a.dtype == torch.float32]
    assert all(n < 16 * k for n in fp32), fp32  # tests/test_memory_track.py: it sees such ones


def test_fused_update_bad_input_leaves_weight_unchanged():
    weight, sketch, projection = problem(20, 30, 8)
    before = weight.clone()
    with pytest.raises(ValueError, match="sketch must be FP32"):
        K.lowrank_update_(weight, sketch.double(), projection, 0.1, seed=0)
    with pytest.raises(ValueError, match="projection must have shape"):
        K.lowrank_update_(weight, sketch, projection[:, :4], 0.1, seed=0)
    with pytest.raises(TypeError, match="BF16 or FP32"):
        K.lowrank_update_(weight.half(), sketch, projection, 0.1, seed=0)
    with pytest.raises(ValueError, match="coef must be a finite"):
        K.lowrank_update_(weight, sketch, projection, math.nan, seed=0)
    with pytest.raises(ValueError, match="offset"):
        K.lowrank_update_(weight, sketch, projection, 0.1, seed=0, offset=-1)
    assert torch.equal(bits16(weight), bits16(before))


# ------------------------------------------------- coef on the device, ||W_new||^2, coef 0

def sq_norm64(weight):
    return (weight.double() ** 2).sum().item()


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_tensor_coef_and_sq_norm_out(w_dtype, p_dtype):
    d, k, r = 70, 150, 20
    weight, sketch, projection = problem(d, k, r, p_dtype=p_dtype, w_dtype=w_dtype, seed=4)
    coef = 0.5  # a large step: ||W_new|| differs from ||W|| by far more than the tolerance
    by_float = weight.clone()
    K.lowrank_update_(by_float, sketch, projection, coef, seed=9, offset=5)
    sq = torch.full((), -1.0)
    coef_t = torch.tensor(coef, dtype=torch.float32)
    with CountHostReads() as syncs:
        K.lowrank_update_(weight, sketch, projection, coef_t, seed=9, offset=5, sq_norm_out=sq)
    assert syncs.count == 0
    assert torch.equal(weight.view(torch.int16 if w_dtype == torch.bfloat16 else torch.int32),
                       by_float.view(torch.int16 if w_dtype == torch.bfloat16 else torch.int32))
    ref = reference_update(*problem(d, k, r, p_dtype=p_dtype, w_dtype=w_dtype, seed=4), coef,
                           seed=9, offset=5)
    assert abs(sq_norm64(ref) / sq_norm64(problem(d, k, r, w_dtype=w_dtype, seed=4)[0]) - 1) > 0.1
    # ||W_new||^2 of the stored values: FP32 sums of d*k squares, tile sums then tile order.
    assert sq.item() == pytest.approx(sq_norm64(weight), rel=1e-6)


def test_sq_norm_out_is_deterministic():
    d, k, r = 130, 200, 33
    results = []
    for _ in range(2):
        weight, sketch, projection = problem(d, k, r, seed=8)
        sq = torch.empty(())
        K.lowrank_update_(weight, sketch, projection, torch.tensor(0.01), seed=1, sq_norm_out=sq)
        results.append((bits16(weight), sq.view(torch.int32).item()))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero", [0.0, -0.0, "tensor"])
def test_coef_zero_keeps_weight_bits_with_nonfinite_sketch(w_dtype, zero):
    d, k, r = 40, 70, 9
    weight, sketch, projection = problem(d, k, r, w_dtype=w_dtype, seed=2)
    weight[0, :4] = torch.tensor([-0.0, 0.0, math.inf, -math.inf])
    weight[1, 0] = math.nan
    ints = torch.int16 if w_dtype == torch.bfloat16 else torch.int32
    before = weight.view(ints).clone()
    sketch[3, 2] = math.nan
    sketch[5, 0] = math.inf
    projection[7, 1] = -math.inf
    coef = torch.zeros(()) if zero == "tensor" else zero
    sq = torch.empty(())
    K.lowrank_update_(weight, sketch, projection, coef, seed=3, sq_norm_out=sq)
    assert torch.equal(weight.view(ints), before)
    finite = problem(d, k, r, w_dtype=w_dtype, seed=2)[0]
    finite[0, :4] = 0.0
    finite[1, 0] = 0.0
    assert math.isnan(sq.item())  # the NaN of W is a stored value
    weight[1, 0], weight[0, 2:4] = 0.0, 0.0
    K.lowrank_update_(weight, sketch, projection, coef, seed=3, sq_norm_out=sq)
    assert sq.item() == pytest.approx(sq_norm64(finite), rel=1e-6)


def test_bad_coef_and_sq_norm_out_leave_weight_unchanged():
    weight, sketch, projection = problem(20, 30, 8)
    before = weight.clone()
    for coef in (torch.tensor(0.1, dtype=torch.float64), torch.tensor([0.1]), math.inf, True):
        with pytest.raises(ValueError, match="coef must be|a tensor coef must be"):
            K.lowrank_update_(weight, sketch, projection, coef, seed=0)
    for out in (torch.empty(1), torch.empty((), dtype=torch.float64)):
        with pytest.raises(ValueError, match="sq_norm_out must be a 0-dim FP32"):
            K.lowrank_update_(weight, sketch, projection, 0.1, seed=0, sq_norm_out=out)
    assert torch.equal(bits16(weight), bits16(before))


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    weight, sketch, projection = problem(4, 4, 2)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.lowrank_update_(weight, sketch, projection, 0.1, seed=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.stochastic_round(sketch, seed=0)


def test_importable_without_triton(monkeypatch):
    # A fresh rgc.kernels with `import triton` failing: import works, a call says what to do.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delattr(rgc, "kernels")
    for name in [m for m in sys.modules if m.startswith("rgc.kernels")]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("rgc.kernels")
    weight, sketch, projection = problem(4, 4, 2)
    with pytest.raises(ImportError, match=r"pip install 'rgc-torch\[triton\]'"):
        fresh.lowrank_update_(weight, sketch, projection, 0.1, seed=0)


# ------------------------------------------------------------------- dispatch and optimizer

def test_dispatch_forced_triton_calls_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(K, "lowrank_update_", lambda *a, **kw: calls.append(kw))
    monkeypatch.setenv("RGC_IMPL", "triton")
    weight, sketch, projection = problem(4, 4, 2)
    rgc.dispatch.lowrank_update_(weight, sketch, projection, 0.1, seed=3, offset=2)
    assert calls == [dict(seed=3, offset=2, stochastic_rounding=True)]
    monkeypatch.setenv("RGC_IMPL", "torch")
    rgc.dispatch.lowrank_update_(weight, sketch, projection, 0.1, seed=3, offset=2)
    assert len(calls) == 1


def _train(impl: str, monkeypatch, steps: int = 3):
    monkeypatch.setenv("RGC_IMPL", impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80, bias=False), nn.Tanh(),
                          nn.Linear(80, 40, bias=False)).to(torch.bfloat16)
    rgc.wrap(model, rank=8, targets=lambda name, module: isinstance(module, nn.Linear), seed=1)
    opt = RGCOptimizer(model.parameters(), lr=0.02, seed=5)
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    return start, [p.detach().clone() for p in model.parameters()]


def test_optimizer_triton_path_matches_torch_path(monkeypatch):
    start, torch_weights = _train("torch", monkeypatch)
    calls = []
    kernel = K.lowrank_update_
    monkeypatch.setattr(K, "lowrank_update_", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    _, triton_weights = _train("triton", monkeypatch)
    assert len(calls) == 2 * 3  # two layers, three steps, all through the kernel
    for w0, a, b in zip(start, triton_weights, torch_weights, strict=True):
        assert (bf16_ulp_distance(w0, b) != 0).double().mean() > 0.5  # the steps moved W
        assert_close_bf16(a, b)


# ---------------------------------------------------------------------------- benchmarks

def test_gpu_benchmark_smoke_mode(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_kernels

    rows = gpu_kernels.main(["--smoke", "--out", str(tmp_path)])
    assert len(rows) == len(gpu_kernels.SMOKE_SHAPES) * len(gpu_kernels.SMOKE_RANKS)
    assert all(row["mismatch_vs_torch"] <= MAX_MISMATCH for row in rows)
    for name in ("gpu_kernels_smoke", "gpu_kernels_sweep_smoke"):
        assert "## Environment" in (tmp_path / f"{name}.md").read_text()
    step = gpu_kernels.main(["--smoke", "--step", "--out", str(tmp_path)])
    assert [row["r"] for row in step] == gpu_kernels.SMOKE_RANKS
    assert all(row["rgc_step_ms"] > 0 and row["adamw_fused_step_ms"] > 0 for row in step)
    assert "## Environment" in (tmp_path / "gpu_step_smoke.md").read_text()


def test_step_model_counts():
    # The model's floor is 4 bytes per projection weight, counted here from the config by
    # hand; every phase costs bytes and launches; the update moves at least the floor.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import step_model

    config = json.loads((step_model.CONFIGS / "qwen3-1.7b.json").read_text())
    h, i, q, kv = 2048, 6144, 16 * 128, 8 * 128
    per_layer = q * h + 2 * kv * h + h * q + 3 * i * h
    rows = {row["phase"]: row for row in step_model.step_rows("x", config, 64)}
    assert rows["floor (read + write BF16 W once)"]["GB"] == pytest.approx(
        4 * 28 * per_layer / 1e9)
    assert rows["update (fused)"]["GB"] > rows["floor (read + write BF16 W once)"]["GB"]
    phases = [p for p in rows if p not in ("total RGC step", "floor (read + write BF16 W once)")
              and not p.startswith("AdamW")]
    assert len(phases) == 4 and all(rows[p]["launches"] > 0 for p in phases)
    assert rows["total RGC step"]["launches"] == sum(rows[p]["launches"] for p in phases)
    assert rows["update (fused)"]["launches"] == 2 * 7 * 28  # update + sum of partials
