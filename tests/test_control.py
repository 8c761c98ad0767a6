import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import rgc

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _tiny(arch: str, attn: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attn_implementation=attn)
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def _ids(seed=1, batch=2, length=7):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _kl64(old: torch.Tensor, new: torch.Tensor) -> float:
    lp = torch.log_softmax(old.double(), -1)
    lq = torch.log_softmax(new.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _dense_kappa(ref, w0: dict, dw: dict, ids) -> float:
    """1/2 mean_t Var_p(J dW): the logits' tangent along the dense update ``dw`` by
    torch.func.jvp of the float64 model ``ref`` at the weights ``w0``."""
    def logits(params):
        return torch.func.functional_call(ref, params, (ids,)).logits

    z, dz = torch.func.jvp(logits, (w0,), (dw,))
    p = torch.softmax(z, -1)
    var = (p * dz ** 2).sum(-1) - (p * dz).sum(-1) ** 2
    return 0.5 * float(var.mean())


def _controlled_step(base, opt_cls, lr, ctl, ids, **wrap_kw):
    """Wrap a copy of ``base``, backprop an LM loss, take one controlled step.

    Returns (model, logits before, logits after) with logits from plain forwards."""
    model = copy.deepcopy(base)
    rgc.wrap(model, 4, **wrap_kw)
    opt = opt_cls(model.parameters(), lr=lr, step_control=ctl)
    with torch.no_grad():
        before = model(ids).logits
    model(ids, labels=ids).loss.backward()
    ctl.set_probe(model, {"input_ids": ids})
    opt.step()
    with torch.no_grad():
        after = model(ids).logits
    return model, before, after


@pytest.mark.parametrize("arch, attn, opt_cls, preset", [
    ("qwen3", "sdpa", rgc.RGCOptimizer, "rgc"),
    ("llama", "eager", rgc.RowAdam, "logra"),
])
def test_predicted_kl_tracks_realised_kl_as_step_shrinks(arch, attn, opt_cls, preset):
    """alpha is set so that predicted KL = budget; the realised KL(p_old || p_new), computed
    here in float64, agrees within 10% at small budgets and the error shrinks with the step
    (the quadratic model's error is O(alpha)). Qwen3 with SDPA also checks the MATH fallback."""
    base = _tiny(arch, attn)
    ids = _ids()
    errors = []
    for budget in (1e-3, 1e-4, 1e-5):
        ctl = rgc.PredictedKL(budget, None, max_scale=1e6)
        _, before, after = _controlled_step(base, opt_cls, 1e-3, ctl, ids, preset=preset)
        rec = ctl.last
        assert rec["predicted_kl"] == pytest.approx(budget, rel=1e-9)
        realised = _kl64(before, after)
        assert rec["realised_kl"] == pytest.approx(realised, rel=1e-3)
        errors.append(abs(realised / rec["predicted_kl"] - 1))
    assert errors[-1] < 0.10
    assert errors[2] < errors[1] < errors[0]
    assert errors[2] < errors[0] / 4  # ~sqrt(100) = 10 expected


def test_kappa_matches_dense_float64_jvp():
    """kappa from the factored JVP equals 1/2 mean Var_p(J dW) computed with the dense dW
    (weights after - before) by torch.func.jvp on a float64 copy; dense params included."""
    base = _tiny("qwen3", "eager")
    ids = _ids()
    ctl = rgc.PredictedKL(1e3, None, max_scale=1.0)  # alpha = 1: the whole proposal
    model, _, _ = _controlled_step(base, rgc.RowAdam, 1e-2, ctl, ids, preset="logra",
                                   targets=["q_proj", "v_proj", "down_proj"],
                                   freeze_others=False)
    assert ctl.last["alpha"] == 1.0
    ref = copy.deepcopy(base).double()
    w0 = {n: p.detach().double() for n, p in base.named_parameters()}
    dw = {n: p.detach().double() - w0[n] for n, p in model.named_parameters()}
    assert sum(bool(t.any()) for t in dw.values()) > 10
    assert ctl.last["kappa"] == pytest.approx(_dense_kappa(ref, w0, dw, ids), rel=2e-3)


def test_alpha_obeys_budget_and_cap_and_scales_the_applied_update():
    base = _tiny("llama", "eager")
    ids = _ids()
    free = rgc.PredictedKL(1e3, None, max_scale=1.0)
    m_free, _, _ = _controlled_step(base, rgc.RGCOptimizer, 1e-2, free, ids)
    kappa = free.last["kappa"]
    assert free.last["alpha"] == 1.0 and kappa > 0

    budget = kappa / 9  # alpha = 1/3, under the cap
    ctl = rgc.PredictedKL(budget, None, max_scale=1.0)
    m_ctl, _, _ = _controlled_step(base, rgc.RGCOptimizer, 1e-2, ctl, ids)
    assert ctl.last["alpha"] == pytest.approx(1 / 3, rel=1e-6)
    assert ctl.last["predicted_kl"] == pytest.approx(budget, rel=1e-9)
    for (n, p0), p_free, p_ctl in zip(base.named_parameters(), m_free.parameters(),
                                      m_ctl.parameters(), strict=True):
        if "proj" in n:
            torch.testing.assert_close(p_ctl - p0, (p_free - p0) / 3, rtol=1e-3, atol=1e-7)

    capped = rgc.PredictedKL(kappa * 100, None, max_scale=2.0)
    _controlled_step(base, rgc.RGCOptimizer, 1e-2, capped, ids)
    assert capped.last["alpha"] == 2.0
    assert capped.last["predicted_kl"] == pytest.approx(4 * kappa, rel=1e-6)
    assert capped.last["predicted_kl"] <= capped.last["budget"]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_anneal_schedule_hits_endpoints(schedule):
    ctl = rgc.PredictedKL(2e-4, 2e-5, anneal_steps=8, schedule=schedule)
    assert ctl.budget_at(0) == 2e-4
    assert ctl.budget_at(8) == 2e-5 and ctl.budget_at(50) == 2e-5
    budgets = [ctl.budget_at(s) for s in range(9)]
    assert all(a > b for a, b in zip(budgets, budgets[1:], strict=False))
    quarter = 0.25 if schedule == "linear" else 0.5 * (1 - math.cos(math.pi / 4))
    assert ctl.budget_at(2) == pytest.approx(2e-4 + (2e-5 - 2e-4) * quarter, rel=1e-12)

    torch.manual_seed(0)
    model = rgc.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)), 2,
                     targets=["0", "2"])
    ctl = rgc.PredictedKL(2e-4, 2e-5, anneal_steps=2, schedule=schedule, max_scale=1e6)
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2, step_control=ctl)
    x = torch.randn(4, 6)
    ctl.set_probe(model, x)
    for _ in range(3):
        opt.zero_grad()
        model(x).logsumexp(-1).sum().backward()
        opt.step()
    assert [r["budget"] for r in ctl.history] == [2e-4, ctl.budget_at(1), 2e-5]
    assert [r["predicted_kl"] for r in ctl.history] == pytest.approx([2e-4, 1.1e-4, 2e-5])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_jvp_allocates_no_dense_update_of_a_compressed_layer(arch):
    """No d x k tensor (nor an E x d x k stack) while the controller probes: not for a
    compressed linear layer, not for an expert."""
    if arch == "qwen3_moe":
        from tests.models import tiny_moe

        model = tiny_moe(arch, layers=2, vocab=VOCAB, hidden=32, expert_inter=24)
    else:
        model = _tiny(arch, "sdpa")
    rgc.wrap(model, 4)
    layers = rgc.sketched_weights(model)
    forbidden = {s for _, m in layers for s in ((m.out_features, m.in_features),
                                                (m.in_features, m.out_features))}
    forbidden |= {(m.num_matrices, *s) for _, m in layers if m.num_matrices > 1
                  for s in ((m.out_features, m.in_features), (m.in_features, m.out_features))}
    assert (arch == "qwen3_moe") == any(m.num_matrices > 1 for _, m in layers)
    recorders = []

    class Recorded(rgc.PredictedKL):
        def scale(self, optimizer, updates):
            assert len(updates) == len(layers)
            with rgc.memory.track() as rec:
                alpha = super().scale(optimizer, updates)
                # positive control: the recorder does see a dense d x k product
                u = updates[0]
                u.factor @ u.layer.projection.t().float()
            recorders.append(rec)
            return alpha

    ctl = Recorded(1e-4, None)
    opt = rgc.RowAdam(model.parameters(), lr=1e-3, step_control=ctl)
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    ctl.set_probe(model, {"input_ids": ids})
    opt.step()
    (rec,) = recorders
    # forward AD gives a weight without a tangent a storage-less symbolic zero tangent
    dense = [(a.op, a.shape) for a in rec.allocations
             if a.shape in forbidden and a.op != "aten._efficientzerotensor.default"]
    assert len(dense) == 1 and "mm" in dense[0][0], dense
    assert ctl.last["kappa"] > 0


def test_missing_probe_and_unsupported_attention_are_clear_errors():
    torch.manual_seed(0)
    model = rgc.wrap(nn.Sequential(nn.Linear(6, 5)), 2, targets=["0"])
    ctl = rgc.PredictedKL(1e-4, None)
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2, step_control=ctl)
    model(torch.randn(3, 6)).sum().backward()
    w = model[0].weight.clone()
    with pytest.raises(RuntimeError, match="set_probe"):
        opt.step()
    assert torch.equal(model[0].weight, w) and not opt.state
    model.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        ctl.set_probe(model, torch.randn(3, 6))
    with pytest.raises(ValueError, match="anneal_steps"):
        rgc.PredictedKL(2e-4, 2e-5)
    with pytest.raises(ValueError, match="budget"):
        rgc.PredictedKL(-1.0, None)


@pytest.mark.parametrize("family, opt_cls, preset, decay, frozen", [
    ("qwen3_moe", rgc.RowAdam, "logra", 0.0, False),
    ("gpt_oss", rgc.RGCOptimizer, "rgc", 0.1, False),  # transposed experts with biases
    ("qwen3_moe", rgc.RGCOptimizer, "rgc", 0.0, True),  # tangents through frozen experts
])
def test_kappa_matches_dense_float64_jvp_with_expert_stacks(family, opt_cls, preset, decay,
                                                              frozen):
    """With trainable expert stacks, kappa from the factored JVP (every expert's tangent built
    from X P and U on its routed rows, the router's and attention's from their hooks) equals
    1/2 mean Var_p(J dW) from torch.func.jvp on a float64 copy with the dense dW (weights
    after - before) of every parameter, experts included; weight decay included. Frozen
    sketched experts carry the tangents of the layers below them."""
    from tests.models import tiny_moe

    base = tiny_moe(family, dtype=torch.float32, layers=2, vocab=VOCAB)
    ids = _ids()
    ctl = rgc.PredictedKL(1e3, None, max_scale=1.0)  # alpha = 1: the whole proposal
    model = copy.deepcopy(base)
    rgc.wrap(model, 4, preset=preset, seed=5)
    stacks = [p for p in model.parameters() if p.dim() == 3]
    assert stacks
    for p in stacks if frozen else ():
        p.requires_grad_(False)
    experts = [n for n, p in model.named_parameters() if p.dim() == 3 and p.requires_grad]
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=decay, step_control=ctl)
    model(ids, labels=ids).loss.backward()
    ctl.set_probe(model, {"input_ids": ids})
    opt.step()
    assert ctl.last["alpha"] == 1.0
    ref = copy.deepcopy(base).double()
    ref.set_experts_implementation("eager")
    ref.set_attn_implementation("eager")
    w0 = {n: p.detach().double() for n, p in base.named_parameters()}
    dw = {n: p.detach().double() - w0[n] for n, p in model.named_parameters()}
    assert all(bool(dw[n].any()) for n in experts) and (frozen or experts)
    assert sum(bool(t.any()) for t in dw.values()) > 4
    kappa_ref = _dense_kappa(ref, w0, dw, ids)
    assert ctl.last["kappa"] == pytest.approx(kappa_ref, rel=2e-3)
    if frozen:
        return
    # without the experts' tangents kappa would be visibly different
    no_experts = {n: t.zero_() if n in experts else t for n, t in copy.deepcopy(dw).items()}
    assert abs(_dense_kappa(ref, w0, no_experts, ids) / kappa_ref - 1) > 0.02
