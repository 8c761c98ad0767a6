import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rgc
from rgc import PROJECTION_KINDS, make_projection, ops
from rgc.bits import random_bits
from rgc.ops import reference
from rgc.projection import advance_projections
from tests.host_reads import CountHostReads


def gaussian_matrix(k, r, *, seed):
    """``G`` (k x r FP32) of one seed on the CPU: the operator of a refresh's first step."""
    return ops.gaussian_matrices(k, r, [seed], torch.device("cpu"))[0]


def projections(kind, k, r, seeds, *, dtype):
    """``[M, k, r]``: the CPU projection of each seed, all refreshed by one operator call."""
    out = torch.empty(len(seeds), k, r, dtype=dtype)
    ops.make_projections_(list(out.unbind(0)), kind, list(seeds))
    return out


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
    # The float32 polynomials stay within 2e-6 of float64 Box-Muller; |G| <= 5.8, float32
    # ulp ~5e-7.
    want = box_muller_reference(k, r, seed)
    got = gaussian_matrix(k, r, seed=seed)
    assert got.shape == (k, r) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


@given(k=st.integers(1, 40), r=st.integers(1, 40), seeds=st.lists(
    st.integers(0, 2**63 - 1), min_size=1, max_size=4), kind=st.sampled_from(PROJECTION_KINDS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_batch_of_projections_has_the_bits_of_each_alone(k, r, seeds, kind, dtype):
    """A refresh regenerates every P of a group at once; a receiver regenerates one: the
    same bits (each matrix's arithmetic does not depend on its batch)."""
    if kind == "orthonormal" and r > k:
        return
    batch = projections(kind, k, r, seeds, dtype=dtype)
    for i, seed in enumerate(seeds):
        assert torch.equal(batch[i], make_projection(kind, k, r, seed=seed, dtype=dtype))


@given(k=st.integers(1, 70), r=st.integers(1, 70), seed=st.integers(0, 2**63 - 1))
def test_compiled_and_eager_gaussians_are_bit_identical(k, r, seed):
    """The CPU compiles the Box-Muller loop; its float operations are the eager ones, so
    compiling changes no bit (and the eager path, which runs under dispatch modes and where
    torch.compile cannot, gives the same G)."""
    compiled = gaussian_matrix(k, r, seed=seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "_gaussian_loop", lambda device: reference._gaussian_pairs_blocked)
        assert torch.equal(gaussian_matrix(k, r, seed=seed).view(torch.int32),
                           compiled.view(torch.int32))


@pytest.mark.parametrize("k, r, count", [(1, 1, 1), (1, 2, 3), (7, 3, 1), (64, 16, 1),
                                         (64, 16, 2)])
def test_the_pair_loop_is_never_called_with_a_size_of_one(monkeypatch, k, r, count):
    """Dynamo specialises sizes of 1: a lone seed or a single pair would compile another
    variant of the Box-Muller loop (a minute on a small CPU) for what the common one does."""
    shapes = []

    def loop(cos_out, sin_out, keys):
        shapes.append((*cos_out.shape, *sin_out.shape, *keys.shape))
        reference._gaussian_pairs_blocked(cos_out, sin_out, keys)

    monkeypatch.setattr(reference, "_gaussian_loop", lambda device: loop)
    g = projections("gaussian", k, r, list(range(count)), dtype=torch.float32)
    assert len(shapes) == 1 and 1 not in shapes[0], shapes
    monkeypatch.undo()
    assert torch.equal(g, projections("gaussian", k, r, list(range(count)), dtype=torch.float32))


def test_advance_projections_moves_each_owner_to_its_next_version():
    layers = [rgc.CompressedLinear(12, 5, rank=3, seed=s) for s in range(3)]
    layers.append(rgc.CompressedLinear(20, 5, rank=3, seed=9, projection="rademacher"))
    advance_projections(layers)
    for layer in layers:
        assert layer.projection_version == 1
        assert torch.equal(layer.projection, make_projection(
            layer.projection_kind, layer.in_features, 3, seed=layer.projection_seed))


def test_gaussian_rows_are_symmetric_under_negation_bit_for_bit():
    # The quadrant construction: flipping bit 1 of the quadrant (the top bit of the 24-bit
    # angle word) negates the pair exactly, so a row's law is exactly symmetric. Checked on
    # hand-made words through the reference's polar step (no public entry takes words).
    w0 = torch.arange(0, 1 << 24, 4099, dtype=torch.int32)
    w1 = (w0.to(torch.int64) * 2654435761 & 0xFFFFFF).to(torch.int32)
    rho = torch.sqrt(-2 * torch.log((w0.double() + 1) / 2**24)).float()
    c1, s1 = reference._polar(rho, w1)
    c2, s2 = reference._polar(rho, w1 ^ (1 << 23))
    assert torch.equal(c2, -c1) and torch.equal(s2, -s1)


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


@pytest.mark.parametrize("kind", ["orthonormal", "gaussian"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_across_chunks_have_the_bits_of_each_alone(monkeypatch, kind, dtype):
    """The CPU refresh takes same-shaped projections in chunks: with chunks of 2 (a small
    PROJECTION_CHUNK_BYTES), five projections, reordered, keep their bits; and each
    orthonormal P is within 1e-5 (FP32) of sqrt(k/r) times the float64 Householder Q."""
    k, r, seeds = 48, 6, [5, 1, 2**62 + 3, 9, 0]
    alone = {s: make_projection(kind, k, r, seed=s, dtype=dtype) for s in seeds}
    monkeypatch.setattr(reference, "PROJECTION_CHUNK_BYTES", 2 * 8 * k * ((r + 1) // 2))
    assert reference.projection_chunk(k, r) == 2
    for order in (seeds, seeds[::-1]):
        batch = projections(kind, k, r, order, dtype=dtype)
        for p, s in zip(batch, order, strict=True):
            assert torch.equal(p, alone[s])
    if kind == "orthonormal" and dtype == torch.float32:
        for s in seeds:
            q, upper = torch.linalg.qr(gaussian_matrix(k, r, seed=s).double())
            q = q * torch.sign(torch.diagonal(upper))
            torch.testing.assert_close(alone[s].double(), math.sqrt(k / r) * q, atol=1e-5,
                                       rtol=0)
