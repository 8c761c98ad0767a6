import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rgc import PROJECTION_KINDS, _native, make_projection
from rgc.projection import _box_muller_numpy, _gaussian_torch, gaussian_matrix
from rgc.rounding import random_bits
from tests.host_reads import CountHostReads


@given(k=st.integers(1, 64), r=st.integers(1, 64), seed=st.integers(0, 2**63 - 1),
       kind=st.sampled_from(PROJECTION_KINDS))
def test_shape_dtype_and_determinism(k, r, seed, kind):
    if kind == "orthonormal" and r > k:
        with pytest.raises(ValueError, match="rank <= in_features"):
            make_projection(kind, k, r, seed=seed)
        return
    p = make_projection(kind, k, r, seed=seed)
    assert p.shape == (k, r) and p.dtype == torch.float32
    assert torch.equal(p, make_projection(kind, k, r, seed=seed))
    assert make_projection(kind, k, r, seed=seed, dtype=torch.bfloat16).dtype == torch.bfloat16


@given(k=st.integers(2, 80), data=st.data(), seed=st.integers(0, 2**32))
def test_orthonormal_gram_is_scaled_identity(k, data, seed):
    r = data.draw(st.integers(1, k))
    p = make_projection("orthonormal", k, r, seed=seed).double()
    torch.testing.assert_close(p.T @ p, (k / r) * torch.eye(r, dtype=torch.float64),
                               atol=1e-5 * k / r, rtol=0)


def test_entry_distributions():
    r = 16
    rad = make_projection("rademacher", 500, r, seed=1)
    assert set(rad.unique().tolist()) == {-1 / math.sqrt(r), 1 / math.sqrt(r)}
    gauss = make_projection("gaussian", 500, r, seed=1).double()
    # 8000 draws of N(0, 1/16): sample variance within 5% (about 4.5 standard errors).
    assert abs(gauss.var().item() * r - 1) < 0.05
    assert abs(gauss.mean().item()) < 4.5 / math.sqrt(8000 * r)


def test_different_seeds_differ():
    for kind in PROJECTION_KINDS:
        assert not torch.equal(make_projection(kind, 32, 4, seed=0),
                               make_projection(kind, 32, 4, seed=1))


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
@pytest.mark.parametrize("k", [6, 8])  # orthonormal: float64 CholeskyQR3 (k < 4r), FP32 (k >= 4r)
def test_expected_outer_product_is_identity(kind, k):
    # E[P P^T] = I: average 3000 independent draws, r=2. Each entry of the mean has standard
    # deviation below 0.05 for all kinds here; the tolerance is 0.12.
    r, n = 2, 3000
    acc = torch.zeros(k, k, dtype=torch.float64)
    for s in range(n):
        p = make_projection(kind, k, r, seed=s).double()
        acc += p @ p.T
    torch.testing.assert_close(acc / n, torch.eye(k, dtype=torch.float64), atol=0.12, rtol=0)


@pytest.mark.parametrize("rank", [0, -3, 2.5])
def test_bad_rank(rank):
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        make_projection("gaussian", 8, rank, seed=0)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown projection kind"):
        make_projection("sparse", 8, 2, seed=0)


# --- how P is generated: against plain float64 statements of the definitions ---------------

def _no_native(monkeypatch):
    monkeypatch.setattr(_native, "library", lambda: None)


def box_muller_reference(k, r, seed):
    """G of the module docstring in float64, from the int64 statement of the hash words."""
    h = (r + 1) // 2
    words = random_bits(2 * k * h, seed=seed, label="projection-gaussian") >> 8
    u = (words[:k * h].double() + 1) / 2**24
    theta = 2 * math.pi * words[k * h:].double() / 2**24
    rho = torch.sqrt(-2 * torch.log(u))
    g = torch.cat([(rho * torch.cos(theta)).view(k, h), (rho * torch.sin(theta)).view(k, h)], 1)
    return g[:, :r]


@given(k=st.integers(1, 40), r=st.integers(1, 40), seed=st.integers(0, 2**63 - 1))
def test_gaussian_matrix_is_box_muller_of_the_hash_words(k, r, seed):
    # The CPU polynomials (compiled loop and numpy twin) and torch's log/cos/sin (the path of
    # other devices) stay within 2e-6 of float64 Box-Muller; |G| <= 5.8, float32 ulp ~5e-7.
    want = box_muller_reference(k, r, seed)
    got = gaussian_matrix(k, r, seed=seed)
    assert got.shape == (k, r) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    h = (r + 1) // 2
    other = _gaussian_torch(k, h, seed=seed, device="cpu")[:, :r]
    torch.testing.assert_close(other.double(), want, atol=2e-6, rtol=0)


@given(k=st.integers(1, 70), r=st.integers(1, 70), seed=st.integers(0, 2**63 - 1))
def test_compiled_and_numpy_gaussians_are_bit_identical(k, r, seed):
    if _native.library() is None:
        pytest.skip("no C compiler: only the numpy path exists here")
    compiled = gaussian_matrix(k, r, seed=seed)
    with pytest.MonkeyPatch.context() as mp:
        _no_native(mp)
        assert torch.equal(gaussian_matrix(k, r, seed=seed), compiled)


def test_gaussian_rows_are_symmetric_under_negation_bit_for_bit():
    # The quadrant construction: flipping bit 1 of the quadrant negates the pair exactly, so
    # a row's law is exactly symmetric. Checked on the numpy twin with hand-made words.
    w0 = np.arange(0, 1 << 24, 4099, dtype=np.uint32)
    w1 = (w0 * np.uint32(2654435761)) & np.uint32(0xFFFFFF)
    c1, s1 = _box_muller_numpy(w0, w1)
    c2, s2 = _box_muller_numpy(w0, w1 ^ np.uint32(1 << 23))
    assert np.array_equal(c2, -c1) and np.array_equal(s2, -s1)


def test_rademacher_signs_are_the_top_bit_of_each_word():
    k, r = 9, 5
    words = random_bits(k * r, seed=4, label="projection-rademacher").view(k, r)
    want = torch.where(words >= 2**31, -1.0, 1.0) / math.sqrt(r)
    assert torch.equal(make_projection("rademacher", k, r, seed=4), want.float())


@pytest.mark.parametrize("k, r, tol", [(200, 8, 1e-5), (64, 16, 1e-5), (12, 7, 1e-5),
                                       (5, 5, 1e-4)])
def test_orthonormal_is_the_sign_corrected_qr_of_g(k, r, tol):
    # Reference: float64 Householder QR of the same G, R's diagonal made positive. Both FP32
    # CholeskyQR (k >= 4r) and float64 shifted CholeskyQR3 (k < 4r) give that Q.
    for seed in range(5):
        g = gaussian_matrix(k, r, seed=seed).double()
        q, upper = torch.linalg.qr(g)
        want = q * torch.sign(torch.diagonal(upper)) * math.sqrt(k / r)
        cond = torch.linalg.cond(g).item()
        got = make_projection("orthonormal", k, r, seed=seed).double()
        torch.testing.assert_close(got, want, atol=tol * cond * math.sqrt(k / r), rtol=0)


@given(k=st.integers(2, 80), data=st.data(), seed=st.integers(0, 2**32))
def test_bf16_orthonormal_gram_within_bf16_rounding(k, data, seed):
    # Each entry is rounded with relative error <= 2**-8 (BF16 unit roundoff), so every entry
    # of P^T P moves by at most (2 * 2**-8 + 2**-16) * (k/r) (Cauchy-Schwarz); the FP32 Gram
    # adds < 1e-5 relative.
    r = data.draw(st.integers(1, k))
    p = make_projection("orthonormal", k, r, seed=seed, dtype=torch.bfloat16).double()
    torch.testing.assert_close(p.T @ p, (k / r) * torch.eye(r, dtype=torch.float64),
                               atol=(2**-7 + 2**-16 + 1e-5) * k / r, rtol=0)


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
def test_out_gives_the_same_bits_as_dtype(kind):
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((40, 6), math.nan, dtype=dtype)
        got = make_projection(kind, 40, 6, seed=3, out=out)
        assert got is out
        assert torch.equal(out, make_projection(kind, 40, 6, seed=3, dtype=dtype))
    with pytest.raises(ValueError, match="out must be"):
        make_projection(kind, 40, 6, seed=3, out=torch.empty(6, 40))
    with pytest.raises(ValueError, match="either out or device/dtype"):
        make_projection(kind, 40, 6, seed=3, out=torch.empty(40, 6), dtype=torch.float32)


@pytest.mark.parametrize("kind", PROJECTION_KINDS)
@pytest.mark.parametrize("k", [64, 10])  # both orthonormalisation variants
def test_generation_reads_no_tensor_value_on_the_host(kind, k):
    with CountHostReads() as mode:
        make_projection(kind, k, 8, seed=1, dtype=torch.bfloat16)
    assert mode.count == 0


def test_too_large_a_projection_is_refused_before_allocating():
    with pytest.raises(ValueError, match="too large"):
        gaussian_matrix(2**26, 64, seed=0)


# --- the compiled CPU CholeskyQR (rgc._native.rgc_cholesky_qr) --------------------------------

needs_native = pytest.mark.skipif(_native.library() is None, reason="no C compiler here")


@needs_native
@given(r=st.integers(1, 40), extra=st.integers(0, 90), seed=st.integers(0, 2**63 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_compiled_orthonormal_is_the_sign_corrected_qr_of_g(r, extra, seed, dtype):
    # Reference: float64 Householder QR of the same G. FP32 P: within 1e-6 sqrt(k/r) (G is
    # well conditioned for k >= 4r); BF16 P: the reference rounded to nearest, give or take
    # one BF16 step where the FP32 value lies within 1e-6 of a rounding boundary.
    k = 4 * r + extra
    g = gaussian_matrix(k, r, seed=seed).double()
    q, upper = torch.linalg.qr(g)
    want = q * torch.sign(torch.diagonal(upper)) * math.sqrt(k / r)
    got = make_projection("orthonormal", k, r, seed=seed, dtype=dtype).double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6 * math.sqrt(k / r), rtol=0)
    else:
        step = torch.finfo(torch.bfloat16).eps * want.abs()  # one BF16 step, at most
        assert ((got - want).abs() <= step / 2 + 1e-6 * math.sqrt(k / r)).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_and_torch_orthonormal_agree(monkeypatch, dtype):
    # The path without a compiler (torch's BLAS) computes the same P up to rounding.
    for k, r in [(64, 16), (200, 7), (513, 33)]:
        compiled = make_projection("orthonormal", k, r, seed=k, dtype=dtype).double()
        with pytest.MonkeyPatch.context() as mp:
            _no_native(mp)
            plain = make_projection("orthonormal", k, r, seed=k, dtype=dtype).double()
        tol = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(compiled, plain, atol=tol * math.sqrt(k / r), rtol=0)


def _cholesky_qr(lib, g: torch.Tensor, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """rgc_cholesky_qr of one library build on G (k x r FP32): (status, P)."""
    k, r = g.shape
    ld = -(-r // 16) * 16
    rows = torch.zeros(k, ld)
    rows[:, :r] = g
    work = torch.zeros(_native.cholesky_qr_work_floats(r))
    out = torch.full((k, r), -7.0, dtype=dtype)
    status = lib.rgc_cholesky_qr(rows.data_ptr(), k, r, ld, int(dtype == torch.float32),
                                 math.sqrt(k / r), out.data_ptr(), int(dtype == torch.bfloat16),
                                 work.data_ptr())
    return status, out


@needs_native
def test_compiled_orthonormal_has_the_same_bits_for_every_vector_width():
    # Every lane performs the same IEEE operations (fused multiply-adds included), so builds
    # for AVX-512, AVX2 and plain scalar code (where this CPU runs them) give the same bits.
    builds = {"native": _native.library(), "scalar": _native._compile([()]),
              "RGC_SCALAR": _native._compile([("-march=native", "-DRGC_SCALAR")])}
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " in flags and " fma " in flags:
        builds["avx2"] = _native._compile([("-mavx2", "-mfma", "-mno-avx512f")])
    assert builds["scalar"] is not None and not builds["RGC_SCALAR"].fast_fma
    for k, r in [(40, 10), (300, 64), (77, 17)]:
        g = gaussian_matrix(k, r, seed=r)
        for dtype in (torch.float32, torch.bfloat16):
            results = {name: _cholesky_qr(lib, g, dtype) for name, lib in builds.items()}
            for name, (status, out) in results.items():
                assert status == 0, name
                assert torch.equal(out, results["native"][1]), (name, k, r, dtype)


@needs_native
def test_compiled_cholesky_qr_refuses_a_rank_deficient_g():
    g = gaussian_matrix(64, 8, seed=0)
    g[:, 3] = g[:, 5]  # two equal columns: the Gram is singular
    status, out = _cholesky_qr(_native.library(), g, torch.float32)
    assert status == 1 and (out == -7.0).all()  # out untouched


@needs_native
def test_a_degenerate_g_falls_back_to_torch(monkeypatch):
    # make_projection then runs the torch path on the same G; here the C routine is made to
    # report failure, and the result must still be the plain path's.
    class Failing:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        @staticmethod
        def rgc_cholesky_qr(*args):
            return 1

    lib = _native.library()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "library", lambda: Failing(lib))
        got = make_projection("orthonormal", 64, 8, seed=2)
    with pytest.MonkeyPatch.context() as mp:
        _no_native(mp)
        want = make_projection("orthonormal", 64, 8, seed=2)
    assert torch.equal(got, want)


def test_the_reused_cpu_workspace_does_not_change_p():
    # Projections of other shapes built in between (the workspace is shared and regrown).
    first = make_projection("orthonormal", 96, 12, seed=5, dtype=torch.bfloat16)
    for k, r in [(4000, 64), (96, 12), (33, 30), (500, 3)]:
        make_projection("orthonormal", k, r, seed=1)
    assert torch.equal(make_projection("orthonormal", 96, 12, seed=5, dtype=torch.bfloat16),
                       first)
