"""rgc.compute: FP32 matmuls on BF16-stored weights, against float64 references."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from models import TinyBlockLM, tiny_qwen3
from torch.utils._python_dispatch import TorchDispatchMode

import rgc
from rgc import compute
from rgc.compute import ComputeMode, choose_compute_mode, use_compute_dtype
from rgc.memory import estimate_memory, track

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MATMUL_OPS = {"mm.default", "bmm.default", "addmm.default", "addmm_.default", "mv.default",
              "dot.default", "baddbmm.default"}


class MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of the tensor operands of every matmul-like ATen op."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if name in MATMUL_OPS:
            self.seen.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


@given(n=st.integers(1, 12), k=st.integers(2, 40), d=st.integers(1, 40), r=st.integers(1, 8),
       bias=st.booleans(), seed=st.integers(0, 2**31))
def test_compressed_linear_fp32_compute_matches_dense_reference(n, k, d, r, bias, seed):
    torch.manual_seed(seed)
    r = min(r, k)
    lin = nn.Linear(k, d, bias=bias, dtype=torch.bfloat16)
    layer = rgc.CompressedLinear.from_linear(lin, r, projection="gaussian", seed=seed)
    layer.compute_dtype = torch.float32
    x = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(n, d, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dout)
    x64, w64, p64, d64 = (t.detach().double() for t in (x, lin.weight, layer.projection, dout))
    out = x64 @ w64.T + (lin.bias.double() if bias else 0)
    # X P is saved in BF16 (the input's dtype), as on the BF16 path; C = D^T (X P) in FP32.
    xp = (x64 @ p64).to(torch.bfloat16).double()
    assert y.dtype == x.grad.dtype == layer.weight.dtype == torch.bfloat16
    assert layer.weight.grad is None and layer.sketch.dtype == torch.float32
    # Only the final BF16 rounding of the outputs remains (FP32 products, one rounding).
    assert rel_err(y, out) < 8e-3 and rel_err(x.grad, d64 @ w64) < 8e-3
    torch.testing.assert_close(layer.sketch.double(), d64.T @ xp, rtol=1e-5, atol=1e-5)
    if bias:
        assert rel_err(layer.bias.grad, d64.sum(0)) < 8e-3


def test_sketch_equals_bf16_path_up_to_fp32_rounding():
    torch.manual_seed(0)
    lin = nn.Linear(96, 48, bias=False, dtype=torch.bfloat16)
    native = rgc.CompressedLinear.from_linear(lin, 8, seed=3)
    upcast = rgc.CompressedLinear.from_linear(lin, 8, seed=3)
    upcast.compute_dtype = torch.float32
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    dout = torch.randn(64, 48, dtype=torch.bfloat16)
    for layer in (native, upcast):
        layer(x.clone().requires_grad_()).backward(dout)
    # X P differs at most by one BF16 rounding of an FP32-accumulated product.
    assert rel_err(upcast.sketch, native.sketch.double()) < 1e-2


@pytest.mark.slow  # a whole model's forward and backward, twice
def test_whole_model_matmuls_run_in_fp32_and_match_reference():
    model = tiny_qwen3(torch.bfloat16)
    reference = tiny_qwen3(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    reference.double()
    rgc.wrap(model, 4, targets=SEVEN)
    handle = use_compute_dtype(model, torch.float32)
    ids = torch.randint(0, 48, (2, 9))
    with MatmulDtypes() as rec:
        logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
    assert rec.seen and all(s == {torch.float32} for s in rec.seen), rec.seen
    assert logits.dtype == torch.bfloat16
    assert rel_err(logits, reference(input_ids=ids).logits) < 3e-2
    for _, layer in rgc.compressed_layers(model):
        assert layer.weight.dtype == torch.bfloat16 and layer.weight.grad is None
        assert layer.sketch is not None
    handle.remove()
    with MatmulDtypes() as rec:
        model(input_ids=ids)
    assert any(torch.bfloat16 in s for s in rec.seen)
    assert all(layer.compute_dtype is None for _, layer in rgc.compressed_layers(model))


def test_dense_gradients_of_other_layers_match_reference():
    """Trainable BF16 layers outside the targets (e.g. a dense baseline) get BF16 gradients."""
    torch.manual_seed(0)
    model = TinyBlockLM(dtype=torch.bfloat16)
    reference = TinyBlockLM(dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    use_compute_dtype(model, torch.float32)
    ids = torch.randint(0, 32, (3, 7))
    target = torch.randn(3, 7, 32)
    for m in (model, reference):
        ((m(ids).double() - target) ** 2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.bfloat16, name
        assert rel_err(p.grad, q.grad) < 3e-2, name


@given(shape_a=st.sampled_from([(5, 3), (2, 5, 3), (2, 1, 5, 3), (1, 5, 3)]),
       shape_b=st.sampled_from([(3, 4), (2, 3, 4), (4, 3, 3, 4), (3, 3, 4)]),
       seed=st.integers(0, 2**31))
def test_upcast_matmul_broadcast_gradients(shape_a, shape_b, seed):
    torch.manual_seed(seed)
    a = torch.randn(shape_a, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(shape_b, dtype=torch.bfloat16, requires_grad=True)
    try:
        ref = torch.matmul(a.detach().double(), b.detach().double())
    except RuntimeError:
        return  # shapes that do not broadcast
    with compute.UpcastMatmuls():
        out = a @ b
    g = torch.randn(ref.shape, dtype=torch.bfloat16)
    out.backward(g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    torch.matmul(a64, b64).backward(g.double())
    assert out.dtype == torch.bfloat16 and a.grad.shape == a.shape and b.grad.shape == b.shape
    assert rel_err(out, ref) < 8e-3
    assert rel_err(a.grad, a64.grad) < 8e-3 and rel_err(b.grad, b64.grad) < 8e-3


def test_saves_operands_as_stored_not_fp32_copies():
    model = tiny_qwen3(torch.bfloat16)
    rgc.wrap(model, 4, targets=SEVEN)
    use_compute_dtype(model, torch.float32)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 48, (2, 9))).logits.sum().backward()
    assert saved
    assert not [s for s in saved if s[0] == torch.float32 and s[1] in weights]


def test_training_step_keeps_bf16_weights_and_no_dense_gradient():
    torch.manual_seed(0)
    model = tiny_qwen3(torch.bfloat16)
    rgc.wrap(model, 4, targets=SEVEN)
    use_compute_dtype(model, torch.float32)
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(0, 48, (2, 9))
    with track() as t:
        model(input_ids=ids, labels=ids).loss.backward()
    dense = {tuple(p.shape) for p in before.values()}
    assert not {a.shape for a in t.allocations if a.category == "backward"
                and a.dtype == torch.bfloat16} & dense
    opt.step()
    for n, p in model.named_parameters():
        if n in before:
            assert p.dtype == torch.bfloat16 and p.grad is None
            assert not torch.equal(p, before[n]), n


def test_choice_override_environment_and_measurement(monkeypatch):
    monkeypatch.delenv(compute.ENV_VAR, raising=False)
    assert choose_compute_mode(override="float32") == ComputeMode(torch.float32, "override")
    assert choose_compute_mode(override=torch.float32).dtype is torch.float32
    assert choose_compute_mode(override="native").dtype is None
    assert choose_compute_mode("cpu", torch.float32).source == "device"
    assert choose_compute_mode("cuda").dtype is None  # no measurement on a GPU
    monkeypatch.setattr(compute, "measure_matmul_times", lambda dtype: (5e-4, 1e-4))
    mode = choose_compute_mode()
    assert mode.dtype is torch.float32 and mode.source == "measured" and "5.0x" in str(mode)
    monkeypatch.setattr(compute, "measure_matmul_times", lambda dtype: (1e-4, 1e-4))
    assert choose_compute_mode().dtype is None
    monkeypatch.setenv(compute.ENV_VAR, "float32")
    assert choose_compute_mode() == ComputeMode(torch.float32, "environment",
                                                "RGC_COMPUTE_DTYPE=float32")
    monkeypatch.setenv(compute.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="RGC_COMPUTE_DTYPE=float32"):
        choose_compute_mode()
    with pytest.raises(ValueError, match="float32 or None"):
        choose_compute_mode(override=torch.float16)
    with pytest.raises(ValueError, match="not 'auto'"):
        use_compute_dtype(nn.Linear(2, 2), "auto")


def test_measurement_is_cached_and_positive():
    first = compute.measure_matmul_times(torch.bfloat16)
    assert compute.measure_matmul_times(torch.bfloat16) is first
    assert all(t > 0 for t in first)


def test_native_mode_changes_nothing():
    model = tiny_qwen3(torch.bfloat16)
    handle = use_compute_dtype(model, ComputeMode(None, "measured"))
    assert not model._forward_pre_hooks and handle.dtype is None


def test_estimate_covers_measured_step_with_fp32_compute():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=2000, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    batch, seq, rank = 2, 20, 8
    peaks = {}
    for dtype in (None, torch.float32):
        with track() as t:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            model = Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16,
                                                  attn_implementation="sdpa")
            rgc.wrap(model, rank, targets=SEVEN)
            use_compute_dtype(model, dtype or "native")
            opt = rgc.RGCOptimizer(model.parameters(), lr=1e-3)
            for i in range(2):
                if i:
                    t.reset_peak()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        peaks[dtype] = t.peak
    native = estimate_memory(cfg.to_dict(), method="rgc", rank=rank, targets=SEVEN,
                             batch=batch, seq_len=seq)
    est = estimate_memory(cfg.to_dict(), method="rgc", rank=rank, targets=SEVEN, batch=batch,
                          seq_len=seq, compute_dtype=torch.float32)
    # the lm_head (2000 x 32) dominates: its FP32 weight, input and logits
    assert est.compute_copies == 4 * (2000 * 32 + 40 * 32 + 40 * 2000)
    assert peaks[torch.float32] > peaks[None]
    assert est.total - native.total == est.compute_copies
    assert peaks[torch.float32] <= est.total <= peaks[torch.float32] + est.compute_copies
    with pytest.raises(ValueError, match="compute_dtype"):
        estimate_memory(cfg.to_dict(), method="rgc", rank=rank, compute_dtype=torch.float16)
