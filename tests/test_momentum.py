"""RGCOptimizer's momentum in sketch space, against dense float64 references written here."""

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


@settings(max_examples=12, deadline=None)
@given(d=st.integers(3, 24), k=st.integers(4, 24), rank=st.integers(1, 4),
       momentum=st.sampled_from([0.5, 0.9]), nesterov=st.booleans(),
       refresh=st.sampled_from(["never", 2, "every_step"]),
       kind=st.sampled_from(["orthonormal", "rademacher"]), seed=st.integers(0, 2**16))
def test_momentum_follows_the_float64_formula(d, k, rank, momentum, nesterov, refresh, kind,
                                               seed):
    """M <- beta M + G P; H = M P^T (Nesterov: (G P + beta M) P^T); W <- W - tau ||W|| H/||H||;
    at a refresh M <- M (P_old^T P_old)^+ P_old^T P_new. G = dout^T x, dense, in float64."""
    rank = min(rank, k)
    torch.manual_seed(seed)
    layer = CompressedLinear.from_linear(nn.Linear(k, d, bias=False), rank, projection=kind,
                                         refresh=refresh, seed=seed)
    opt = RGCOptimizer([layer.weight], lr=0.05, momentum=momentum, nesterov=nesterov)
    w = layer.weight.detach().double().clone()
    m = torch.zeros(d, rank, dtype=torch.float64)
    for x, dout in _batches(seed, 5, 6, k, d):
        p = layer.projection.double()
        layer(x).backward(dout)
        c = dout.double().T @ x.double() @ p
        m = momentum * m + c
        h = ((c + momentum * m) if nesterov else m) @ p.T
        w = w - 0.05 * w.norm() * h / h.norm()
        opt.step()
        new = layer.projection.double()
        if not torch.equal(new, p):
            m = m @ torch.linalg.pinv(p.T @ p) @ (p.T @ new)
        torch.testing.assert_close(layer.weight.double(), w, rtol=2e-5, atol=2e-6)
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


def test_non_finite_sketch_keeps_the_buffer_and_the_weight():
    layer = CompressedLinear(6, 5, rank=2, refresh="never")
    opt = RGCOptimizer([layer.weight], lr=0.1, momentum=0.9)
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
    opt = RGCOptimizer(model.parameters(), lr=1e-2, seed=3, momentum=0.9, nesterov=True)
    _train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(3, 6))

    buf.seek(0)
    saved = torch.load(buf)
    resumed = TinyBlockLM(dtype=torch.bfloat16)
    resumed.load_state_dict(saved["model"])
    rgc.wrap(resumed, rank=4, seed=7, refresh=2)
    opt2 = RGCOptimizer(resumed.parameters(), lr=1e-2, seed=3, momentum=0.9, nesterov=True)
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
    opt = RGCOptimizer([layer.weight], lr=0.1)
    with pytest.raises(ValueError, match="momentum must be a number in"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "momentum": 2.0})


def test_copies_train_alike():
    model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7, refresh=3)
    opt = RGCOptimizer(model.parameters(), lr=1e-2, momentum=0.9)
    _train(model, opt, range(2))
    twin, twin_opt = copy.deepcopy((model, opt))
    _train(model, opt, range(2, 5))
    _train(twin, twin_opt, range(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
