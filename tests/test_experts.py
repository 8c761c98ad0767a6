"""Sketched experts against plain float64 references: the Function, the layer, the statistics."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rgc
import rgc.experts.grouped as grouped
from rgc.experts import SketchedExperts, expert_weight_names
from rgc.experts.autograd import SketchedExpertsFunction
from rgc.registry import sketched_owner_of
from tests.models import tiny_moe

# Relative Frobenius error allowed per dtype: FP32 sums, or BF16 operands and BF16 products.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(params=["auto", "loop"])
def grouped_mode(request, monkeypatch):
    """Run a test with torch's grouped GEMM where it applies, then with the per-expert loop."""
    monkeypatch.setattr(grouped, "MODE", request.param)
    return request.param


# -- the Function ---------------------------------------------------------------------------

@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       k=st.sampled_from([3, 8, 16]), d=st.sampled_from([5, 8, 16]),
       r=st.sampled_from([1, 4, 8]), per_token=st.booleans(), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       mode=st.sampled_from(["auto", "loop"]))
def test_function_matches_float64_reference(counts, k, d, r, per_token, seed, dtype, mode):
    """Y_e = X_e W_e^T, dX_e = D_e W_e and C_e = D_e^T X_e P per expert, computed plainly."""
    grouped.MODE = mode
    try:
        gen = torch.Generator().manual_seed(seed)
        num_experts, rows = len(counts), sum(counts)
        weight = torch.randn(num_experts, d, k, generator=gen).to(dtype)
        p = torch.randn(k, r, generator=gen).to(dtype)
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        tokens = torch.randn(max(rows, 1), k, generator=gen).to(dtype)
        # per token: rows read tokens[index]; else each row is its own input
        index = torch.randint(0, tokens.shape[0], (rows,), generator=gen)
        x_tokens = tokens.clone().requires_grad_(True)
        x = x_tokens[index] if per_token else tokens[:rows].clone().requires_grad_(True)
        xp = (x_tokens.detach() @ p) if per_token else None
        slot = torch.zeros(1).as_strided((num_experts, d, r), (0, 0, 0)).requires_grad_(True)
        y = SketchedExpertsFunction.apply(x, weight, offs, p, xp, index if per_token else None,
                                          slot)
        dout = torch.randn(rows, d, generator=gen).to(dtype)
        y.backward(dout)

        w64, p64, d64 = weight.double(), p.double(), dout.double()
        x64 = (tokens.double()[index] if per_token else tokens[:rows].double())
        start = 0
        for e, n in enumerate(counts):
            rows_e = slice(start, start + n)
            start += n
            if n == 0:
                assert torch.equal(slot.grad[e], torch.zeros(d, r))
                continue
            tol = REL_TOL[dtype]
            assert rel_err(y[rows_e], x64[rows_e] @ w64[e].T) < tol
            sketch = d64[rows_e].T @ x64[rows_e] @ p64
            assert rel_err(slot.grad[e], sketch) < tol
        assert slot.grad.dtype == torch.float32 and slot.grad.shape == (num_experts, d, r)
        # the input gradient, gathered back per token where rows share a token
        dx = torch.zeros(rows, k, dtype=torch.float64)
        start = 0
        for e, n in enumerate(counts):
            dx[start:start + n] = d64[start:start + n] @ w64[e]
            start += n
        if rows:
            if per_token:
                ref = torch.zeros(tokens.shape[0], k, dtype=torch.float64).index_add_(0, index,
                                                                                      dx)
                got = x_tokens.grad
            else:
                ref, got = dx, x.grad
            assert got.dtype == dtype and rel_err(got, ref) < REL_TOL[dtype] + (
                0 if dtype == torch.float32 else 1e-2)
    finally:
        grouped.MODE = "auto"


def test_native_and_loop_paths_agree_bit_for_bit_in_fp32():
    gen = torch.Generator().manual_seed(3)
    counts = [3, 0, 5, 8]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w = torch.randn(16, 8, generator=gen), torch.randn(4, 8, 12, generator=gen)
    g, xp = torch.randn(16, 12, generator=gen), torch.randn(16, 4, generator=gen)
    assert grouped.native_ok(x, w) and grouped.native_ok(g.t(), xp)
    native = grouped.grouped_mm(x, w, offs), grouped.grouped_sketch(g, xp, offs)
    grouped.MODE = "loop"
    try:
        loop = grouped.grouped_mm(x, w, offs), grouped.grouped_sketch(g, xp, offs)
    finally:
        grouped.MODE = "auto"
    torch.testing.assert_close(native[0], loop[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native[1], loop[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(native[1][1], torch.zeros(12, 4))


def test_layout_rule_of_the_grouped_gemm():
    # torch 2.13 (CPU): leading strides a multiple of 16 bytes, one dtype, no float64
    assert grouped.native_ok(torch.zeros(5, 8), torch.zeros(3, 8, 4))
    assert not grouped.native_ok(torch.zeros(5, 6), torch.zeros(3, 6, 4))  # 24-byte rows
    assert not grouped.native_ok(torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(3, 8, 8))
    assert not grouped.native_ok(torch.zeros(5, 8, dtype=torch.float64),
                                 torch.zeros(3, 8, 4, dtype=torch.float64))
    assert grouped.native_ok(torch.zeros(5, 8, dtype=torch.bfloat16),
                             torch.zeros(3, 16, 8, dtype=torch.bfloat16).transpose(1, 2))


# -- the experts layer ----------------------------------------------------------------------

def silu_gate(h):
    gate, up = h.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def gpt_oss_gate(h, alpha=1.702, limit=7.0):
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def experts_reference(module, x, index, weights):
    """float64 per token and slot, written plainly: output, dX and the dense expert gradients.

    Returns ``(out, run)``: ``run(dout)`` back-propagates ``dout`` and returns
    ``(dx, {weight name: G as [E, d, k]})``.
    """
    transposed = module.is_transposed
    up_name, down_name = expert_weight_names(module)
    mats = {n: getattr(module, n).detach().double().clone().requires_grad_(True)
            for n in (up_name, down_name)}
    bias = {n: getattr(module, f"{n}_bias").detach().double() for n in mats} if (
        module.has_bias) else {}
    gate = gpt_oss_gate if transposed else silu_gate
    x64 = x.detach().double().requires_grad_(True)
    out = torch.zeros_like(x64)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(index.shape[1]):
            e = int(index[t, j])
            w_up, w_down = mats[up_name][e], mats[down_name][e]
            h = x64[t] @ w_up if transposed else w_up @ x64[t]
            h = h + (bias[up_name][e] if bias else 0)
            a = gate(h)
            y = a @ w_down if transposed else w_down @ a
            y = y + (bias[down_name][e] if bias else 0)
            acc = acc + weights[t, j].double() * y
        rows.append(acc)
    out = torch.stack(rows)

    def run(dout):
        out.backward(dout.double())
        grads = {n: (m.grad.transpose(1, 2) if transposed else m.grad) for n, m in mats.items()}
        return x64.grad, grads

    return out, run


def routed(module, n, top_k, seed, dtype, *, skip_expert=None):
    gen = torch.Generator().manual_seed(seed)
    experts = module.num_experts
    choices = [e for e in range(experts) if e != skip_expert]
    index = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)
                                              [:top_k]] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=gen).softmax(-1).to(dtype)
    x = torch.randn(n, module.hidden_dim if hasattr(module, "hidden_dim")
                    else module.hidden_size, generator=gen).to(dtype)
    return x, index, weights


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_float64_reference(family, dtype, grouped_mode):
    """Output, exact input gradient and C_e = G_e P for every expert; an expert that received
    no token has C_e == 0 exactly."""
    model = tiny_moe(family, dtype)
    rgc.wrap(model, rank=4)
    module = model.model.layers[0].mlp.experts
    assert isinstance(module, SketchedExperts)
    x, index, weights = routed(module, 9, 2, seed=1, dtype=dtype, skip_expert=2)
    x.requires_grad_(True)
    y = module(x, index, weights)
    ref, run = experts_reference(module, x, index, weights)
    dout = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    y.backward(dout)
    dx, dense = run(dout)
    tol = REL_TOL[dtype]
    assert y.dtype == dtype and rel_err(y, ref) < tol
    assert x.grad.dtype == dtype and rel_err(x.grad, dx) < tol
    for name, owner in module.rgc_owners.items():
        assert owner.weight.grad is None
        c = owner.sketch_matrices()
        assert c.dtype == torch.float32 and c.shape == owner.sketch_shape
        expected = dense[name] @ owner.projection.double()  # G_e P = D_e^T X_e P
        for e in range(module.num_experts):
            if e == 2:
                assert torch.equal(c[e], torch.zeros_like(c[e]))
            else:
                assert rel_err(c[e], expected[e]) < tol
    if module.has_bias:  # the expert biases keep ordinary gradients
        assert module.down_proj_bias.grad is not None


def test_layer_forward_is_transformers_grouped_mm_bit_for_bit():
    """With grad enabled the sketched forward computes what the unwrapped model's grouped_mm
    implementation computes, to the bit (same sort, same products, same sums)."""
    for dtype in (torch.float32, torch.bfloat16):
        plain = tiny_moe("qwen3_moe", dtype)
        wrapped = rgc.wrap(tiny_moe("qwen3_moe", dtype), rank=4)
        ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
        assert plain.config._experts_implementation == "grouped_mm"
        assert torch.equal(wrapped(ids).logits, plain(ids).logits)


def test_sketch_accumulates_over_backward_calls():
    model = rgc.wrap(tiny_moe("mixtral"), rank=4)
    owner = model.model.layers[1].mlp.experts.rgc_owners["down_proj"]
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    model(ids[:2]).logits.square().sum().backward()
    first = owner.sketch.clone()
    model(ids[2:]).logits.square().sum().backward()
    both = owner.sketch.clone()
    owner.zero_sketch()
    model(ids[2:]).logits.square().sum().backward()
    torch.testing.assert_close(both, first + owner.sketch, rtol=1e-5, atol=1e-7)


def one_thread(iterable):
    """Iterate on one intra-op thread: thousands of tiny products stall on a loaded machine
    when an OpenMP thread is descheduled (80 ms instead of 2 ms per step, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from iterable
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("kind", rgc.PROJECTION_KINDS)
def test_sketch_is_unbiased_per_expert_over_projection_seeds(kind):
    """Mean of C_e P^T over 2000 projection seeds converges to the dense G_e of every expert.

    The relative error of the mean is about sqrt(k / (r n)): 0.063 for gate/up (k = 32) and
    0.045 for down (k = 16) at r = 4, n = 2000 (measured 0.03 to 0.07 for every kind and
    expert); the tolerance is 0.15 per expert.
    """
    model = tiny_moe("qwen3_moe", torch.float32)
    rgc.wrap(model, rank=4, projection=kind)
    module = model.model.layers[0].mlp.experts
    x, index, weights = routed(module, 12, 2, seed=4, dtype=torch.float32)
    dout = torch.randn(12, 32, generator=torch.Generator().manual_seed(5))
    _, run = experts_reference(module, x, index, weights)
    _, dense = run(dout)
    n = 2000
    means = {name: torch.zeros_like(g) for name, g in dense.items()}
    for seed in one_thread(range(n)):
        for owner in module.rgc_owners.values():
            owner.seed = seed
            owner.set_projection_version(0)
            owner.zero_sketch()
        module(x, index, weights).backward(dout)
        for name, owner in module.rgc_owners.items():
            means[name] += owner.sketch_matrices().double() @ owner.projection.double().T
    for name, g in dense.items():
        for e in range(module.num_experts):
            mean = means[name][e] / n
            assert rel_err(mean, g[e]) < 0.15, (name, e)


def test_frozen_expert_weight_passes_gradients_without_a_sketch():
    model = rgc.wrap(tiny_moe("olmoe"), rank=4)
    module = model.model.layers[0].mlp.experts
    module.gate_up_proj.requires_grad_(False)
    x, index, weights = routed(module, 6, 2, seed=0, dtype=torch.float32)
    x.requires_grad_(True)
    module(x, index, weights).sum().backward()
    assert module.rgc_owners["gate_up_proj"].sketch is None
    assert module.rgc_owners["down_proj"].sketch is not None
    assert x.grad is not None and module.gate_up_proj.grad is None


def test_owner_interface():
    model = rgc.wrap(tiny_moe("gpt_oss", torch.bfloat16, expert_inter=24), rank=4)
    module = model.model.layers[0].mlp.experts
    up, down = module.rgc_owners["gate_up_proj"], module.rgc_owners["down_proj"]
    assert sketched_owner_of(module.gate_up_proj) is up
    # gpt-oss stores [E, H, 2I]: the layer multiplies by the transposed 2I x H matrices
    assert (up.num_matrices, up.out_features, up.in_features) == (4, 48, 32)
    assert (down.num_matrices, down.out_features, down.in_features) == (4, 32, 24)
    assert up.weight_matrices().shape == (4, 48, 32)
    assert up.weight_matrices().data_ptr() == module.gate_up_proj.data_ptr()
    assert up.sketch_shape == (4, 48, 4)
    assert up.projection.shape == (32, 4) and up.projection.dtype == torch.bfloat16
    assert "gate_up_proj_projection" not in model.state_dict()
    assert up.projection is module.gate_up_proj_projection
    torch.testing.assert_close(up.projection, rgc.make_projection(
        "orthonormal", 32, 4, seed=up.projection_seed, dtype=torch.bfloat16))
    assert up.seed != down.seed
    assert up.sketch_matrices() is None
