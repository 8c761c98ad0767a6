"""RGCOptimizer's momentum in sketch space and per-row normalisation, against dense float64
references written here."""

import copy
import io

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import rgc
from rgc import CompressedLinear, RGCOptimizer
from tests.models import TinyBlockLM


def _batches(seed: int, steps: int, n: int, k: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g), torch.randn(n, d, generator=g))
            for _ in range(steps)]


@settings(max_examples=16, deadline=None)
@given(d=st.integers(3, 24), k=st.integers(4, 24), rank=st.integers(1, 4),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       row_norm=st.booleans(), refresh=st.sampled_from(["never", 2, "every_step"]),
       kind=st.sampled_from(["orthonormal", "rademacher"]), seed=st.integers(0, 2**16))
def test_rules_follow_the_float64_formula(d, k, rank, momentum, nesterov, row_norm, refresh,
                                          kind, seed):
    """M <- beta M + G P; D = M (Nesterov: G P + beta M); with row_norm each row of D divided by
    its norm in H = D P^T; W <- W - tau ||W|| H/||H||; at a refresh
    M <- M (P_old^T P_old)^+ P_old^T P_new. G = dout^T x, dense, in float64."""
    rank, nesterov = min(rank, k), nesterov and momentum > 0
    torch.manual_seed(seed)
    layer = CompressedLinear.from_linear(nn.Linear(k, d, bias=False), rank, projection=kind,
                                         refresh=refresh, seed=seed)
    opt = RGCOptimizer([layer.weight], lr=0.05, momentum=momentum, nesterov=nesterov,
                       row_norm=row_norm)
    w = layer.weight.detach().double().clone()
    m = torch.zeros(d, rank, dtype=torch.float64)
    for x, dout in _batches(seed, 5, 6, k, d):
        p = layer.projection.double()
        layer(x).backward(dout)
        c = dout.double().T @ x.double() @ p
        m = momentum * m + c
        h = ((c + momentum * m) if nesterov else m) @ p.T
        if row_norm:
            h = h / h.norm(dim=1, keepdim=True)
        w = w - 0.05 * w.norm() * h / h.norm()
        opt.step()
        new = layer.projection.double()
        if not torch.equal(new, p):
            m = m @ torch.linalg.pinv(p.T @ p) @ (p.T @ new)
        torch.testing.assert_close(layer.weight.double(), w, rtol=2e-5, atol=2e-6)
        if momentum:
            torch.testing.assert_close(opt.state[layer.weight]["momentum_buffer"].double(), m,
                                       rtol=2e-5, atol=2e-5)


def test_momentum_zero_is_the_plain_rule_bit_for_bit():
    def run(**momentum):
        torch.manual_seed(0)
        model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7)
        opt = RGCOptimizer(model.parameters(), lr=1e-2, seed=3, **momentum)
        _train(model, opt, range(3))
        return model, opt

    plain, _ = run()
    zero, opt = run(momentum=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), zero.parameters()))
    assert not any("momentum_buffer" in s for s in opt.state.values())


def _train(model, opt, seeds):
    for i in seeds:
        tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()


@pytest.mark.parametrize("row_norm", [False, True])
def test_non_finite_sketch_keeps_the_buffer_and_the_weight(row_norm):
    layer = CompressedLinear(6, 5, rank=2, refresh="never")
    opt = RGCOptimizer([layer.weight], lr=0.1, momentum=0.9, row_norm=row_norm)
    layer(torch.randn(3, 6)).sum().backward()
    opt.step()
    buffer, weight = (opt.state[layer.weight]["momentum_buffer"].clone(),
                      layer.weight.detach().clone())
    layer(torch.randn(3, 6)).sum().backward()
    layer.sketch[0, 0] = float("inf")
    opt.step()
    assert torch.equal(opt.state[layer.weight]["momentum_buffer"], buffer)
    assert torch.equal(layer.weight, weight)
    assert int(opt.state[layer.weight]["skipped"]) == 1


def test_state_dict_round_trip_resumes_bit_identically():
    model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7, refresh=2)
    opt = RGCOptimizer(model.parameters(), lr=1e-2, seed=3, momentum=0.9, nesterov=True,
                       row_norm=True)
    _train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(3, 6))

    buf.seek(0)
    saved = torch.load(buf)
    resumed = TinyBlockLM(dtype=torch.bfloat16)
    resumed.load_state_dict(saved["model"])
    rgc.wrap(resumed, rank=4, seed=7, refresh=2)
    opt2 = RGCOptimizer(resumed.parameters(), lr=1e-2, seed=3, momentum=0.9, nesterov=True,
                        row_norm=True)
    opt2.load_state_dict(saved["opt"])
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in opt2.state.values())
    _train(resumed, opt2, range(3, 6))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_momentum_argument_errors():
    layer = CompressedLinear(6, 5, rank=2)
    for bad in (1.0, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="momentum must be a number in"):
            RGCOptimizer([layer.weight], lr=0.1, momentum=bad)
    with pytest.raises(ValueError, match="nesterov=True needs a momentum"):
        RGCOptimizer([layer.weight], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="row_norm must be True or False"):
        RGCOptimizer([layer.weight], lr=0.1, row_norm=1)
    opt = RGCOptimizer([layer.weight], lr=0.1)
    with pytest.raises(ValueError, match="momentum must be a number in"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "momentum": 2.0})


def test_copies_train_alike():
    model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7, refresh=3)
    opt = RGCOptimizer(model.parameters(), lr=1e-2, momentum=0.9, row_norm=True)
    _train(model, opt, range(2))
    twin, twin_opt = copy.deepcopy((model, opt))
    _train(model, opt, range(2, 5))
    _train(twin, twin_opt, range(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_rows_bits_do_not_depend_on_the_rows_given_with_it():
    """normalize_rows_ on a matrix and on each of its row blocks (an FSDP2 shard) agree."""
    from rgc.optim.rules import normalize_rows_

    g = torch.Generator().manual_seed(5)
    sketch, p = torch.randn(1, 37, 8, generator=g), torch.randn(96, 8, generator=g)
    whole = sketch.clone()
    normalize_rows_([whole], [p])
    for rows in (slice(0, 1), slice(1, 19), slice(19, 37)):
        part = sketch[:, rows].clone()
        normalize_rows_([part], [p])
        assert torch.equal(part, whole[:, rows])
