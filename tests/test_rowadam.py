import copy
import io
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import rgc
import rgc.ops.reference
from rgc.optim.rules import carry_moment
from rgc.sketched import SketchedWeight
from tests.halving import halving_sums


def _model(d_in, hidden, d_out, *, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden, bias=bias), nn.Tanh(),
                         nn.Linear(hidden, d_out, bias=bias)).to(dtype)


def _batches(n, d_in, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, d_in, generator=g), torch.randn(n, generator=g))
            for _ in range(steps)]


@settings(max_examples=10)
@given(d_in=st.integers(6, 20), hidden=st.integers(3, 12), rank=st.integers(1, 5),
       beta1=st.sampled_from([0.0, 0.9]), wd=st.sampled_from([0.0, 0.1]),
       refresh=st.sampled_from(["never", "every_step", 2]), seed=st.integers(0, 2**16))
def test_rowadam_matches_float64_reference(d_in, hidden, rank, beta1, wd, refresh, seed):
    """Weights, moments and biases follow the documented formula, written here in float64."""
    model = _model(d_in, hidden, 3, seed=seed)
    rgc.wrap(model, rank, targets=["0", "2"], projection="gaussian", refresh=refresh,
             freeze_others=False)
    lr, betas, eps = 3e-2, (beta1, 0.99), 1e-6
    opt = rgc.RowAdam(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                      stochastic_rounding=False)
    ref = {id(p): p.detach().double().clone() for p in model.parameters()}
    m_ref, v_ref = {}, {}
    layers = (model[0], model[2])

    def adam(key, g, t, row):
        m = betas[0] * m_ref.get(key, 0.0) + (1 - betas[0]) * g
        g2 = (g ** 2).mean(1) if row else g ** 2
        v = betas[1] * v_ref.get(key, 0.0) + (1 - betas[1]) * g2
        m_ref[key], v_ref[key] = m, v
        denom = (v / (1 - betas[1] ** t)).sqrt() + eps
        return (m / (1 - betas[0] ** t)) / (denom[:, None] if row else denom)

    for t, (x, y) in enumerate(_batches(5, d_in, 4, seed), start=1):
        opt.zero_grad()
        ((model(x).sum(-1) - y) ** 2).mean().backward()
        old = {}
        for mod in layers:
            w, b = id(mod.weight), id(mod.bias)
            old[mod] = mod.projection.double()
            u = adam(w, mod.sketch.double(), t, row=True)
            ref[w] = ref[w] * (1 - lr * wd) - lr * u @ old[mod].t()
            ref[b] = ref[b] * (1 - lr * wd) - lr * adam(b, mod.bias.grad.double(), t, row=False)
        opt.step()
        for mod in layers:  # a new P carries m into its basis: m (P_o^T P_o)^+ P_o^T P_new
            p_o, p_n = old[mod], mod.projection.double()
            if not torch.equal(p_o, p_n):  # (r > k makes the Gram singular: pseudo-inverse)
                m_ref[id(mod.weight)] = (m_ref[id(mod.weight)] @ torch.linalg.pinv(p_o.t() @ p_o)
                                         @ (p_o.t() @ p_n))
    for p in model.parameters():
        torch.testing.assert_close(p.double(), ref[id(p)], rtol=1e-5, atol=1e-6)
    for mod in layers:
        state = opt.state[mod.weight]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert state["exp_avg_sq"].shape == (mod.out_features,)
        torch.testing.assert_close(state["exp_avg"].double(), m_ref[id(mod.weight)],
                                   rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v_ref[id(mod.weight)],
                                   rtol=1e-4, atol=1e-9)


def test_carry_moment_orthonormal_and_identity():
    k, r, d = 24, 6, 5
    p_old = rgc.make_projection("orthonormal", k, r, seed=1)
    p_new = rgc.make_projection("orthonormal", k, r, seed=2)
    m = torch.randn(d, r)
    expected = m.double() @ p_old.double().t() @ p_new.double() / (k / r)
    torch.testing.assert_close(carry_moment(m, p_old, p_new).double(), expected, rtol=1e-5,
                               atol=1e-6)
    rad = rgc.make_projection("rademacher", k, r, seed=3)
    torch.testing.assert_close(carry_moment(m, rad, rad), m, rtol=1e-5, atol=1e-6)


@given(d=st.integers(2, 300), r=st.integers(1, 40), split=st.floats(0.01, 0.99),
       seed=st.integers(0, 2**31 - 1))
def test_carry_moment_gives_a_row_the_same_bits_whatever_rows_come_with_it(d, r, split, seed):
    """A rank's shard of m (FSDP2) carries as the same rows of the whole m do: an FP32 GEMM
    over fewer rows took another kernel with other last bits. Also within 2 FP32 ulps of the
    float64 product written out here."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, r, generator=g)
    p_old, p_new = torch.randn(3 * r, r, generator=g), torch.randn(3 * r, r, generator=g)
    rows = max(1, int(d * split))
    whole = carry_moment(m, p_old, p_new)
    assert torch.equal(whole[:rows], carry_moment(m[:rows].clone(), p_old, p_new))
    assert torch.equal(whole[rows:], carry_moment(m[rows:].clone(), p_old, p_new))
    old, new = p_old.double(), p_new.double()
    want = m.double() @ torch.linalg.solve(old.t() @ old, old.t() @ new)
    torch.testing.assert_close(whole.double(), want, rtol=2.5e-7, atol=1e-9)


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        ((model(x.to(model[0].weight.dtype)).sum(-1).float() - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("refresh", ["every_step", "never"])
def test_state_dict_round_trip_resumes_bit_identically(refresh):
    """BF16 weights with stochastic rounding: save after 3 steps, load into a fresh optimizer
    and model copy, then 3 more steps on both give identical bits (moments stay FP32, the
    int64 layer seed and projection version survive torch.optim's dtype casting)."""
    model = _model(16, 12, 4, dtype=torch.bfloat16)
    rgc.wrap(model, 4, targets=["0", "2"], preset="logra", refresh=refresh, seed=7,
             freeze_others=False)
    opt = rgc.RowAdam(model.parameters(), lr=1e-2, weight_decay=0.01, seed=5)
    batches = _batches(6, 16, 6, seed=1)
    _train(model, opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)

    clone = _model(16, 12, 4, dtype=torch.bfloat16, seed=99)
    rgc.wrap(clone, 4, targets=["0", "2"], preset="logra", refresh=refresh, seed=123,
             freeze_others=False)
    buf.seek(0)
    saved = torch.load(buf)
    clone.load_state_dict(saved["model"])
    opt2 = rgc.RowAdam(clone.parameters(), lr=1e-2, weight_decay=0.01, seed=5)
    opt2.load_state_dict(saved["opt"])
    assert clone[0].seed == model[0].seed and torch.equal(clone[0].projection,
                                                          model[0].projection)
    state = opt2.state[clone[0].weight]
    assert state["exp_avg"].dtype == torch.float32 and state["layer_seed"] == model[0].seed
    _train(model, opt, batches[3:])
    _train(clone, opt2, batches[3:])
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)


def test_nonfinite_sketch_is_skipped_and_state_untouched():
    model = _model(8, 6, 2, bias=False)
    rgc.wrap(model, 3, targets=["0", "2"], preset="logra")
    opt = rgc.RowAdam(model.parameters(), lr=1e-2)
    batches = _batches(4, 8, 2, seed=0)
    _train(model, opt, batches[:1])
    before = [p.clone() for p in model.parameters()]
    m_before = opt.state[model[0].weight]["exp_avg"].clone()
    x, y = batches[1]
    opt.zero_grad()
    ((model(x).sum(-1) - y) ** 2).mean().backward()
    model[0].sketch[0, 0] = float("nan")
    opt.step()
    with pytest.warns(RuntimeWarning, match="non-finite sketch"):
        assert opt.skipped_updates() == 1
    assert torch.equal(model[0].weight, before[0])
    assert not torch.equal(model[2].weight, before[1])
    state = opt.state[model[0].weight]
    assert int(state["skipped"]) == 1 and int(state["step"]) == 2
    assert torch.equal(state["exp_avg"], m_before)


def test_rowadam_reduces_loss():
    torch.manual_seed(0)
    teacher = nn.Linear(32, 16)
    model = nn.Sequential(nn.Linear(32, 16))
    rgc.wrap(model, 8, targets=["0"], projection="rademacher", refresh="every_step",
             freeze_others=False)
    opt = rgc.RowAdam(model.parameters(), lr=2e-2)
    x = torch.randn(64, 32)
    y = teacher(x).detach()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "lr"), (dict(lr=1e-3, betas=(0.9, 1.0)), "betas"),
    (dict(lr=1e-3, eps=math.nan), "eps"), (dict(lr=1e-3, weight_decay=-0.1), "weight_decay"),
    (dict(lr=1e-3, step_control=object()), "step_control"),
])
def test_rowadam_rejects_bad_hyperparameters(kwargs, match):
    model = _model(8, 6, 2)
    rgc.wrap(model, 3, targets=["0"])
    with pytest.raises((ValueError, TypeError), match=match):
        rgc.RowAdam(model.parameters(), **kwargs)


def test_wrap_presets():
    logra = rgc.wrap(_model(8, 6, 2), 3, targets=["0", "2"], preset="logra")
    assert (logra[0].projection_kind, logra[0].refresh) == ("rademacher", "never")
    default = rgc.wrap(_model(8, 6, 2), 3, targets=["0"])
    assert (default[0].projection_kind, default[0].refresh) == ("orthonormal", "every_step")
    mixed = rgc.wrap(_model(8, 6, 2), 3, targets=["0"], preset="logra", refresh=5)
    assert (mixed[0].projection_kind, mixed[0].refresh) == ("rademacher", 5)
    with pytest.raises(ValueError, match="preset"):
        rgc.wrap(_model(8, 6, 2), 3, preset="galore")
    assert copy.deepcopy(logra)[0].refresh == "never"


def test_skipped_update_does_not_count_in_bias_correction():
    """FP32 weights: a first step skipped for a NaN sketch, then a step with sketch S, moves W
    exactly as a fresh optimizer's first step with S (t = applied updates = 1 in both)."""
    def run(skip_first: bool):
        model = _model(8, 6, 2, bias=False)
        rgc.wrap(model, 3, targets=["0"], preset="logra", seed=4)
        opt = rgc.RowAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
        x, y = _batches(1, 8, 2, seed=3)[0]
        if skip_first:
            ((model(x).sum(-1) - y) ** 2).mean().backward()
            model[0].sketch.fill_(float("nan"))
            before = model[0].weight.detach().clone()
            opt.step()
            assert torch.equal(model[0].weight, before)
            opt.zero_grad()
        ((model(x).sum(-1) - y) ** 2).mean().backward()
        opt.step()
        return model[0].weight.detach().clone(), opt
    skipped, opt = run(True)
    fresh, _ = run(False)
    assert torch.equal(skipped, fresh)
    assert int(opt.state[opt.param_groups[0]["params"][0]]["skipped"]) == 1


class ExpertStack(SketchedWeight):
    """A bare owner of an ``[E, d, k]`` expert weight whose sketch the test sets by hand."""

    def __init__(self, e, d, k, rank, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(e, d, k, generator=g))
        self.in_features, self.out_features, self.num_matrices = k, d, e
        self._setup_sketching(rank, "rademacher", "never", seed)
        self.projection = self._make_projection()
        self._new_sketch_slot()
        self._register()

    @property
    def sketch_shape(self):
        return (self.num_matrices, self.out_features, self.rank)

    def weight_matrices(self):
        return self.weight


def test_expert_stacks_count_applied_updates_per_expert():
    """Experts follow the formula (float64 here) with t counted per expert: an expert with a
    zero sketch (no token) or a non-finite one is not updated and does not count."""
    e, d, k, r, lr, wd, betas, eps = 3, 6, 10, 4, 1e-2, 0.1, (0.9, 0.99), 1e-6
    stacks = [ExpertStack(e, d, k, r, seed=s) for s in (1, 2)]
    opt = rgc.RowAdam([s.weight for s in stacks], lr=lr, betas=betas, eps=eps,
                      weight_decay=wd, stochastic_rounding=False)
    ref = [s.weight.detach().double().clone() for s in stacks]
    m_ref = [torch.zeros(e, d, r, dtype=torch.float64) for _ in stacks]
    v_ref = [torch.zeros(e, d, dtype=torch.float64) for _ in stacks]
    t_ref = [torch.zeros(e, dtype=torch.int64) for _ in stacks]
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        for i, s in enumerate(stacks):
            sketch = torch.randn(e, d, r, generator=g)
            if step % 2:
                sketch[1] = 0.0  # expert 1 received no token
            if step == 2 and i == 0:
                sketch[2, 0, 0] = math.inf
            s.sketch = sketch
            p = s.projection.double()
            for x in range(e):
                c = sketch[x].double()
                if not (torch.isfinite(c).all() and (c != 0).any()):
                    continue
                t_ref[i][x] += 1
                t = int(t_ref[i][x])
                m_ref[i][x] = betas[0] * m_ref[i][x] + (1 - betas[0]) * c
                v_ref[i][x] = betas[1] * v_ref[i][x] + (1 - betas[1]) * (c ** 2).mean(1)
                u = (m_ref[i][x] / (1 - betas[0] ** t)) / (
                    (v_ref[i][x] / (1 - betas[1] ** t)).sqrt() + eps)[:, None]
                ref[i][x] = ref[i][x] * (1 - lr * wd) - lr * u @ p.t()
        opt.step()
    for i, s in enumerate(stacks):
        state = opt.state[s.weight]
        assert torch.equal(state["expert_updates"], t_ref[i])
        assert state["exp_avg"].shape == (e, d, r) and state["exp_avg_sq"].shape == (e, d)
        torch.testing.assert_close(state["exp_avg"].double(), m_ref[i], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v_ref[i], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(s.weight.detach().double(), ref[i], rtol=1e-5, atol=1e-6)
    with pytest.warns(RuntimeWarning, match="non-finite sketch"):
        assert opt.skipped_updates() == 1


@pytest.mark.parametrize("maximize", [False, True])
def test_reference_moments_are_rowadams_fp32_operations(maximize):
    """The bit contract of rgc.ops.row_adam_'s reference, written out in numpy float32: each
    product, sum and quotient rounded once (no fused multiply-add), the row mean of g^2 as the
    halving sum of the contract divided by r, the square root correctly rounded, the bias
    corrections formed in float64 and rounded once."""
    g = torch.Generator().manual_seed(3)
    d, r, beta1, beta2, eps = 37, 9, 0.9, 0.999, 1e-8
    s, m, v = torch.randn(d, r, generator=g), torch.randn(d, r, generator=g), torch.rand(d)
    f32 = np.float32
    for ok, t in [(True, 7), (False, 3)]:
        grad = -s.numpy() if maximize else s.numpy()
        want_m, want_v = m.numpy().copy(), v.numpy().copy()
        if ok:
            want_m = want_m * f32(beta1) + grad * f32(1.0 - beta1)
            mean = halving_sums(torch.from_numpy(grad), square=True) / f32(r)
            want_v = want_v * f32(beta2) + mean * f32(1.0 - beta2)
        c1, c2 = f32(1.0 - beta1 ** t), f32(1.0 - beta2 ** t)
        root = np.sqrt((want_v / c2).astype(np.float64)).astype(f32)
        want_u = (want_m / c1) / (root + f32(eps))[:, None]
        got_s, got_m, got_v = s.clone(), m.clone(), v.clone()
        rgc.ops.reference.row_adam_([got_s[None]], [got_m[None]], [got_v[None]],
                                    torch.tensor([[ok]]), torch.tensor([[t]]), beta1, beta2,
                                    eps, maximize)
        for got, want in ((got_s, want_u), (got_m, want_m), (got_v, want_v)):
            assert np.array_equal(got.numpy().view(np.int32), want.astype(f32).view(np.int32))
