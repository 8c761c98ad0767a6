"""rgc.kernels compiled on a CUDA GPU. Skips without CUDA or Triton, or under TRITON_INTERPRET=1.

(tests/test_kernels.py loads the kernels interpreted only for its own duration and compiled
again afterwards, so both files can run in one process.)
"""

import math
import os

import pytest
import torch
import torch.nn as nn

import rgc
from rgc import RGCOptimizer, stochastic_round
from rgc.reference import lowrank_update_reference
from tests.bf16_checks import assert_close_bf16, bits16

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: these tests need compiled kernels", allow_module_level=True)

import rgc.kernels as K  # noqa: E402
from rgc.kernels import _triton  # noqa: E402

if _triton.INTERPRETED:
    pytest.skip("the kernels are loaded interpreted in this process", allow_module_level=True)

CUDA = torch.device("cuda")


def problem(d, k, r, *, p_dtype=torch.bfloat16, w_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    weight = torch.randn(d, k, generator=g, device=CUDA).to(w_dtype)
    sketch = torch.randn(d, r, generator=g, device=CUDA)
    projection = (torch.randn(k, r, generator=g, device=CUDA) / math.sqrt(r)).to(p_dtype)
    return weight, sketch, projection


def reference_update(weight, sketch, projection, coef, *, seed, offset=0):
    new = (weight.double() - coef * (sketch.double() @ projection.double().t())).float()
    return new if weight.dtype == torch.float32 else stochastic_round(new.cpu(), seed=seed,
                                                                       offset=offset).to(CUDA)


def test_rounding_bit_identical_with_cpu_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31, (1_000_003,), generator=g).to(torch.int32).view(
        torch.float32)
    x[::3] = torch.randn(len(x[::3]), generator=g)
    for seed, offset in [(0, 0), (123, 2**32 - 500_000), (2**62, 2**40)]:
        ref = stochastic_round(x, seed=seed, offset=offset)
        out = K.stochastic_round(x.to(CUDA), seed=seed, offset=offset).cpu()
        nan = torch.isnan(ref.float())
        assert torch.equal(torch.isnan(out.float()), nan)
        assert torch.equal(bits16(out)[~nan], bits16(ref)[~nan])


@pytest.mark.parametrize("k,r", [(4096, 64), (1000, 37), (6144, 256)])
def test_gaussian_kernel_has_the_cpu_bits(k, r):
    from rgc.projection import gaussian_matrix

    got = K.gaussian_matrix(k, r, seed=k + r, device=CUDA)
    assert torch.equal(got.cpu(), gaussian_matrix(k, r, seed=k + r))


def test_orthonormal_projection_on_cuda_matches_the_cpu():
    # The same G; CholeskyQR through cuBLAS/cuSOLVER rounds differently from the CPU pass.
    for dtype, tol in [(torch.float32, 2e-6), (torch.bfloat16, 2 * 2**-8)]:
        on_gpu = rgc.make_projection("orthonormal", 2048, 64, seed=5, device=CUDA, dtype=dtype)
        on_cpu = rgc.make_projection("orthonormal", 2048, 64, seed=5, dtype=dtype)
        torch.testing.assert_close(on_gpu.cpu().double(), on_cpu.double(),
                                   atol=tol * math.sqrt(2048 / 64), rtol=0)


@pytest.mark.parametrize("d,k,r", [(1000, 3000, 64), (4096, 1000, 100), (257, 4099, 7),
                                   (300, 500, 256), (129, 77, 1)])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_fused_update_matches_float64(d, k, r, p_dtype):
    weight, sketch, projection = problem(d, k, r, p_dtype=p_dtype)
    ref = reference_update(weight, sketch, projection, 0.05, seed=3, offset=11)
    K.lowrank_update_(weight, sketch, projection, 0.05, seed=3, offset=11)
    torch.cuda.synchronize()
    assert_close_bf16(weight, ref)


def test_fused_update_fp32_weights_and_column_view():
    weight, sketch, projection = problem(500, 700, 64, w_dtype=torch.float32)
    ref = weight.double() - 0.3 * (sketch.double() @ projection.double().t())
    scale = weight.double().abs() + 0.3 * (sketch.double().abs() @ projection.double().abs().t())
    K.lowrank_update_(weight, sketch, projection, 0.3, seed=0)
    assert ((weight.double() - ref).abs() <= 2.0**-24 * 68 * scale).all()

    wide, _, _ = problem(500, 760, 64, seed=1)
    view = wide[:, 30:730]
    ref = reference_update(view, sketch, projection, 0.05, seed=2)
    K.lowrank_update_(view, sketch, projection, 0.05, seed=2)
    assert_close_bf16(view, ref)


def test_fused_update_allocates_only_its_partial_sums():
    d, k, r = 4096, 4096, 128
    weight, sketch, projection = problem(d, k, r)
    coef, sq = torch.tensor(1e-3, device=CUDA), torch.empty((), device=CUDA)
    K.lowrank_update_(weight, sketch, projection, coef, seed=0, sq_norm_out=sq)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    K.lowrank_update_(weight, sketch, projection, coef, seed=1, sq_norm_out=sq)
    torch.cuda.synchronize()
    # One FP32 partial sum per 64 x 64 tile (the caching allocator rounds to 512 bytes); not
    # one FP32 row of H per tile, let alone the torch path's 128-row chunk.
    partials = _triton.update_programs(d, k) * 4
    assert torch.cuda.max_memory_allocated() - base <= -(-partials // 512) * 512
    # The torch path for comparison: at least one chunk of H.
    torch.cuda.reset_peak_memory_stats()
    lowrank_update_reference(weight, sketch, projection, 1e-3, seed=1)
    assert torch.cuda.max_memory_allocated() - base >= 128 * k * 4


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_tensor_coef_sq_norm_without_host_sync(w_dtype):
    d, k, r = 1000, 3000, 64
    weight, sketch, projection = problem(d, k, r, w_dtype=w_dtype)
    ref = reference_update(weight, sketch, projection, 0.5, seed=3, offset=7)
    scale = weight.double().abs() + 0.5 * (sketch.double().abs() @ projection.double().abs().t())
    coef, sq = torch.tensor(0.5, device=CUDA), torch.empty((), device=CUDA)
    K.lowrank_update_(weight.clone(), sketch, projection, coef, seed=3, offset=7,
                      sq_norm_out=sq)  # compile first: compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.lowrank_update_(weight, sketch, projection, coef, seed=3, offset=7, sq_norm_out=sq)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if w_dtype == torch.bfloat16:
        assert_close_bf16(weight, ref)
    else:
        assert ((weight.double() - ref).abs() <= 2.0**-24 * (r + 4) * scale).all()
    assert sq.item() == pytest.approx((weight.double() ** 2).sum().item(), rel=1e-6)
    bits = [sq.view(torch.int32).item()]
    for _ in range(3):  # same inputs, same bits
        w = problem(d, k, r, w_dtype=w_dtype)[0]
        K.lowrank_update_(w, sketch, projection, coef, seed=3, offset=7, sq_norm_out=sq)
        bits.append(sq.view(torch.int32).item())
    assert len(set(bits)) == 1


def test_coef_zero_keeps_bits_with_nan_sketch():
    weight, sketch, projection = problem(300, 500, 32)
    weight[0, :2] = torch.tensor([-0.0, 0.0])
    before = bits16(weight).clone()
    sketch[5, 3] = float("nan")
    projection[2, 1] = float("inf")
    sq = torch.empty((), device=CUDA)
    K.lowrank_update_(weight, sketch, projection, torch.zeros((), device=CUDA), seed=1,
                      sq_norm_out=sq)
    assert torch.equal(bits16(weight), before)
    assert sq.item() == pytest.approx((weight.double() ** 2).sum().item(), rel=1e-6)


def test_optimizer_uses_kernel_on_cuda_and_matches_torch_path(monkeypatch):
    assert rgc.dispatch.implementation_for(torch.empty(1, device=CUDA)) == "triton"

    def train(impl):
        monkeypatch.setenv("RGC_IMPL", impl)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Tanh(),
                              nn.Linear(512, 128, bias=False)).to(CUDA, torch.bfloat16)
        rgc.wrap(model, rank=32, targets=lambda name, m: isinstance(m, nn.Linear), seed=1)
        opt = RGCOptimizer(model.parameters(), lr=0.02, seed=5)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(CUDA,
                                                                                torch.bfloat16)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train("triton"), train("torch"), strict=True):
        assert_close_bf16(a, b)
