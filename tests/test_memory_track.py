import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rgc
from rgc.memory import track

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]


@given(n=st.integers(1, 5000), m=st.integers(1, 5000), dtype=st.sampled_from(DTYPES))
def test_peak_of_known_allocations(n, m, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    with track() as t:
        a = torch.zeros(n, dtype=dtype)
        assert t.current == n * size
        b = torch.ones(m, dtype=dtype)
        assert t.current == (n + m) * size
        del a
        assert t.current == m * size
        c = torch.empty(3, dtype=dtype)
        del b, c
        assert t.current == 0
    assert t.peak == max(n + m, m + 3) * size
    assert t.largest.nbytes == max(n, m, 3) * size


def test_views_and_in_place_ops_allocate_nothing():
    before = torch.zeros(64, 32)  # allocated outside the block: never counted
    with track() as t:
        a = torch.zeros(64, 32)
        base = t.current
        views = [a.view(-1), a.t(), a[::2], a.reshape(32, 64), a.detach(), a.unsqueeze(0)]
        a.add_(1).mul_(2)
        before.copy_(a)
        before.t().add_(1)
        torch.add(a, 1, out=a)
        assert t.current == base == 64 * 32 * 4
        del views
    assert t.peak == 64 * 32 * 4
    assert [x.shape for x in t.allocations] == [(64, 32)]


def test_reset_peak():
    with track() as t:
        a = torch.zeros(1000)
        b = torch.zeros(1000)
        del b
        t.reset_peak()
        assert t.peak == 4000
        c = torch.zeros(10)
    assert t.peak == 4040
    del a, c


def test_categories_activations_backward_optimizer():
    x = torch.randn(100, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1, momentum=0.9)
    with track() as t:
        y = x.exp()  # exp saves its 400-byte result for backward
        loss = y.sum()
        assert t.current_breakdown["activations"] == 400
        loss.backward()
        grads = t.current - t.current_breakdown["other"] - t.current_breakdown["activations"]
        assert grads >= 400  # x.grad, allocated during backward
        opt.step()  # the momentum buffer (400 bytes) is allocated inside step()
        assert t.current_breakdown["optimizer"] == 400
    assert {a.category for a in t.allocations} == {"other", "backward", "optimizer"}


def test_no_dense_weight_gradient_in_an_rgc_step():
    d, k, r, n = 96, 80, 8, 40
    lin = torch.nn.Linear(k, d, bias=False, dtype=torch.bfloat16)
    layer = rgc.CompressedLinear.from_linear(lin, r)
    opt = rgc.RGCOptimizer([layer.weight], lr=1e-2, chunk_rows=32)
    x = torch.randn(n, k, dtype=torch.bfloat16)
    with track() as t:
        layer(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    t.assert_no_shape((d, k), (k, d))
    assert (d, r) in t.shapes()  # the sketch
    assert t.largest.nbytes < d * k * 4

    # The same check fails on an ordinary layer, which allocates the d x k gradient.
    dense = torch.nn.Linear(k, d, bias=False, dtype=torch.bfloat16)
    with track() as t:
        dense(x).square().sum().backward()
    with pytest.raises(AssertionError, match="forbidden"):
        t.assert_no_shape((d, k), (k, d))


def test_device_filter():
    with track(device="meta") as t:
        torch.zeros(1000)
        torch.zeros(10, device="meta")
    assert t.peak == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_matches_allocator():
    torch.zeros(1, device="cuda")
    with track() as t:
        a = torch.empty(1 << 20, device="cuda")
        b = torch.empty(1 << 19, device="cuda")
        del a, b
    assert t.peak == (1 << 20) * 4 + (1 << 19) * 4
    assert t.cuda_peak == t.peak  # allocator blocks of 2 MiB multiples: no rounding here
