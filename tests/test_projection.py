import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rgc import PROJECTION_KINDS, make_projection


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
def test_expected_outer_product_is_identity(kind):
    # E[P P^T] = I: average 3000 independent draws, k=6, r=2. Each entry of the mean has
    # standard deviation below 0.05 for all kinds here; the tolerance is 0.12.
    k, r, n = 6, 2, 3000
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
