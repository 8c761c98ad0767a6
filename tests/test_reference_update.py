"""The low-rank update (reference path on the CPU) against the shared update contract, with
float64 oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rgc.updates import apply_lowrank_update_ as lowrank_update_reference
from rgc.updates import sum_squares as sum_squares_reference
from tests.test_step_sync import CountSyncs


def _problem(d, k, r, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=g).to(dtype)
    sketch = torch.randn(d, r, generator=g)
    projection = torch.randn(k, r, generator=g) / r ** 0.5
    return weight, sketch, projection


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at each value of float64 ``x`` (normal range)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return 2.0 ** (exponent - 7)


CASES = st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 8),
                  st.sampled_from([(torch.float32, True), (torch.bfloat16, True),
                                   (torch.bfloat16, False)]),
                  st.integers(1, 17), st.integers(0, 2**40))


@settings(max_examples=25, deadline=None)
@given(CASES, st.floats(-2.0, 2.0).filter(lambda c: abs(c) > 1e-3))
def test_tensor_coef_equals_float_coef_and_matches_float64(case, coef):
    d, k, r, (dtype, sr), chunk_rows, seed = case
    weight, sketch, projection = _problem(d, k, r, dtype, seed)
    expected = weight.double() - float(torch.tensor(coef, dtype=torch.float32)) * (
        sketch.double() @ projection.double().T)
    with_float, with_tensor = weight.clone(), weight.clone()
    out_float, out_tensor = torch.full((), float("nan")), torch.full((), float("nan"))
    lowrank_update_reference(with_float, sketch, projection, coef, seed=seed, offset=3,
                             chunk_rows=chunk_rows, stochastic_rounding=sr,
                             sq_norm_out=out_float)
    with CountSyncs() as counter:
        lowrank_update_reference(with_tensor, sketch, projection,
                                 torch.tensor(coef, dtype=torch.float32), seed=seed, offset=3,
                                 chunk_rows=chunk_rows, stochastic_rounding=sr,
                                 sq_norm_out=out_tensor)
    assert not counter.syncs, dict(counter.syncs)  # a tensor coef is never read on the host
    assert torch.equal(_bits(with_float), _bits(with_tensor))
    assert torch.equal(_bits(out_float), _bits(out_tensor))
    got = with_tensor.double()
    scale = expected.abs() + sketch.double().abs() @ projection.double().abs().T
    if dtype == torch.float32:  # FP32 arithmetic: a few ulps of the terms' magnitude
        assert ((got - expected).abs() <= 1e-6 * scale).all()
    else:  # one of the two BF16 neighbours of the FP32 result
        assert ((got - expected).abs() <= _bf16_ulp(expected) + 1e-6 * scale).all()
    # sq_norm_out: ||stored W||^2 in float64 terms, FP32 accumulation
    stored = got.square().sum()
    assert abs(float(out_tensor) - float(stored)) <= 1e-5 * float(stored) + 1e-30


@settings(max_examples=20, deadline=None)
@given(CASES, st.sampled_from(["float", "tensor", "negative zero tensor"]))
def test_zero_coef_leaves_weight_bit_identical_even_with_nonfinite_factors(case, kind):
    d, k, r, (dtype, sr), chunk_rows, seed = case
    weight, sketch, projection = _problem(d, k, r, dtype, seed)
    weight.view(-1)[::3] = 0.0
    weight.view(-1)[1::3] = -0.0
    if weight.numel() > 2:
        weight.view(-1)[2] = torch.finfo(torch.float32).tiny / 8  # subnormal (flushed in BF16)
    sketch[0, 0] = float("nan")
    sketch[-1, -1] = float("inf")
    projection[0, -1] = float("-inf")
    before = weight.clone()
    coef = {"float": 0.0, "tensor": torch.zeros(()), "negative zero tensor": torch.tensor(-0.0)}
    out = torch.full((), float("nan"))
    lowrank_update_reference(weight, sketch, projection, coef[kind], seed=seed,
                             chunk_rows=chunk_rows, stochastic_rounding=sr, sq_norm_out=out)
    assert torch.equal(_bits(weight), _bits(before))
    assert float(out) == pytest.approx(float(before.double().square().sum()), rel=1e-5, abs=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sq_norm_out_is_deterministic_and_equals_sum_squares_of_the_result(dtype):
    weight, sketch, projection = _problem(300, 70, 6, dtype, 3)
    outs, results = [], []
    for _ in range(2):
        w = weight.clone()
        out = torch.empty(())
        lowrank_update_reference(w, sketch, projection, torch.tensor(0.25), seed=11,
                                 chunk_rows=64, sq_norm_out=out)
        outs.append(out)
        results.append(w)
    assert torch.equal(_bits(results[0]), _bits(results[1]))
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    # the same reduction as a separate read of W: a recomputed norm is bit-identical
    assert torch.equal(_bits(outs[0]), _bits(sum_squares_reference(results[0], chunk_rows=64)))
    expected = results[0].double().square().sum()
    assert abs(float(outs[0]) / float(expected) - 1) < 1e-5
