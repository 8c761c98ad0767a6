import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rgc import stochastic_round
from rgc.rounding import stochastic_round_
from tests.host_reads import CountHostReads


def bf16_neighbours(x: torch.Tensor):
    """Largest BF16 <= x and smallest BF16 >= x, computed by truncating the FP32 pattern."""
    bits = x.view(torch.int32).to(torch.int64)
    down = (bits & ~0xFFFF).to(torch.int32).view(torch.float32)
    up_bits = torch.where(bits & 0xFFFF == 0, bits & ~0xFFFF, (bits & ~0xFFFF) + 0x10000)
    up = up_bits.to(torch.int32).view(torch.float32)
    lo = torch.where(x >= 0, down, up)
    hi = torch.where(x >= 0, up, down)
    return lo, hi


@pytest.mark.parametrize("value", [1.0 + 2**-9, -3.0 - 0.3 * 2**-6, 1e-3, 7.77e-39, -2.5e30])
def test_unbiased_mean_over_draws(value):
    # 200,000 draws of one value: the rounded mean equals the value. The per-draw error is at
    # most one BF16 spacing u, so the mean's standard deviation is <= u / (2 sqrt(n));
    # we allow 5 of those.
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    y = stochastic_round(x, seed=11).double()
    lo, hi = bf16_neighbours(x[:1])
    spacing = (hi - lo).double().item()
    assert set(y.unique().tolist()) <= {lo.item(), hi.item()}
    assert abs(y.mean().item() - x[0].double().item()) <= 5 * spacing / (2 * math.sqrt(n))


def test_round_up_probability_equals_fraction():
    # x = 1 + f * 2**-7 lies a fraction f of the way to the next BF16 number.
    n = 100_000
    for f in (0.1, 0.5, 0.9):
        x = torch.full((n,), 1.0 + f * 2**-7)
        p_up = (stochastic_round(x, seed=5).float() > 1.0).double().mean().item()
        assert abs(p_up - f) < 5 * math.sqrt(f * (1 - f) / n)


def test_special_and_representable_values_unchanged():
    bf16_max = torch.finfo(torch.bfloat16).max
    tiny_sub = 2.0**-133  # a BF16 subnormal
    vals = torch.tensor([0.0, -0.0, math.inf, -math.inf, bf16_max, -bf16_max, tiny_sub, -tiny_sub,
                         1.0, -2.5, 3.140625])
    for seed in range(20):
        out = stochastic_round(vals, seed=seed)
        assert torch.equal(out.float().view(torch.int32), vals.view(torch.int32))
    nan = stochastic_round(torch.tensor([math.nan, -math.nan]), seed=3)
    assert torch.isnan(nan.float()).all()


def test_deterministic_per_seed_and_offset_convention():
    x = torch.randn(1000)
    a = stochastic_round(x, seed=123)
    assert torch.equal(a, stochastic_round(x, seed=123))
    assert not torch.equal(a, stochastic_round(x, seed=124))
    # element j of a slice starting at flat index 300 uses the bits of index 300 + j
    assert torch.equal(stochastic_round(x[300:], seed=123, offset=300), a[300:])
    assert torch.equal(stochastic_round(x.view(10, 100), seed=123), a.view(10, 100))


def test_huge_offsets_use_the_high_word():
    x = torch.full((64,), 1.0 + 2**-9)
    a = stochastic_round(x, seed=1, offset=0)
    b = stochastic_round(x, seed=1, offset=2**32)
    assert not torch.equal(a, b)


@given(n=st.integers(1, 300), seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**40),
       scale=st.sampled_from([1e-38, 1e-3, 1.0, 1e20]))
def test_result_is_a_neighbour(n, seed, offset, scale):
    x = torch.randn(n) * scale
    y = stochastic_round(x, seed=seed, offset=offset).float()
    lo, hi = bf16_neighbours(x)
    assert ((y == lo) | (y == hi)).all()


def test_rejects_integer_input_and_negative_offset():
    with pytest.raises(TypeError, match="floating-point"):
        stochastic_round(torch.arange(4), seed=0)
    with pytest.raises(ValueError, match="offset"):
        stochastic_round(torch.zeros(4), seed=0, offset=-1)


def test_in_place_variant_writes_into_out():
    x = torch.randn(70, 33) * 5
    want = stochastic_round(x, seed=8, offset=99)
    out = torch.empty(70, 33, dtype=torch.bfloat16)
    assert stochastic_round_(out, x, seed=8, offset=99) is out
    assert torch.equal(out, want)
    # a non-contiguous destination (a column block) gets the same bits
    wide = torch.zeros(70, 50, dtype=torch.bfloat16)
    stochastic_round_(wide[:, 10:43], x, seed=8, offset=99)
    assert torch.equal(wide[:, 10:43], want) and not wide[:, :10].any()


def test_in_place_variant_rejects_bad_arguments():
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match="bfloat16"):
        stochastic_round_(torch.empty(4, 3), x, seed=0)
    with pytest.raises(ValueError, match="shape and device"):
        stochastic_round_(torch.empty(3, 4, dtype=torch.bfloat16), x, seed=0)
    with pytest.raises(ValueError, match="seed"):
        stochastic_round_(torch.empty(4, 3, dtype=torch.bfloat16), x, seed=-1)


def test_in_place_variant_reads_no_tensor_value_on_the_host():
    x = torch.randn(300)
    x[7] = math.nan
    with CountHostReads() as reads:
        stochastic_round_(torch.empty(300, dtype=torch.bfloat16), x, seed=1)
    assert reads.count == 0
