"""The low-rank update (reference path on the CPU) against the shared update contract, with
float64 oracles."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rgc.updates import apply_lowrank_update_ as lowrank_update_reference
from rgc.updates import sum_squares as sum_squares_reference
from tests.test_step_sync import CountSyncs

#: For the tests of how the compiled loops are traced and called.
needs_dynamo = pytest.mark.skipif(os.environ.get("TORCHDYNAMO_DISABLE") == "1",
                                  reason="dynamo disabled: the loops run eagerly, nothing "
                                  "is traced")


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


def test_update_pass_returns_the_exact_sum_of_the_squares_it_stores_compiled_or_eager():
    """The one-pass update loop that also sums the squares of what it stores (the update's
    ||W||^2) writes the patterns of the loop without it, and its float64 sum, compiled or in
    eager blocks, rounds to the FP32 value of the exact sum (math.fsum of the stored values)."""
    from rgc.ops import reference

    g = torch.Generator().manual_seed(3)
    n = 3 * reference.SQUARE_SUM_BLOCK + 17  # several eager blocks and a tail
    w = torch.randn(n, generator=g).bfloat16()
    h = torch.randn(n, generator=g) * 1e-2
    factor, keys = torch.tensor(0.999), torch.tensor([5, -7, 123], dtype=torch.int32)
    plain = h.clone()
    reference._compiled(reference._update_words)(w, plain, factor, keys)
    stored = (plain.view(torch.int32) << 16).view(torch.float32)  # the BF16 values, as FP32
    exact = torch.tensor(math.fsum(v * v for v in stored.tolist()), dtype=torch.float64)
    loops = {"compiled": reference._compiled(reference._update_words_norm,
                                             reference._update_words_norm_blocked),
             "eager": reference._update_words_norm_blocked}
    for name, loop in loops.items():
        out = h.clone()
        total = loop(w, out, factor, keys)
        assert torch.equal(out.view(torch.int32), plain.view(torch.int32)), name
        assert total.dtype == torch.float64 and total.dim() == 0, name
        assert float(total.float()) == float(exact.float()), name


def _stacks():
    """Weights of many layouts: sizes of 1, equal sizes, stacks, transposed and sliced."""
    g = torch.Generator().manual_seed(11)
    out = []
    for e, d, k in [(1, 1, 1), (1, 1, 9), (1, 9, 1), (1, 7, 7), (1, 30, 20), (3, 5, 5),
                    (2, 1, 4), (4, 16, 8)]:
        for dtype in (torch.bfloat16, torch.float32):
            out.append(torch.randn(e, d, k, generator=g).to(dtype))
    out.append(torch.randn(2, 12, 6, generator=g).bfloat16().transpose(1, 2))
    out.append(torch.randn(1, 10, 30, generator=g).bfloat16()[:, :, 4:19])
    # rows long enough for the compiled loop: one width with two lengths, and another width
    for e, d, k in [(1, 260, 200), (2, 300, 150), (1, 100, 700)]:
        out.append(torch.randn(e, d, k, generator=g).bfloat16())
    out.append(torch.randn(2, 180, 200, generator=g).bfloat16().transpose(1, 2))
    with torch.inference_mode():  # other dispatch keys
        out.append(torch.randn(1, 6, 9, generator=g).bfloat16())
    return out


@pytest.mark.slow  # traces a loop for each of its layouts
def test_cpu_norm_keeps_its_bits_whatever_shapes_and_dynamo_settings_come_before():
    """The compiled CPU loops never recompile (one code object per argument variant): neither a
    user's error_on_recompile nor more layouts than dynamo's recompile limit nor a grad mode
    or thread count other than the first call's sends a loop to the eager path (which would
    give the same bits, only slower)."""
    from rgc.ops import reference

    first = torch.randn(1, 48, 40, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = reference.sum_squares([first], 128)
    with torch._dynamo.config.patch(error_on_recompile=True, recompile_limit=2), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, w in enumerate(_stacks()):
            with torch.set_grad_enabled(i % 2 == 1):  # sum_squares itself runs under no_grad
                got = reference.sum_squares([w], 128)[0]
                rows = reference.pairwise_sums(w, square=True).double().sum(dim=-1)
            want = w.double().square().sum(dim=(1, 2))
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
            torch.testing.assert_close(rows, want, rtol=1e-5, atol=0)
        with torch.no_grad():
            after_no_grad = reference.sum_squares([first], 128)
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)
        try:
            after_threads = reference.sum_squares([first], 128)
        finally:
            torch.set_num_threads(threads)
        after = reference.sum_squares([first], 128)
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    for again in (after, after_no_grad, after_threads):
        assert torch.equal(before.view(torch.int32), again.view(torch.int32))


def test_a_dynamo_reset_lets_no_user_setting_into_the_loops_traced_again():
    """``torch._dynamo.reset()`` drops every graph dynamo holds. A loop keeps calling the graph
    it captured, and one called through dynamo (a capture not recognised) is traced again under
    rgc's own settings (no duck sizing), so two sizes that happened to be equal then (2 and 2
    here) are no guard that a later call fails: no recompile under the user's
    ``error_on_recompile``, no eager fallback, the same bits."""
    from rgc.ops import reference

    cases = [(2, [1]), (8, [1]), (8, [1, 2, 3])]  # a lone seed of 4 pairs: a 2 x 2 call
    want = [reference.gaussian_matrices(k, 4, seeds, "cpu") for k, seeds in cases]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [reference.gaussian_matrices(k, 4, seeds, "cpu") for k, seeds in cases]
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_dynamo
def test_a_loops_graph_serves_other_grad_modes_threads_and_dispatch_keys_untraced():
    """A loop traced once is not traced again for a call under another grad mode, thread
    count or the dispatch keys of an operator's kernel (below autograd): the same graph, the
    same bits. Another layout (a transposed input) is another graph."""
    from rgc.ops import reference

    loop = reference._compiled(reference._halving_sums)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7))

    def traced() -> int:
        return sum(len(states) for states in loop.variants.values())

    with torch.no_grad():
        want = loop(x, 512, True)
    before = traced()
    threads = torch.get_num_threads()
    with torch.enable_grad():
        got = [loop(x, 512, True)]
    with torch._C._AutoDispatchBelowADInplaceOrView():
        got.append(loop(x, 512, True))
    torch.set_num_threads(threads + 1)
    try:
        got.append(loop(x, 512, True))
    finally:
        torch.set_num_threads(threads)
    assert traced() == before
    for again in got:
        assert torch.equal(again.view(torch.int32), want.view(torch.int32))
    transposed = x.t().contiguous().t()
    assert reference._graph_key((transposed, 512, True)) != reference._graph_key((x, 512, True))


def test_cpu_norm_converts_one_block_at_a_time_whatever_dynamo_does(monkeypatch):
    """The norm is eager torch (no compiled loop), one float64 block of at most the bytes of
    a chunk of H at a time: no copy of the whole weight, and the same bits with every loop
    made eager."""
    from rgc.memory import track
    from rgc.ops import reference

    w = torch.randn(1, 1024, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = reference.sum_squares([w], 128)
    monkeypatch.setattr(reference, "_compiled", lambda fn, eager=None: eager or fn)
    with track() as t:
        eager = reference.sum_squares([w], 128)
    assert torch.equal(before.view(torch.int32), eager.view(torch.int32))
    assert float(eager[0, 0]) == float(w.double().square().sum().float())
    # one float64 block, at most the bytes of a 128-row FP32 chunk of H
    assert 0 < t.peak <= 8 * min(reference.SQUARE_SUM_BLOCK, 128 * 1024 // 2) + 8192


@needs_dynamo
def test_every_cpu_loop_once_traced_runs_its_graph_without_dynamo():
    """After its first call a loop calls inductor's compiled graph directly (~10 us, not the
    ~55 us of dynamo's frame, guards and wrappers): every variant the CPU step and refresh use
    is recognised on this torch. The tests comparing compiled with eager loops cover its
    bits."""
    from rgc.ops import reference

    g = torch.Generator().manual_seed(4)
    w = torch.randn(1, 300, 200, generator=g).bfloat16()
    reference.lowrank_update_([w], [torch.randn(1, 300, 8, generator=g)],
                              [torch.randn(200, 8, generator=g)], torch.ones(1, 1) * 1e-3,
                              None, [3], [0], [200], True, 128, torch.zeros(1, 1))
    reference.lowrank_update_([w], [torch.randn(1, 300, 8, generator=g)],
                              [torch.randn(200, 8, generator=g)], torch.ones(1, 1) * 1e-3,
                              None, [3], [0], [200], True, 128, None)
    reference.gaussian_matrices(64, 8, [1, 2], "cpu")
    reference.pairwise_sums(torch.randn(64, 512, generator=g), square=True)
    cpu = torch.device("cpu")
    loops = [reference._int32_loop(reference._update_words_norm, cpu,
                                   reference._update_words_norm_blocked),
             reference._int32_loop(reference._update_words, cpu),
             reference._compiled(reference._gaussian_pairs, reference._gaussian_pairs_blocked),
             reference._compiled(reference._halving_sums)]
    for loop in loops:
        variants = [v for vs in loop.variants.values() for v in vs]
        assert variants, loop
        assert all(v.direct is not None for v in variants), loop
