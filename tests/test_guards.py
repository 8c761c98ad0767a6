"""Misuse raises before any weight changes (rgc.guards, rgc.wrap), and what is allowed works."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import rgc
from tests.models import tiny_qwen3


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    return rgc.wrap(model, rank=4, targets=["0", "2"])


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model, before):
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def backward(model, seed=1):
    torch.manual_seed(seed)
    model(torch.randn(5, 8)).square().sum().backward()


def test_torch_optimizer_on_compressed_weight_raises():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backward(model)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="has no .grad.*rgc.RGCOptimizer"):
        opt.step()
    assert_unchanged(model, before)


def test_torch_optimizer_beside_rgc_optimizer_is_allowed():
    model = mlp()
    for layer in (model[0], model[2]):
        layer.bias.requires_grad_(True)
    biases = [model[0].bias, model[2].bias]
    weights = [model[0].weight, model[2].weight]
    dense, sketched = torch.optim.SGD(biases, lr=0.1), rgc.RGCOptimizer(weights, lr=1e-2)
    before = snapshot(model)
    backward(model)
    dense.step()
    sketched.step()
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert not torch.equal(dict(model.named_parameters())[name].detach(), before[name])


def test_float16_after_wrap_raises_at_step():
    model = mlp()
    model.to(torch.float16)
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2)
    backward_in = torch.randn(5, 8, dtype=torch.float16)
    model(backward_in).float().square().sum().backward()
    before = snapshot(model)
    with pytest.raises(TypeError, match="float16.*model.to\\(torch.bfloat16\\)"):
        opt.step()
    assert_unchanged(model, before)


def test_tied_target_weight_is_refused():
    model = tiny_qwen3(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    w = model.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match="'lm_head' shares its weight with "
                                         "\\['model.embed_tokens.weight'\\]"):
        rgc.wrap(model, rank=4, targets=["lm_head", "q_proj"])
    assert not rgc.compressed_layers(model) and torch.equal(model.lm_head.weight, w)
    rgc.wrap(model, rank=4)  # the default targets do not include the tied head


def test_peft_in_either_order_is_refused():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["0", "2"])
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match="peft modules .*merge_and_unload"):
        rgc.wrap(peft.get_peft_model(plain, config), rank=4, targets=["base_layer"])

    model = peft.get_peft_model(mlp(), config)
    for opt in (rgc.RGCOptimizer(model.parameters(), lr=1e-2),
                torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)):
        backward(model)
        before = snapshot(model)
        with pytest.raises(RuntimeError, match="peft adapter layer .*do not combine"):
            opt.step()
        assert_unchanged(model, before)
        opt.zero_grad()


def test_predicted_kl_defaults_construct():
    assert rgc.PredictedKL().budget_at(1000) == 2e-4
    ctl = rgc.PredictedKL(budget=1e-4)
    assert ctl.budget_at(0) == ctl.budget_at(50) == 1e-4


def test_deepcopy_gets_its_own_sketches():
    model = mlp()
    twin = copy.deepcopy(model)
    backward(twin)
    assert twin[0].sketch is not None and model[0].sketch is None
    backward(model)
    torch.testing.assert_close(model[0].sketch, twin[0].sketch, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_sketch(reentrant):
    model = mlp()
    x = torch.randn(5, 8, requires_grad=True)
    model(x).square().sum().backward()
    plain = [model[i].sketch.clone() for i in (0, 2)]
    model[0].zero_sketch(), model[2].zero_sketch()
    checkpoint(model, x, use_reentrant=reentrant).square().sum().backward()
    for i, want in zip((0, 2), plain):
        torch.testing.assert_close(model[i].sketch, want, rtol=0, atol=0)
