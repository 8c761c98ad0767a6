"""Training expert stacks: RGCOptimizer and RowAdam step 3-D expert weights of every MoE family,
an expert without tokens keeps its bits, the stack update is the update of each expert, a sync
receiver stays bit-identical, and no dense expert gradient or update is ever allocated."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import rgc
from rgc.memory import track
from rgc.updates import apply_lowrank_update_
from tests.models import MOE_FAMILIES, tiny_moe

pytest.importorskip("transformers")


def _optimizer(name, model, **kwargs):
    if name == "rgc":
        return rgc.RGCOptimizer(model.parameters(), lr=3e-3, **kwargs)
    if name == "rgc_momentum":  # buffers that an expert without tokens must not move
        return rgc.RGCOptimizer(model.parameters(), lr=3e-3, momentum=0.9, nesterov=True,
                                row_norm=True, **kwargs)
    return rgc.RowAdam(model.parameters(), lr=1e-3, **kwargs)


def _batch(step, vocab=64):
    return torch.randint(0, vocab, (4, 10), generator=torch.Generator().manual_seed(step))


def _experts(model):
    return {n: p for n, p in model.named_parameters() if rgc.registry.sketched_owner_of(p)
            is not None and p.dim() == 3}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("opt_name", ["rgc", "rowadam"])
def test_every_family_trains_its_experts(family, opt_name):
    model = tiny_moe(family, dtype=torch.bfloat16)
    rgc.wrap(model, rank=4, preset="rgc" if opt_name == "rgc" else "logra")
    opt = _optimizer(opt_name, model)
    before = {n: p.detach().clone() for n, p in _experts(model).items()}
    assert before
    losses = []
    for _ in range(8):
        ids = _batch(0)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, before[n]) for n, p in _experts(model).items())


def _route_to_first_two(model):
    """Every token of every Qwen3-MoE layer goes to experts 0 and 1 (weights 0.6, 0.4)."""
    def hook(router, args, out):
        logits, _, _ = out
        n = logits.shape[0]
        scores = torch.tensor([0.6, 0.4], dtype=logits.dtype).expand(n, 2)
        return logits, scores, torch.tensor([0, 1]).expand(n, 2)

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)


@pytest.mark.parametrize("opt_name", ["rgc", "rgc_momentum", "rowadam"])
@pytest.mark.parametrize("expert_norm", ["stack", "expert"])
def test_an_expert_without_tokens_keeps_its_bits(opt_name, expert_norm):
    if opt_name == "rowadam" and expert_norm == "expert":
        pytest.skip("RowAdam has no normalisation")
    model = tiny_moe("qwen3_moe", dtype=torch.bfloat16, experts=4)
    rgc.wrap(model, rank=4)
    _route_to_first_two(model)  # experts 2 and 3 receive no token
    kwargs = {"expert_norm": expert_norm} if opt_name.startswith("rgc") else {}
    opt = _optimizer(opt_name, model, **kwargs)
    before = {n: p.detach().clone() for n, p in _experts(model).items()}
    for step in range(3):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for name, p in _experts(model).items():
        bits = p.view(torch.int16)
        old = before[name].view(torch.int16)
        assert not torch.equal(bits[:2], old[:2]), name
        assert torch.equal(bits[2:], old[2:]), name


@pytest.mark.parametrize("transposed", [False, True])
def test_stack_update_is_each_experts_update_against_float64(transposed):
    """W_e <- W_e - coef_e U_e P^T for every expert of one stack, in one call; the reference
    is float64 written here, per expert."""
    g = torch.Generator().manual_seed(3)
    e, d, k, r = 3, 10, 14, 4
    storage = torch.randn(e, k, d, generator=g) if transposed else torch.randn(e, d, k,
                                                                            generator=g)
    w = storage.transpose(1, 2) if transposed else storage
    u, p = torch.randn(e, d, r, generator=g), torch.randn(k, r, generator=g)
    coef = torch.tensor([0.5, 0.0, -0.25])
    want = w.double() - coef.double()[:, None, None] * (u.double() @ p.double().T)
    apply_lowrank_update_(w, u, p, coef, seed=1)
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(w[1], (storage.transpose(1, 2) if transposed else storage)[1])


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("opt_name", ["rgc", "rgc_momentum", "rowadam"])
def test_receiver_of_expert_payloads_stays_bit_identical(family, opt_name):
    base = tiny_moe(family, dtype=torch.bfloat16)
    model = copy.deepcopy(base)
    rgc.wrap(model, rank=4, preset="logra" if opt_name == "rowadam" else "rgc",
             **({"refresh": 2} if opt_name == "rgc_momentum" else {}))
    opt = _optimizer(opt_name, model, keep_updates=True)
    receiver = copy.deepcopy(base)
    for step in range(1, 6):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        payload = opt.export_update(model)
        assert any(key.endswith("/stack") for key in payload)
        rgc.apply_update(receiver, payload)
        for (name, a), b in zip(model.named_parameters(), receiver.parameters(), strict=True):
            assert torch.equal(a, b), (name, step)


def test_forward_backward_and_step_never_allocate_a_dense_expert_gradient():
    # token counts (40, routed 80) differ from every expert dimension (72, 48, 36)
    model = tiny_moe("qwen3_moe", dtype=torch.bfloat16, hidden=48, expert_inter=36)
    rgc.wrap(model, rank=4)
    # the update rebuilds 16 rows at a time (the default 128 would hold a whole tiny expert)
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-3, chunk_rows=16)
    shapes = {tuple(o.weight_matrices().shape[1:]) for _, o in rgc.sketched_weights(model)
              if o.num_matrices > 1}
    with track() as t:
        for step in range(2):
            ids = _batch(step)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    expert_bytes = min(math.prod(s) for s in shapes) * 2  # one BF16 expert matrix
    big = [a for a in t.allocations if a.nbytes >= expert_bytes
           and tuple(a.shape[-2:]) in shapes | {s[::-1] for s in shapes}]
    assert not big, big[:3]
