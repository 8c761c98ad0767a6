"""rgc.ops.triton on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Every launcher against dense float64 (or exact integer) references written here, and against
rgc.ops.reference where the two must agree bit for bit. Triton decides between compiling and
interpreting when a kernel is defined, i.e. when rgc.ops.triton is imported, so the fixture
below sets the variable and (re)loads that module before any kernel runs, and restores both
afterwards. Shapes are small: the interpreter runs each program in Python.
"""

import gc
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import rgc  # noqa: E402
from rgc.bits import mix32, seed_words  # noqa: E402
from rgc.ops import reference as R  # noqa: E402
from rgc.ops import triton_buffers  # noqa: E402
from tests.bf16_checks import MAX_MISMATCH, assert_close_bf16, bits16  # noqa: E402
from tests.halving import exact_square_sums  # noqa: E402
from tests.launches import CountLaunches  # noqa: E402

T = None  # rgc.ops.triton, loaded interpreted by the fixture


def _reload_kernels():
    global T
    if "rgc.ops.triton" in sys.modules:
        T = importlib.reload(sys.modules["rgc.ops.triton"])
    else:
        T = importlib.import_module("rgc.ops.triton")


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _reload_kernels()
        assert T.INTERPRETED
        yield
    _reload_kernels()


# ------------------------------------------------------------------ independent references

M32 = 0xFFFFFFFF


def hash_bits(n: torch.Tensor, seed: int, label: str = "stochastic-round") -> torch.Tensor:
    """The convention of rgc.bits stated on int64 flat indices ``n`` (any shape)."""
    s_lo, s_hi = seed_words(seed, label)
    return mix32(mix32((n & M32) ^ s_lo) ^ (((n >> 32) + s_hi) & M32))


def round_at(x: torch.Tensor, seed: int, index: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` rounded to BF16 with the bits of flat indices ``index`` (same shape)."""
    x_bits = x.float().contiguous().view(torch.int32).to(torch.int64) & M32
    up = ((x_bits + (hash_bits(index, seed) & 0xFFFF)) >> 16) & 0xFFFF
    nan = torch.isnan(x)
    up = torch.where(nan, (x_bits >> 16) | 0x40, up)
    return (up - ((up >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def stack_index(e: int, d: int, k: int, offset: int, row_length: int) -> torch.Tensor:
    """Flat index of element (e, i, j) of a stack: offset + (e d + i) row_length + j."""
    rows = torch.arange(e * d, dtype=torch.int64).view(e, d, 1)
    return offset + rows * row_length + torch.arange(k, dtype=torch.int64)


def dense_update(w, u, p, coef, decay, *, seed, offset, row_length, stochastic=True):
    """Per matrix: float64 ``W (1 - decay) - coef U P^T`` (the factor ``1 - decay`` in FP32, as
    the op defines it), rounded once to FP32, then written as W's dtype; W itself where
    coef == 0 and decay == 0."""
    e, d, k = w.shape
    coef = coef.double().view(e, 1, 1)
    factor = (1.0 - decay.float()).double().view(e, 1, 1)
    new = (w.double() * factor - coef * (u.double() @ p.double().t())).float()
    if w.dtype == torch.bfloat16:
        new = (round_at(new, seed, stack_index(e, d, k, offset, row_length)) if stochastic
               else new.bfloat16())
    keep = ((coef == 0) & (factor == 1)).expand_as(w)
    return torch.where(keep, w, new)


def pattern(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def stacks(count, e, d, k, r, *, w_dtype=torch.bfloat16, p_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(e, d, k, generator=g).to(w_dtype) for _ in range(count)]
    us = [torch.randn(e, d, r, generator=g) for _ in range(count)]
    ps = [(torch.randn(k, r, generator=g) / math.sqrt(r)).to(p_dtype) for _ in range(count)]
    return ws, us, ps


# ---------------------------------------------------------------------------------- rounding

BF16_MAX_BITS = 0x7F7F0000
SPECIALS = torch.tensor(
    [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
     BF16_MAX_BITS, BF16_MAX_BITS | 0x80000000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,
     0x00000001, 0x80000001, 0x0000FFFF, 0x00010000, 0x007FFFFF, 0x807FFFFF, 0x00800000,
     0x3F800000, 0x3F800001, 0xBF80FFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)


def random_fp32(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (all classes: normal, subnormal, inf, NaN), Gaussians and specials."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2**31, 2**31, (n,), generator=g).to(torch.int32).view(torch.float32)
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
def test_rounding_bit_identical(n, seed, offset, data_seed):
    x = random_fp32(n, data_seed)
    out = torch.empty(n, dtype=torch.bfloat16)
    T.stochastic_round_(out, x, seed, offset)
    index = torch.arange(offset, offset + n, dtype=torch.int64)
    assert_same_rounding(out, round_at(x, seed, index))
    ref = torch.empty_like(out)
    R.stochastic_round_(ref, x, seed, offset)
    assert_same_rounding(out, ref)


def test_rounding_specials_and_layouts():
    out = torch.empty(len(SPECIALS), dtype=torch.bfloat16)
    T.stochastic_round_(out, SPECIALS, 3, 0)
    assert_same_rounding(out, round_at(SPECIALS, 3, torch.arange(len(SPECIALS))))
    # BF16-representable values (+-0, subnormals, BF16 max, inf) come back unchanged.
    exact = SPECIALS[SPECIALS.bfloat16().float() == SPECIALS]
    assert len(exact) == 9
    out = torch.empty(len(exact), dtype=torch.bfloat16)
    T.stochastic_round_(out, exact, 9, 0)
    assert torch.equal(bits16(out), bits16(exact.bfloat16()))
    # A transposed (non-contiguous) input and output: flat index = logical row-major order.
    x = torch.randn(37, 21).t()
    out = torch.empty(33, 37, 21, dtype=torch.bfloat16)[0].t()
    T.stochastic_round_(out, x, 5, 7)
    index = torch.arange(21 * 37, dtype=torch.int64).view(21, 37) + 7
    assert_same_rounding(out, round_at(x, 5, index))
    half = torch.randn(99).half()
    out = torch.empty(99, dtype=torch.bfloat16)
    T.stochastic_round_(out, half, 1, 0)
    assert_same_rounding(out, round_at(half.float(), 1, torch.arange(99)))


@given(n=st.integers(0, 2500), seed=st.integers(0, 2**63 - 1),
       offset=st.one_of(st.integers(0, 2**20), st.integers(2**32 - 2500, 2**32 + 10),
                        st.integers(0, 2**60)), label=st.sampled_from(["a", "projection"]))
def test_random_words_are_the_convention(n, seed, offset, label):
    got = T.random_words(n, seed, label, offset, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.shape == (n,)
    want = hash_bits(torch.arange(offset, offset + n, dtype=torch.int64), seed, label)
    assert torch.equal(got.to(torch.int64) & M32, want)
    assert torch.equal(got, R.random_words(n, seed, label, offset, "cpu"))


# --------------------------------------------------------------------------------- Gaussians

@given(k=st.integers(1, 60), r=st.integers(1, 40), seeds=st.lists(
    st.integers(0, 2**63 - 1), min_size=1, max_size=3))
def test_gaussians_have_the_reference_bits(k, r, seeds):
    with CountLaunches() as launches:
        got = T.gaussian_matrices(k, r, seeds, torch.device("cpu"))
    assert launches.triton == 1  # one launch for all seeds
    assert got.shape == (len(seeds), k, r) and got.dtype == torch.float32
    assert torch.equal(got, R.gaussian_matrices(k, r, seeds, "cpu"))


def test_gaussians_follow_box_muller_in_float64():
    # Independent of the float32 polynomials: rho cos(theta), rho sin(theta) in float64 from
    # the published words, u = (a + 1) 2^-24, theta = 2 pi b 2^-24.
    k, r, seed = 70, 33, 9  # 1190 pairs: two programs of 1024
    h = (r + 1) // 2
    got = T.gaussian_matrices(k, r, [seed], torch.device("cpu"))[0]
    words = hash_bits(torch.arange(2 * k * h, dtype=torch.int64), seed, R.GAUSSIAN_LABEL) >> 8
    a, b = words[:k * h].double(), words[k * h:].double()
    rho = torch.sqrt(-2 * torch.log((a + 1) * 2.0**-24))
    theta = 2 * math.pi * b * 2.0**-24
    want = torch.cat([(rho * torch.cos(theta)).view(k, h), (rho * torch.sin(theta)).view(k, h)],
                     dim=1)[:, :r]
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=2e-6)


# ------------------------------------------------------------------------------ the update

def run_update(ws, us, ps, coefs, decays, seeds, offsets, row_lengths, *, stochastic=True,
               sq_norms=None):
    T.lowrank_update_(ws, us, ps, coefs, decays, seeds, offsets, row_lengths, stochastic, 128,
                      sq_norms)


def check_against_dense(before, after, us, ps, coefs, decays, seeds, offsets, row_lengths,
                        stochastic=True):
    for m, (w0, w1) in enumerate(zip(before, after)):
        decay = torch.zeros(w0.shape[0]) if decays is None else decays[m, :w0.shape[0]]
        ref = dense_update(w0, us[m], ps[m], coefs[m, :w0.shape[0]], decay, seed=seeds[m],
                           offset=offsets[m], row_length=row_lengths[m], stochastic=stochastic)
        if w1.dtype == torch.bfloat16:
            assert_close_bf16(w1, ref)
        else:
            scale = (w0.double().abs() + coefs[m, :w0.shape[0]].double().abs().view(-1, 1, 1)
                     * (us[m].double().abs() @ ps[m].double().abs().t()))
            r = us[m].shape[2]
            assert ((w1.double() - ref.double()).abs() <= 2.0**-24 * (r + 4) * scale).all()


@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 37, 53, 7), (3, 70, 129, 24),
                                   (1, 65, 70, 64), (2, 33, 90, 40), (1, 130, 17, 1)])
def test_update_matches_float64(shape, p_dtype):
    e, d, k, r = shape
    ws, us, ps = stacks(2, e, d, k, r, p_dtype=p_dtype, seed=d * k + r)
    # coef so that the update is several BF16 ulps of W: every rounding decision matters.
    coefs = torch.full((2, e), 0.05)
    decays = torch.full((2, e), 0.01)
    before = [w.clone() for w in ws]
    run_update(ws, us, ps, coefs, decays, [11, 12], [3 * k, 2**33 + 1], [k, k])
    check_against_dense(before, ws, us, ps, coefs, decays, [11, 12], [3 * k, 2**33 + 1], [k, k])


@given(e=st.integers(1, 3), d=st.integers(1, 70), k=st.integers(1, 100), r=st.integers(1, 36),
       seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**40),
       coef=st.floats(-1.0, 1.0), decay=st.sampled_from([None, 0.0, 0.1]),
       stochastic=st.booleans(), w_fp32=st.booleans())
def test_update_random_shapes(e, d, k, r, seed, offset, coef, decay, stochastic, w_fp32):
    ws, us, ps = stacks(1, e, d, k, r, w_dtype=torch.float32 if w_fp32 else torch.bfloat16,
                        seed=r)
    coefs = torch.full((1, e), coef)
    decays = None if decay is None else torch.full((1, e), decay)
    before = [w.clone() for w in ws]
    run_update(ws, us, ps, coefs, decays, [seed], [offset], [k], stochastic=stochastic)
    check_against_dense(before, ws, us, ps, coefs, decays, [seed], [offset], [k], stochastic)


def test_a_list_of_stacks_is_one_launch_per_layout():
    e, d, k, r = 2, 40, 70, 9
    ws, us, ps = stacks(4, e, d, k, r, seed=3)
    ws[3] = ws[3].float()  # another layout: its own launch
    coefs = torch.tensor([[0.05, -0.1], [0.2, 0.0], [0.0, 0.1], [0.3, 0.3]])
    decays = torch.tensor([[0.0, 0.1], [0.0, 0.0], [0.05, 0.0], [0.01, 0.02]])
    seeds, offsets, row_lengths = [1, 2, 3, 4], [0, 10, 2**32 - 5, 7], [k] * 4
    before = [w.clone() for w in ws]
    sq = torch.full((4, e), -1.0)
    with CountLaunches() as launches:
        run_update(ws, us, ps, coefs, decays, seeds, offsets, row_lengths, sq_norms=sq)
    assert launches.names["triton:_lowrank_update_kernel"] == 2
    assert launches.names["triton:_finish_kernel"] == 2
    assert launches.host_reads == 0
    check_against_dense(before, ws, us, ps, coefs, decays, seeds, offsets, row_lengths)
    # coef 0 and decay 0 (stack 1, matrix 1): untouched
    assert torch.equal(pattern(ws[1][1]), pattern(before[1][1]))
    # the exact sums of squares rounded once to FP32, as the reference computes them
    want = torch.stack([torch.from_numpy(exact_square_sums(w)) for w in ws])
    assert torch.equal(sq.view(torch.int32), want.view(torch.int32))


def test_launches_do_not_grow_with_the_number_of_stacks():
    def count(n):
        ws, us, ps = stacks(n, 2, 24, 40, 8, seed=n)
        coefs = torch.full((n, 2), 0.1)
        sq = torch.empty(n, 2)
        with CountLaunches() as launches:
            T.lowrank_update_(ws, us, ps, coefs, coefs * 0.1, list(range(n)), [0] * n, [40] * n,
                              True, 128, sq)
            T.sum_squares(ws, 128)
            T.sketch_stats(us, ps)
            T.gaussian_matrices(40, 8, list(range(n)), torch.device("cpu"))
        return launches

    two, four = count(2), count(4)
    assert two.triton == four.triton == 2 + 2 + 3 + 1
    assert two.total == four.total, (two.names, four.names)


def test_offsets_and_row_lengths_select_the_bits_exactly():
    # coef 0 and decay 0.25: W (1 - decay) is exact in FP32 (a BF16 W times 0.75), so the
    # stored bits are the rounding of an exact value: equal to the convention bit for bit.
    d, k, wide, r = 30, 50, 77, 5
    storage = torch.randn(2, d, wide).bfloat16()
    before = storage.clone()
    view = storage[:, :, 9:9 + k]  # a column slice: rows 77 apart, indices of the full matrix
    transposed = torch.randn(2, k, d).bfloat16().transpose(1, 2)  # unit stride on d
    t_before = transposed.clone()
    us = [torch.randn(2, d, r) for _ in range(2)]
    ps = [torch.randn(k, r).bfloat16() for _ in range(2)]
    coefs = torch.zeros(2, 2)
    decays = torch.full((2, 2), 0.25)
    offsets = [5 * wide + 9, 2**32 - 100]
    run_update([view, transposed], us, ps, coefs, decays, [3, 4], offsets, [wide, k])
    want = round_at(before[:, :, 9:9 + k].float() * 0.75, 3,
                    stack_index(2, d, k, offsets[0], wide))
    assert torch.equal(pattern(view), pattern(want))
    assert torch.equal(pattern(storage[:, :, :9]), pattern(before[:, :, :9]))
    assert torch.equal(pattern(storage[:, :, 9 + k:]), pattern(before[:, :, 9 + k:]))
    want = round_at(t_before.float() * 0.75, 4, stack_index(2, d, k, offsets[1], k))
    assert torch.equal(pattern(transposed), pattern(want))
    # the reference writes the same bits
    ref_view, ref_t = before[:, :, 9:9 + k].clone(), t_before.clone()
    R.lowrank_update_([ref_view, ref_t], us, ps, coefs, decays, [3, 4], offsets, [wide, k],
                      True, 8, None)
    assert torch.equal(pattern(ref_view), pattern(view))
    assert torch.equal(pattern(ref_t), pattern(transposed))


def test_strided_views_match_float64():
    d, k, r = 45, 66, 12
    transposed = torch.randn(3, k, d).bfloat16().transpose(1, 2)
    wide = torch.randn(3, d, k + 11).bfloat16()
    view = wide[:, :, 4:4 + k]
    ws = [transposed, view]
    us = [torch.randn(3, d, r) for _ in range(2)]
    ps = [torch.randn(k, r).bfloat16() / 3 for _ in range(2)]
    coefs = torch.tensor([[0.05, 0.1, -0.05], [0.02, 0.0, 0.07]])
    decays = torch.full((2, 3), 0.01)
    before = [w.clone() for w in ws]
    run_update(ws, us, ps, coefs, decays, [5, 6], [0, 4], [k, k + 11])
    check_against_dense(before, ws, us, ps, coefs, decays, [5, 6], [0, 4], [k, k + 11])


def test_no_decay_equals_zero_decay_and_nearest_rounding():
    ws, us, ps = stacks(2, 2, 33, 47, 6, seed=5)
    coefs = torch.full((2, 2), 0.07)
    a, b = [w.clone() for w in ws], [w.clone() for w in ws]
    run_update(a, us, ps, coefs, None, [1, 2], [0, 0], [47, 47])
    run_update(b, us, ps, coefs, torch.zeros(2, 2), [1, 2], [0, 0], [47, 47])
    for x, y in zip(a, b):
        assert torch.equal(pattern(x), pattern(y))
    before = [w.clone() for w in ws]
    run_update(ws, us, ps, coefs, None, [1, 2], [0, 0], [47, 47], stochastic=False)
    check_against_dense(before, ws, us, ps, coefs, None, [1, 2], [0, 0], [47, 47], False)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_coef_zero_keeps_the_bits_of_w_with_nonfinite_factors(w_dtype, zero):
    e, d, k, r = 2, 40, 70, 9
    ws, us, ps = stacks(1, e, d, k, r, w_dtype=w_dtype, seed=2)
    w = ws[0]
    w[0, 0, :4] = torch.tensor([-0.0, 0.0, math.inf, -math.inf])
    w[0, 1, 0] = math.nan
    us[0][0, 3, 2], us[0][0, 5, 0] = math.nan, math.inf
    ps[0][7, 1] = -math.inf
    before = w.clone()
    coefs = torch.tensor([[zero, 0.1]])
    sq = torch.empty(1, e)
    run_update(ws, us, ps, coefs, torch.zeros(1, e), [3], [0], [k], sq_norms=sq)
    assert torch.equal(pattern(w[0]), pattern(before[0]))  # coef 0: not a bit changes
    assert math.isnan(sq[0, 0])  # the NaN of W is a stored value
    assert not torch.equal(pattern(w[1]), pattern(before[1]))  # the other matrix moved
    # A finite W with coef 0: its norm is the norm of W.
    w[0] = torch.where(torch.isfinite(before[0]), before[0], 0.0)
    run_update(ws, us, ps, coefs, None, [3], [0], [k], sq_norms=sq)
    assert sq[0, 0].item() == pytest.approx((w[0].double() ** 2).sum().item(), rel=1e-6)


@pytest.mark.slow  # interpreted kernels on three layouts
def test_sq_norms_deterministic_and_sum_squares_has_the_same_bits():
    layouts = {
        "contiguous": lambda: torch.randn(2, 70, 100).bfloat16(),
        "transposed": lambda: torch.randn(2, 100, 70).bfloat16().transpose(1, 2),
        "column slice": lambda: torch.randn(2, 70, 103)[:, :, 1:101].bfloat16(),
        "fp32": lambda: torch.randn(2, 70, 100),
    }
    for name, build in layouts.items():
        results = []
        for _ in range(2):
            torch.manual_seed(1)
            ws = [build(), build()]
            us = [torch.randn(2, 70, 8) for _ in ws]
            ps = [torch.randn(100, 8).bfloat16() / 3 for _ in ws]
            sq = torch.empty(2, 2)
            run_update(ws, us, ps, torch.full((2, 2), 0.01), None, [1, 2], [0, 0],
                       [w.shape[2] for w in ws], sq_norms=sq)
            results.append((ws, sq.clone()))
        (w_a, sq_a), (w_b, sq_b) = results
        assert all(torch.equal(pattern(a), pattern(b)) for a, b in zip(w_a, w_b)), name
        assert torch.equal(sq_a.view(torch.int32), sq_b.view(torch.int32)), name
        norms = T.sum_squares(w_a, 64)
        assert torch.equal(norms.view(torch.int32), sq_a.view(torch.int32)), name
        # the exact sums rounded once: the CPU's norm of the same weights, bit for bit
        want = torch.stack([torch.from_numpy(exact_square_sums(w)) for w in w_a])
        assert torch.equal(norms.view(torch.int32), want.view(torch.int32)), name
        assert torch.equal(R.sum_squares(w_a, 64).view(torch.int32), want.view(torch.int32))


def test_update_allocates_no_rows_of_h():
    # The launcher allocates one float64 partial sum per tile and the pointer table; no FP32
    # tensor reaches 16 rows of H (16 x 160).
    ws, us, ps = stacks(2, 1, 96, 160, 8)
    coefs = torch.full((2, 1), 0.1)
    run_update(ws, us, ps, coefs, None, [1, 2], [0, 0], [160, 160])
    with rgc.memory.track() as rec:
        run_update(ws, us, ps, coefs, None, [1, 2], [0, 0], [160, 160],
                   sq_norms=torch.empty(2, 1))
    fp32 = [math.prod(a.shape) for a in rec.allocations if a.dtype == torch.float32]
    assert all(n < 16 * 160 for n in fp32), fp32


def test_bad_input_raises_before_any_weight_changes():
    ws, us, ps = stacks(2, 1, 20, 30, 8)
    before = [w.clone() for w in ws]
    coefs = torch.full((2, 1), 0.1)
    good = dict(coefs=coefs, decays=None, seeds=[0, 1], offsets=[0, 0], row_lengths=[30, 30])

    def call(ws=ws, us=us, ps=ps, **kw):
        args = dict(good, **kw)
        T.lowrank_update_(ws, us, ps, args["coefs"], args["decays"], args["seeds"],
                          args["offsets"], args["row_lengths"], True, 128, None)

    with pytest.raises(ValueError, match=r"factors\[1\] must be FP32"):
        call(us=[us[0], us[1].double()])
    with pytest.raises(ValueError, match=r"projections\[1\] must be"):
        call(ps=[ps[0], ps[1][:, :4]])
    with pytest.raises(TypeError, match="BF16 or FP32"):
        call(ws=[ws[0], ws[1].half()])
    with pytest.raises(ValueError, match="coefs must be a"):
        call(coefs=coefs.double())
    with pytest.raises(ValueError, match="decays must be a"):
        call(decays=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="offsets"):
        call(offsets=[0, -1])
    with pytest.raises(ValueError, match="row_lengths"):
        call(row_lengths=[30, 29])
    with pytest.raises(ValueError, match="one entry per stack"):
        call(seeds=[0])
    for w, w0 in zip(ws, before):
        assert torch.equal(pattern(w), pattern(w0))


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    ws, us, ps = stacks(1, 1, 4, 4, 2)
    monkeypatch.setattr(T, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        run_update(ws, us, ps, torch.ones(1, 1), None, [0], [0], [4])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        T.stochastic_round_(torch.empty(3, dtype=torch.bfloat16), torch.ones(3), 0, 0)


# ------------------------------------------------------------------------------ RowAdam

def row_adam_float64(s, m, v, active, t, beta1, beta2, eps, maximize):
    """RowAdam's formula per matrix in float64: ``(U, m, v, scale)``, m and v unchanged where
    inactive; ``scale`` bounds the FP32 error of m and U elementwise (``|b1 m| + |(1-b1) g|``,
    through the bias correction and the row's denominator for U: the sum may cancel)."""
    g = -s.double() if maximize else s.double()
    ok = active.view(-1, 1, 1)
    m_new = torch.where(ok, beta1 * m.double() + (1 - beta1) * g, m.double())
    v_new = torch.where(ok[..., 0], beta2 * v.double() + (1 - beta2) * (g * g).mean(-1),
                        v.double())
    t = t.double().view(-1, 1, 1)
    denom = (v_new[..., None] / (1 - beta2 ** t)).sqrt() + eps
    size = torch.where(ok, beta1 * m.double().abs() + (1 - beta1) * g.abs(), m.double().abs())
    return (m_new / (1 - beta1 ** t)) / denom, m_new, v_new, size, size / (1 - beta1 ** t) / denom


def adam_stacks(count, e, d, r, seed):
    g = torch.Generator().manual_seed(seed)
    sketches = [torch.randn(e, d, r, generator=g) for _ in range(count)]
    exp_avgs = [torch.randn(e, d, r, generator=g) * 0.1 for _ in range(count)]
    exp_avg_sqs = [torch.rand(e, d, generator=g) * 0.01 for _ in range(count)]
    return sketches, exp_avgs, exp_avg_sqs


@settings(max_examples=10)
@given(e=st.integers(1, 3), d=st.integers(1, 70), r=st.integers(1, 80),
       beta1=st.sampled_from([0.0, 0.9]), beta2=st.sampled_from([0.99, 0.999]),
       maximize=st.booleans(), seed=st.integers(0, 2**16))
def test_row_adam_matches_float64_and_the_reference(e, d, r, beta1, beta2, maximize, seed):
    # Against the reference: m bit for bit (the same FP32 operations, one fused multiply-add
    # as torch's add_ with alpha), v and U within 1e-6 relative (the order in which the mean
    # adds a row, and torch's CPU FP32 square root, which is not correctly rounded; the
    # kernel's is). Against float64: a few FP32 roundings of the terms (betas included).
    sketches, exp_avgs, exp_avg_sqs = adam_stacks(2, e, d, r, seed)
    g = torch.Generator().manual_seed(seed + 1)
    active = torch.rand(2, e, generator=g) < 0.7
    steps = torch.randint(0, 3000, (2, e), generator=g)
    args = (active, steps, beta1, beta2, 1e-8, maximize)
    ref = [[t.clone() for t in ts] for ts in (sketches, exp_avgs, exp_avg_sqs)]
    want = [row_adam_float64(*ts, active[i], steps[i], beta1, beta2, 1e-8, maximize)
            for i, ts in enumerate(zip(*ref))]
    R.row_adam_(*ref, *args)
    with CountLaunches() as launches:
        T.row_adam_(sketches, exp_avgs, exp_avg_sqs, *args)
    assert launches.triton == 1 and launches.host_reads == 0
    for i, (u64, m64, v64, m_size, u_size) in enumerate(want):
        assert torch.equal(pattern(exp_avgs[i]), pattern(ref[1][i]))
        torch.testing.assert_close(exp_avg_sqs[i], ref[2][i], rtol=1e-6, atol=0)
        assert ((exp_avgs[i].double() - m64).abs() <= 3e-7 * m_size).all()
        torch.testing.assert_close(exp_avg_sqs[i].double(), v64, rtol=2e-6, atol=0)
        live = steps[i] > 0  # t = 0 divides by zero, as the formula does
        torch.testing.assert_close(sketches[i][live], ref[0][i][live], rtol=1e-6, atol=0)
        err = (sketches[i].double() - u64).abs()
        assert (err <= 2e-6 * u64.abs() + 3e-7 * u_size)[live].all()
        # inactive matrices keep the bits of their moments
        keep = ~active[i]
        assert torch.equal(pattern(exp_avgs[i][keep]), pattern(ref[1][i][keep]))


def test_row_adam_is_one_launch_per_layout_and_checks_before_writing():
    sketches, exp_avgs, exp_avg_sqs = adam_stacks(4, 2, 33, 7, seed=0)
    sketches[3] = torch.randn(2, 40, 7)  # another shape: its own launch
    exp_avgs[3], exp_avg_sqs[3] = torch.zeros(2, 40, 7), torch.zeros(2, 40)
    active = torch.ones(4, 2, dtype=torch.bool)
    steps = torch.full((4, 2), 5)
    with CountLaunches() as launches:
        T.row_adam_(sketches, exp_avgs, exp_avg_sqs, active, steps, 0.9, 0.99, 1e-8, False)
    assert launches.names["triton:_row_adam_kernel"] == 2 and launches.triton == 2
    before = [t.clone() for t in sketches]
    for bad, match in [
            ((sketches, exp_avgs[:3], exp_avg_sqs, active, steps), "one entry per stack"),
            ((sketches, exp_avgs, [v[:, :5] for v in exp_avg_sqs], active, steps),
             r"exp_avg_sqs\[0\] must be"),
            ((sketches, exp_avgs, exp_avg_sqs, active.float(), steps), "active must be"),
            ((sketches, exp_avgs, exp_avg_sqs, active, steps[:2]), "steps must be")]:
        with pytest.raises(ValueError, match=match):
            T.row_adam_(*bad, 0.9, 0.99, 1e-8, False)
    assert all(torch.equal(a, b) for a, b in zip(before, sketches))


def test_row_adam_launches_do_not_grow_with_the_number_of_stacks():
    def count(n):
        stacks_ = adam_stacks(n, 1, 20, 8, seed=n)
        with CountLaunches() as launches:
            T.row_adam_(*stacks_, torch.ones(n, 1, dtype=torch.bool), torch.ones(n, 1,
                        dtype=torch.int64), 0.9, 0.999, 1e-8, True)
        return launches.total
    assert count(2) == count(5)


# --------------------------------------------------------------- norms of H, projections

@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's NaN
def test_sketch_stats_match_float64_and_find_nonfinite_sketches():
    cs = [torch.randn(2, 37, 20), torch.randn(2, 37, 20), torch.randn(2, 70, 5)]
    ps = [torch.randn(53, 20).bfloat16(), torch.randn(53, 20), torch.randn(90, 5)]
    cs[1][1, 3, 4] = math.nan
    cs[2][0, 0, 0] = math.inf
    with CountLaunches() as launches:
        h2, finite = T.sketch_stats(cs, ps)
    assert launches.triton == 3 * 3  # three layouts: Grams, row blocks, ordered sums each
    assert h2.dtype == torch.float32 and finite.dtype == torch.bool and h2.shape == (3, 2)
    assert finite.tolist() == [[True, True], [True, False], [False, True]]
    for m, (c, p) in enumerate(zip(cs, ps)):
        for e in range(2):
            if finite[m, e]:
                want = ((c[e].double() @ p.double().t()) ** 2).sum()
                assert h2[m, e].item() == pytest.approx(want.item(), rel=2e-6)
    assert math.isnan(h2[1, 1]) and not math.isfinite(h2[2, 0])


def test_sketch_stats_buffers_are_counted_by_its_byte_helper():
    # What the estimator reads (rgc.ops.triton_buffers.sketch_stats_bytes, summed over the
    # stacks: every group's buffers exist before the first launch) against the allocations
    # measured beside the outputs; the table rows (16 bytes a stack, made from a host list)
    # are counted by the helper but not seen by the tracker.
    cs = [torch.randn(3, 130, 5), torch.randn(3, 37, 20), torch.randn(3, 37, 20)]
    ps = [torch.randn(90, 5), torch.randn(53, 20).bfloat16(), torch.randn(53, 20)]
    T.sketch_stats(cs, ps)
    with rgc.memory.track() as rec:
        h2, finite = T.sketch_stats(cs, ps)
    counted = sum(triton_buffers.sketch_stats_bytes(*c.shape) for c in cs)
    buffers = rec.peak - h2.nbytes - finite.nbytes
    assert counted - 16 * len(cs) <= buffers <= counted, (buffers, counted, rec.allocations)


@pytest.mark.parametrize("k,r", [(200, 16), (300, 37), (40, 16)])
@pytest.mark.parametrize("gram_fp64", [False, True])
def test_orthonormalize_matches_float64_qr(k, r, gram_fp64):
    g = R.gaussian_matrices(k, r, [1, 2], "cpu")
    scale = math.sqrt(k / r)
    q = T.orthonormalize(g, scale, gram_fp64)
    assert q.shape == (2, k, r)
    q64, r64 = torch.linalg.qr(g.double())
    signs = torch.sign(r64.diagonal(dim1=1, dim2=2)).unsqueeze(1)
    want = q64 * signs * scale  # R with a positive diagonal
    tol = 2e-6 if k >= 4 * r else 1e-12
    torch.testing.assert_close(q.double(), want, rtol=0, atol=tol * scale)
    torch.testing.assert_close(q, R.orthonormalize(g, scale, gram_fp64), rtol=0,
                               atol=2e-6 * scale)


PROJECTION_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def triton_projections(kind, k, r, seeds, dtype):
    outs = [torch.empty(k, r, dtype=dtype) for _ in seeds]
    T.make_projections_(outs, kind, seeds)
    return outs


def _orthonormal_slow_beyond_bf16(cases, cholesky_qr3_slow: bool = False):
    """(kind, k, r) x PROJECTION_DTYPES, orthonormal cases of other dtypes than BF16 marked
    slow (and with ``cholesky_qr3_slow`` those with ``k < 4 r`` in BF16 too): the interpreted
    CholeskyQR takes seconds, CholeskyQR3 the most, and the dtype is only its last rounding."""
    def slow(kind, k, r, dtype):
        return kind == "orthonormal" and (dtype != torch.bfloat16
                                          or (cholesky_qr3_slow and k < 4 * r))
    return [pytest.param(*case, dtype, marks=pytest.mark.slow if slow(*case, dtype) else ())
            for case in cases for dtype in PROJECTION_DTYPES]


@pytest.mark.parametrize("kind,k,r,dtype", _orthonormal_slow_beyond_bf16(
    [("rademacher", 37, 9), ("gaussian", 37, 9), ("orthonormal", 70, 9), ("orthonormal", 21, 9)],
    cholesky_qr3_slow=True))
def test_a_projection_has_the_bits_it_has_alone_in_any_batch(kind, k, r, dtype, monkeypatch):
    # A sync receiver regenerates one P; the trainer a whole group: a batch of N, in any
    # order and split into chunks of any size, gives each P the bits it has alone.
    seeds = [5, 2**40 + 3, 0, 77]
    batch = triton_projections(kind, k, r, seeds, dtype)
    reverse = triton_projections(kind, k, r, seeds[::-1], dtype)[::-1]
    monkeypatch.setattr(triton_buffers, "PROJECTION_CHUNK_BYTES",
                        triton_buffers.projection_bytes(k, r) * 3 // 2)
    chunked = triton_projections(kind, k, r, seeds, dtype)
    for i, seed in enumerate(seeds):
        (alone,) = triton_projections(kind, k, r, [seed], dtype)
        for other in (batch[i], reverse[i], chunked[i]):
            assert torch.equal(other.view(-1).view(torch.uint8), alone.view(-1).view(torch.uint8))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("dtype", PROJECTION_DTYPES)
def test_rademacher_and_gaussian_projections_have_the_reference_bits(kind, dtype):
    k, r, seeds = 45, 13, [1, 2**62 + 9]
    want = [torch.empty(k, r, dtype=dtype) for _ in seeds]
    R.make_projections_(want, kind, seeds)
    for got, ref in zip(triton_projections(kind, k, r, seeds, dtype), want):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("kind,k,r,dtype", _orthonormal_slow_beyond_bf16(
    [("orthonormal", 96, 24), ("orthonormal", 33, 8), ("orthonormal", 50, 20),
     ("orthonormal", 9, 9)]))
def test_orthonormal_projections_are_close_to_the_reference_and_qr(kind, k, r, dtype):
    # sqrt(k/r) Q of G's thin QR (R's diagonal positive) in float64, rounded once to dtype;
    # the kernels within the rounding of the dtype (FP32 accuracy of the product for
    # k >= 4 r, float64 CholeskyQR3 below) of it and of the reference.
    seeds = [4, 8]
    g = R.gaussian_matrices(k, r, seeds, "cpu").double()
    q64, r64 = torch.linalg.qr(g)
    want = q64 * torch.sign(r64.diagonal(dim1=1, dim2=2)).unsqueeze(1) * math.sqrt(k / r)
    ref = [torch.empty(k, r, dtype=dtype) for _ in seeds]
    R.make_projections_(ref, "orthonormal", seeds)
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-23,
            torch.float64: 2**-52}[dtype]
    accuracy = max(unit, 2e-6 / 2**-23 * 2**-23 if k >= 4 * r else 1e-12)
    for i, got in enumerate(triton_projections("orthonormal", k, r, seeds, dtype)):
        tol = (accuracy + unit) * math.sqrt(k / r) * 4
        torch.testing.assert_close(got.double(), want[i], rtol=0, atol=tol)
        torch.testing.assert_close(got.double(), ref[i].double(), rtol=0, atol=2 * tol)


@pytest.mark.parametrize("kind,k,r,launches", [("rademacher", 30, 6, 1), ("gaussian", 30, 6, 1),
                                               ("orthonormal", 30, 6, 4),
                                               ("orthonormal", 20, 6, 10)])
def test_refresh_launches_do_not_grow_with_the_number_of_projections(kind, k, r, launches):
    def count(n):
        with CountLaunches() as counted:
            triton_projections(kind, k, r, list(range(n)), torch.bfloat16)
        return counted
    two, five = count(2), count(5)
    assert two.triton == five.triton == launches and two.host_reads == 0
    assert two.total == five.total, (two.names, five.names)


@pytest.mark.slow
def test_refresh_buffers_stay_within_the_chunk(monkeypatch):
    # No [M, k, r] float64 (nor G of all M) at once: buffers of at most the chunk's bytes.
    # (The interpreter leaves a launch's arguments in reference cycles; collected here after
    # each launch as a compiled launch would drop them.)
    # Every object older than the test is frozen first (as conftest.py froze the collected
    # suite): the collections then visit only the launches' objects (a full one over the whole
    # process took ~0.1 s per launch).
    launch = T._launch
    monkeypatch.setattr(T, "_launch", lambda launches: (launch(launches), gc.collect()))
    gc.collect()
    gc.freeze()
    for k, r in [(64, 8), (24, 8)]:  # one CholeskyQR pass, CholeskyQR3
        chunk = 2 * triton_buffers.projection_bytes(k, r)
        monkeypatch.setattr(triton_buffers, "PROJECTION_CHUNK_BYTES", chunk)
        outs = [torch.empty(k, r) for _ in range(7)]
        T.make_projections_(outs, "orthonormal", list(range(7)))  # compile
        with rgc.memory.track() as rec:
            T.make_projections_(outs, "orthonormal", list(range(7)))
        assert rec.peak <= chunk + 4096, (rec.peak, rec.largest)
        assert max(a.nbytes for a in rec.allocations) <= chunk


# ---------------------------------------------------- registry dispatch and fake kernels

def _op_calls():
    ws, us, ps = stacks(2, 2, 20, 30, 8)
    out = torch.empty(5, 6, dtype=torch.bfloat16)
    g = R.gaussian_matrices(40, 8, [1], "cpu")
    return {
        "stochastic_round_": (out, torch.randn(5, 6), 1, 0),
        "random_words": (100, 1, "x", 0, torch.device("cpu")),
        "lowrank_update_": (ws, us, ps, torch.full((2, 2), 0.1), torch.zeros(2, 2), [1, 2],
                            [0, 0], [30, 30], True, 128, torch.empty(2, 2)),
        "sum_squares": (ws, 128),
        "sketch_stats": (us, ps),
        "gaussian_matrices": (30, 7, [1, 2], torch.device("cpu")),
        "orthonormalize": (g, 2.0, False),
        "row_adam_": (*adam_stacks(2, 2, 20, 8, seed=1), torch.tensor([[True, False]] * 2),
                      torch.full((2, 2), 3), 0.9, 0.999, 1e-8, False),
        "make_projections_": ([torch.empty(40, 8), torch.empty(40, 8)], "orthonormal", [1, 2]),
    }


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_registry_reaches_the_kernels_of_rgc_impl(impl, monkeypatch):
    monkeypatch.setenv("RGC_IMPL", impl)
    calls = []

    def spy(name, launcher):
        def run(*args):
            calls.append(name)
            return launcher(*args)
        return run

    for name in _op_calls():
        monkeypatch.setattr(T, name, spy(name, getattr(T, name)))
    for name, args in _op_calls().items():
        with CountLaunches() as launches:
            getattr(torch.ops.rgc, name)(*args)
        if impl == "triton":
            assert calls[-1] == name and launches.triton > 0, name
    assert calls == ([] if impl == "torch" else list(_op_calls()))


@pytest.mark.slow  # opcheck of every op, its kernels interpreted
def test_ops_trace_with_the_triton_kernels(monkeypatch):
    # opcheck: the schema's mutations match the kernel's, the fake kernel gives the real
    # one's shapes, dtypes and strides, and the op traces under AOT dispatch (torch.compile).
    monkeypatch.setenv("RGC_IMPL", "triton")
    for name, args in _op_calls().items():
        torch.library.opcheck(getattr(torch.ops.rgc, name), args)


# ---------------------------------------------------------------------------- benchmarks

@pytest.mark.slow
def test_gpu_benchmark_smoke_mode(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_kernels

    rows = gpu_kernels.main(["--smoke", "--out", str(tmp_path)])
    assert len(rows) == len(gpu_kernels.SMOKE_SHAPES) * len(gpu_kernels.SMOKE_RANKS)
    assert all(row["mismatch_vs_torch"] <= MAX_MISMATCH for row in rows)
    assert all(row["fused_us"] > 0 and row["grouped_us_per_stack"] > 0 for row in rows)
    for name in ("gpu_kernels_smoke", "gpu_kernels_sweep_smoke"):
        assert "## Environment" in (tmp_path / f"{name}.md").read_text()
    step = gpu_kernels.main(["--smoke", "--step", "--out", str(tmp_path)])
    ranks = gpu_kernels.SMOKE_RANKS
    assert [(row["layers"], row["r"]) for row in step] == [(2, r) for r in ranks] + [(1, ranks[0])]
    assert all(row["rgc_step_ms"] > 0 and row["adamw_fused_step_ms"] > 0 for row in step)
    assert "## Environment" in (tmp_path / "gpu_step_smoke.md").read_text()
