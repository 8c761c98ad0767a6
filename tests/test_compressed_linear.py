import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from hypothesis import given
from hypothesis import strategies as st

from rgc import CompressedLinear, make_projection


def make_layer(k, d, r, *, bias=True, dtype=torch.float32, kind="gaussian", seed=0):
    lin = nn.Linear(k, d, bias=bias, dtype=dtype)
    return lin, CompressedLinear.from_linear(lin, r, projection=kind, seed=seed)


def dense_reference(x, weight, bias, p, dout):
    """float64: output, input gradient, sketch D^T X P and bias gradient."""
    x64, w64, p64, d64 = (t.double() for t in (x, weight, p, dout))
    x2, d2 = x64.reshape(-1, x64.shape[-1]), d64.reshape(-1, d64.shape[-1])
    out = x64 @ w64.T + (bias.double() if bias is not None else 0)
    return out, d64 @ w64, d2.T @ x2 @ p64, d2.sum(0)


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


# Relative Frobenius error allowed per dtype: FP32 sums, or BF16 inputs and a BF16 X P.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), k=st.integers(1, 24),
       d=st.integers(1, 24), r=st.integers(1, 8), seed=st.integers(0, 2**31),
       bias=st.booleans(), kind=st.sampled_from(["gaussian", "rademacher"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sketch_and_gradients_match_dense_reference(lead, k, d, r, seed, bias, kind, dtype):
    torch.manual_seed(seed)
    lin, layer = make_layer(k, d, r, bias=bias, kind=kind, seed=seed, dtype=dtype)
    x = torch.randn(*lead, k, dtype=dtype, requires_grad=True)
    dout = torch.randn(*lead, d, dtype=dtype)
    y = layer(x)
    y.backward(dout)
    out, dx, sketch, db = dense_reference(x.detach(), lin.weight.detach(), lin.bias,
                                          layer.projection, dout)
    tol = REL_TOL[dtype]
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert rel_err(y, out) < tol and rel_err(x.grad, dx) < tol
    assert rel_err(layer.sketch, sketch) < tol
    assert layer.sketch.dtype == torch.float32 and layer.sketch.shape == (d, r)
    assert layer.weight.grad is None
    if bias:
        assert rel_err(layer.bias.grad, db) < tol


def test_bf16_weights_and_orthonormal_default():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16, dtype=torch.bfloat16)
    layer = CompressedLinear.from_linear(lin, 8)
    assert layer.projection.dtype == torch.bfloat16 and layer.projection_kind == "orthonormal"
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    dout = torch.randn(5, 16, dtype=torch.bfloat16)
    layer(x).backward(dout)
    _, _, sketch, _ = dense_reference(x, lin.weight.detach(), lin.bias, layer.projection, dout)
    # X P is stored in BF16, so the sketch matches to BF16 precision.
    torch.testing.assert_close(layer.sketch.double(), sketch, rtol=2e-2, atol=2e-2)


def test_shares_parameters_and_state_dict_keys():
    lin, layer = make_layer(6, 4, 2)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert list(layer.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    assert isinstance(layer, nn.Linear)


def test_accumulates_over_micro_batches_like_one_batch():
    lin, layer = make_layer(10, 7, 3)
    x, dout = torch.randn(8, 10), torch.randn(8, 7)
    layer(x[:3]).backward(dout[:3])
    layer(x[3:]).backward(dout[3:])
    _, _, sketch, _ = dense_reference(x, lin.weight.detach(), None, layer.projection, dout)
    torch.testing.assert_close(layer.sketch.double(), sketch, rtol=1e-5, atol=1e-5)


def test_input_without_grad_still_accumulates():
    lin, layer = make_layer(10, 7, 3)
    x = torch.randn(4, 10)  # e.g. the output of frozen embeddings
    layer(x).sum().backward()
    assert layer.sketch is not None and layer.sketch.abs().sum() > 0


def test_no_grad_and_inference_mode_save_nothing():
    lin, layer = make_layer(10, 7, 3)
    x = torch.randn(4, 10)
    with torch.no_grad():
        y = layer(x)
    assert y.grad_fn is None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), lin(x))
    lin.weight.requires_grad_(False)
    assert layer(x).grad_fn is None or "Sketched" not in type(layer(x).grad_fn).__name__


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_gives_the_same_sketch(use_reentrant):
    torch.manual_seed(0)
    lin, layer = make_layer(12, 9, 4)
    x = torch.randn(6, 12, requires_grad=True)
    dout = torch.randn(6, 9)
    layer(x).backward(dout)
    plain_sketch, plain_grad = layer.sketch.clone(), x.grad.clone()
    layer.sketch, x.grad = None, None
    cp.checkpoint(layer, x, use_reentrant=use_reentrant).backward(dout)
    torch.testing.assert_close(layer.sketch, plain_sketch)
    torch.testing.assert_close(x.grad, plain_grad)


def test_autocast_bf16_matches_reference():
    torch.manual_seed(0)
    lin, layer = make_layer(16, 8, 4)
    x = torch.randn(5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    dout = torch.randn(5, 8, dtype=torch.bfloat16)
    y.backward(dout)
    out, dx, sketch, _ = dense_reference(x.detach(), lin.weight.detach(), lin.bias,
                                         layer.projection, dout)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), dx, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(layer.sketch.double(), sketch, rtol=3e-2, atol=3e-2)


def test_projection_regenerates_from_seed_and_version():
    lin, layer = make_layer(10, 7, 3, kind="rademacher", seed=42)
    first = layer.projection.clone()
    layer.set_projection_version(5)
    expected = make_projection("rademacher", 10, 3, seed=layer.projection_seed)
    assert torch.equal(layer.projection, expected)
    layer.set_projection_version(0)
    assert torch.equal(layer.projection, first)


def test_backward_after_projection_change_raises():
    lin, layer = make_layer(10, 7, 3)
    y = layer(torch.randn(2, 10))
    layer.set_projection_version(1)
    with pytest.raises(RuntimeError, match="changed between forward and backward"):
        y.sum().backward()


def test_constructor_errors():
    with pytest.raises(ValueError, match="rank <= in_features"):
        CompressedLinear(4, 3, rank=5)
    with pytest.raises(ValueError, match="rank must be"):
        CompressedLinear(4, 3, rank=0)
    with pytest.raises(TypeError, match="supports weights in"):
        CompressedLinear.from_linear(nn.Linear(4, 3, dtype=torch.float16), 2)
    with pytest.raises(ValueError, match="refresh"):
        CompressedLinear(4, 3, rank=2, refresh="sometimes")
    layer = CompressedLinear(8, 3, rank=2, projection="rademacher", refresh=3)
    assert layer.weight.shape == (3, 8) and layer.projection.shape == (8, 2)
