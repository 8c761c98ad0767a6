import io
import math

import pytest
import torch
import torch.nn as nn

import rgc
from rgc import CompressedLinear, RGCOptimizer, make_projection
from rgc.ops import reference
from rgc.updates import apply_lowrank_update_
from tests.models import TinyBlockLM


def rebuild_h(sketch, projection, chunk_rows=128):
    """H = C P^T through the library's chunked update of a zero FP32 matrix with coef -1."""
    h = torch.zeros(sketch.shape[0], projection.shape[0])
    apply_lowrank_update_(h, sketch, projection, -1.0, seed=0, chunk_rows=chunk_rows)
    return h


@pytest.mark.slow
@pytest.mark.parametrize("kind", rgc.PROJECTION_KINDS)
def test_rebuilt_h_is_unbiased_over_projection_seeds(kind):
    # Mean of H over 3000 projections converges to G = D^T X. The relative error of the mean
    # is about sqrt(k / (r n)) ~ 0.03 here; the tolerance is 0.1.
    torch.manual_seed(0)
    d, k, r, n = 5, 12, 3, 3000
    lin = nn.Linear(k, d, bias=False)
    x, dout = torch.randn(16, k), torch.randn(16, d)
    g = dout.double().T @ x.double()
    mean_h = torch.zeros(d, k, dtype=torch.float64)
    for seed in range(n):
        layer = CompressedLinear.from_linear(lin, r, projection=kind, seed=seed)
        layer(x).backward(dout)
        mean_h += rebuild_h(layer.sketch, layer.projection).double()
    mean_h /= n
    assert (mean_h - g).norm() / g.norm() < 0.1


def test_chunked_rebuild_equals_one_shot():
    torch.manual_seed(1)
    c, p = torch.randn(37, 6), make_projection("orthonormal", 50, 6, seed=2)
    one_shot = (c.double() @ p.double().T)
    for chunk in (1, 5, 36, 37, 128):
        torch.testing.assert_close(rebuild_h(c, p, chunk).double(), one_shot, rtol=1e-5,
                                   atol=1e-5)


def one_layer(dtype, d=40, k=30, r=5, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, d, bias=False, dtype=dtype)
    layer = CompressedLinear.from_linear(lin, r, seed=seed)
    x, dout = torch.randn(8, k, dtype=dtype), torch.randn(8, d, dtype=dtype)
    layer(x).backward(dout)
    return layer


def test_fp32_step_matches_the_formula_exactly():
    layer = one_layer(torch.float32)
    w0 = layer.weight.detach().double().clone()
    c, p = layer.sketch.double(), layer.projection.double()
    h = c @ p.T
    tau = 0.01
    RGCOptimizer([layer.weight], lr=tau).step()
    expected = w0 - tau * w0.norm() * h / h.norm()
    torch.testing.assert_close(layer.weight.double(), expected, rtol=1e-6, atol=1e-7)
    assert abs((layer.weight.double() - w0).norm() / w0.norm() - tau) < 1e-5


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_decoupled_weight_decay_is_folded_into_the_step(lr_kind):
    layer = one_layer(torch.float32)
    idle = CompressedLinear(5, 7, rank=2, seed=1)  # no backward: no sketch, not stepped
    bias = nn.Parameter(torch.randn(6, dtype=torch.float64).float())
    bias.grad = torch.randn(6)
    w0, b0, g = (layer.weight.detach().double().clone(), bias.detach().double().clone(),
                 bias.grad.double())
    idle0 = idle.weight.detach().clone()
    h = layer.sketch.double() @ layer.projection.double().T
    tau, wd = 0.01, 0.5
    lr = torch.tensor(tau) if lr_kind == "tensor" else tau
    RGCOptimizer([layer.weight, bias, idle.weight], lr=lr, weight_decay=wd).step()
    tau = float(torch.tensor(tau)) if lr_kind == "tensor" else tau  # the FP32 value used
    expected = w0 * (1 - tau * wd) - tau * w0.norm() * h / h.norm()
    torch.testing.assert_close(layer.weight.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bias.double(), b0 * (1 - tau * wd) - tau * b0.norm() * g / g.norm(),
                               rtol=1e-6, atol=1e-7)
    assert torch.equal(idle.weight, idle0)  # decay only where there is an update
    with pytest.raises(ValueError, match="weight_decay"):
        RGCOptimizer([layer.weight], lr=0.1, weight_decay=-1.0)


def bf16_below(x: torch.Tensor) -> torch.Tensor:
    """The largest BF16 number <= x (float64 in, float64 out; finite x)."""
    b = x.bfloat16().double()
    return torch.where(b > x, torch.nextafter(b.bfloat16(), torch.tensor(-math.inf,
                                                                         dtype=torch.bfloat16))
                       .double(), b)


def bf16_above(x: torch.Tensor) -> torch.Tensor:
    """The smallest BF16 number >= x."""
    return -bf16_below(-x)


def test_bf16_step_size_is_tau_within_rounding_noise():
    # ||W' - W||^2 = tau^2 ||W||^2 + (stochastic-rounding noise). The noise of an element with
    # target v between BF16 neighbours lo < hi has variance (hi - v)(v - lo); we compare the
    # measured size with sqrt(tau^2 ||W||^2 + sum of variances) within 3%.
    layer = one_layer(torch.bfloat16, d=200, k=150, r=8)
    w0 = layer.weight.detach().double().clone()
    h = layer.sketch.double() @ layer.projection.double().T
    tau = 0.01
    RGCOptimizer([layer.weight], lr=tau).step()
    delta = tau * w0.norm() * h / h.norm()
    t = w0 - delta
    down, up = bf16_below(t), bf16_above(t)
    variance = ((up - t) * (t - down)).sum()
    predicted = math.sqrt(tau**2 * w0.norm().item() ** 2 + variance.item())
    measured = (layer.weight.double() - w0).norm().item()
    assert abs(measured / predicted - 1) < 0.03
    # Each element is rounded from its FP32 value, within a few FP32 units (the GEMM's and the
    # coefficient's roundings: 64 units of 2**-24 here) of the float64 target: one of the two
    # BF16 numbers around that interval (three where the interval straddles one).
    slack = 64 * 2.0**-24 * (w0.abs() + delta.abs())
    w = layer.weight.double()
    assert ((w >= bf16_below(t - slack)) & (w <= bf16_above(t + slack))).all()
    assert (w != t).float().mean() > 0.99  # rounded: nearly no target is a BF16 number


def test_no_dense_gradient_is_allocated_in_backward_or_step():
    torch.manual_seed(0)
    d, k, r = 300, 200, 8
    layer = CompressedLinear.from_linear(nn.Linear(k, d, bias=False, dtype=torch.bfloat16), r)
    opt = RGCOptimizer([layer.weight], lr=1e-3, chunk_rows=64)
    x = torch.randn(16, k, dtype=torch.bfloat16, requires_grad=True)
    with rgc.memory.track() as rec:
        layer(x).sum().backward()
        opt.step()
    assert rec.allocations, "the tracker saw no allocation"
    assert max(math.prod(a.shape) for a in rec.allocations) < d * k, rec.largest
    rec.assert_no_shape((d, k))
    assert layer.weight.grad is None


def train_steps(model, opt, batches):
    for ids in batches:
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_resumes_bit_identically():
    batches = [torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(i))
               for i in range(6)]
    model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7, refresh=2)
    opt = RGCOptimizer(model.parameters(), lr=1e-2, seed=3)
    train_steps(model, opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train_steps(model, opt, batches[3:])

    buf.seek(0)
    saved = torch.load(buf)
    resumed = TinyBlockLM(dtype=torch.bfloat16)
    resumed.load_state_dict(saved["model"])
    rgc.wrap(resumed, rank=4, seed=7, refresh=2)
    opt2 = RGCOptimizer(resumed.parameters(), lr=1e-2, seed=3)
    opt2.load_state_dict(saved["opt"])
    train_steps(resumed, opt2, batches[3:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_refresh_schedules():
    def versions_after(refresh, steps):
        layer = CompressedLinear(6, 4, rank=2, refresh=refresh)
        opt = RGCOptimizer([layer.weight], lr=0.1)
        seen = []
        for _ in range(steps):
            layer(torch.randn(3, 6)).sum().backward()
            opt.step()
            seen.append(layer.projection_version)
        return seen

    assert versions_after("every_step", 3) == [1, 2, 3]
    assert versions_after("never", 3) == [0, 0, 0]
    assert versions_after(2, 5) == [0, 1, 1, 2, 2]


def test_projections_are_refreshed_after_every_update_of_the_step():
    layers = [CompressedLinear(6, 4, rank=2, seed=n) for n in range(3)]
    opt = RGCOptimizer([layer.weight for layer in layers], lr=0.1)
    for layer in layers:
        layer(torch.randn(3, 6)).sum().backward()
    before = [layer.weight.detach().clone() for layer in layers]
    updated_at_refresh = []
    refresh = opt._refresh_projections

    def spy(entries):
        updated_at_refresh.append([not torch.equal(layer.weight, w)
                                   for layer, w in zip(layers, before, strict=True)])
        assert [e.owner for e in entries] == layers  # all in one batched refresh
        refresh(entries)

    opt._refresh_projections = spy
    opt.step()
    assert updated_at_refresh == [[True] * 3]
    for layer in layers:
        assert layer.projection_version == opt.state[layer.weight]["projection_version"] == 1
        expected = make_projection("orthonormal", 6, 2, seed=layer.projection_seed)
        assert torch.equal(layer.projection, expected)
    assert "_deferred_refreshes" not in opt.__dict__


def test_non_finite_sketch_is_skipped_and_counted():
    model = rgc.wrap(TinyBlockLM(), rank=3)
    opt = RGCOptimizer(model.parameters(), lr=0.1)
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    bad, good = model.blocks[0].q_proj, model.blocks[0].up_proj
    bad.sketch[0, 0] = float("nan")
    w_bad, w_good = bad.weight.detach().clone(), good.weight.detach().clone()
    opt.step()  # no host read inside step(): the skip is decided and counted on the device
    assert torch.equal(bad.weight, w_bad) and not torch.equal(good.weight, w_good)
    assert int(opt.state[bad.weight]["skipped"]) == 1
    assert int(opt.state[good.weight]["skipped"]) == 0
    with pytest.warns(RuntimeWarning, match="non-finite sketch"):
        assert opt.skipped_updates() == 1
    saved = opt.state_dict()["state"].values()
    assert all(type(s["skipped"]) is int for s in saved)  # as older state dicts hold them
    assert sum(s["skipped"] for s in saved) == 1
    assert torch.isfinite(bad.sketch).all()


def test_dense_parameters_use_the_normalised_rule():
    model = rgc.wrap(TinyBlockLM(), rank=3, freeze_others=False)
    opt = RGCOptimizer(model.parameters(), lr=0.05)
    norm_w = model.blocks[0].norm.weight
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    w0, g = norm_w.detach().double().clone(), norm_w.grad.double().clone()
    opt.step()
    torch.testing.assert_close(norm_w.double(), w0 - 0.05 * w0.norm() * g / g.norm(),
                               rtol=1e-6, atol=1e-6)


def test_scheduler_closure_and_zero_grad():
    layer = CompressedLinear(6, 4, rank=2)
    opt = RGCOptimizer([layer.weight], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
    x = torch.randn(3, 6)

    def closure():
        loss = layer(x).square().sum()
        loss.backward()
        return loss

    w0 = layer.weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and not torch.equal(layer.weight, w0)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    w1 = layer.weight.detach().clone()
    opt.step(closure)
    assert torch.equal(layer.weight, w1)
    layer(x).sum().backward()
    opt.zero_grad()
    assert layer.sketch is None


def test_constructor_errors():
    layer = CompressedLinear(6, 4, rank=2)
    for kwargs, match in [(dict(lr=-1.0), "lr"), (dict(lr=float("nan")), "lr"),
                          (dict(lr=0.1, chunk_rows=0), "chunk_rows"),
                          (dict(lr=0.1, seed=-2), "seed")]:
        with pytest.raises(ValueError, match=match):
            RGCOptimizer([layer.weight], **kwargs)
    frozen = nn.Linear(3, 3).requires_grad_(False)
    with pytest.warns(UserWarning, match="no trainable parameter"):
        RGCOptimizer(frozen.parameters(), lr=0.1)


def test_weight_norm_comes_from_the_previous_update_not_a_new_read(monkeypatch):
    """||W||^2 is produced by the update (equal, bit for bit, to a separate chunked read on the
    reference path) and only re-read from W when something else wrote W."""
    original = reference.sum_squares

    def sum_squares_reference(w, chunk_rows):
        return original([w.unsqueeze(0)], chunk_rows)[0, 0]

    layer = one_layer(torch.bfloat16, d=90, k=30, r=4)
    opt = RGCOptimizer([layer.weight], lr=1e-2, chunk_rows=32)
    reads = []
    monkeypatch.setattr(reference, "sum_squares",
                        lambda ws, c: reads.append(1) or original(ws, c))
    x = torch.randn(8, 30, dtype=torch.bfloat16)
    for step in range(3):
        layer(x).float().square().sum().backward()
        opt.step()
        cached = opt.state[layer.weight]["weight_sq_norm"]
        assert cached.dtype == torch.float32
        assert torch.equal(cached, sum_squares_reference(layer.weight, chunk_rows=32))
        torch.testing.assert_close(cached.double(), layer.weight.double().square().sum(),
                                   rtol=1e-5, atol=0)
        assert len(reads) == 1, step  # the first step only
    with torch.no_grad():
        layer.weight.mul_(2)  # written outside the optimizer: the cache is stale
    w0 = layer.weight.detach().double().clone()
    layer(x).float().square().sum().backward()
    h = layer.sketch.double() @ layer.projection.double().T
    opt.step()
    assert len(reads) == 2
    step_size = (layer.weight.double() - w0).norm() / w0.norm()
    assert abs(step_size - 1e-2) < 1e-3  # tau relative to the new ||W||, not the stale one
    assert h.norm() > 0


def test_older_state_dict_without_cached_norm_resumes_bit_identically():
    """A state dict from before the cached norm (Python-int counters, no weight_sq_norm): the
    norm is recomputed from the loaded weights with the reduction the update uses."""
    batches = [torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(i))
               for i in range(5)]
    model = rgc.wrap(TinyBlockLM(dtype=torch.bfloat16), rank=4, seed=7, refresh=2)
    opt = RGCOptimizer(model.parameters(), lr=1e-2, seed=3)
    train_steps(model, opt, batches[:2])
    saved_opt = opt.state_dict()
    assert all(type(s["skipped"]) is int for s in saved_opt["state"].values())
    assert not any("weight_sq_norm_version" in s for s in saved_opt["state"].values())
    assert (sum("weight_sq_norm" in s for s in saved_opt["state"].values())
            == len(list(rgc.compressed_layers(model))) > 0)
    old = {**saved_opt, "state": {i: {k: v for k, v in s.items() if k != "weight_sq_norm"}
                                  for i, s in saved_opt["state"].items()}}
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, opt, batches[2:])

    resumed = TinyBlockLM(dtype=torch.bfloat16)
    resumed.load_state_dict(saved_model)
    rgc.wrap(resumed, rank=4, seed=7, refresh=2)
    opt2 = RGCOptimizer(resumed.parameters(), lr=1e-2, seed=3)
    opt2.load_state_dict(old)
    train_steps(resumed, opt2, batches[2:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
