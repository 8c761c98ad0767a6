"""rgc.wrap on transformers' mixture-of-experts models: coverage, state dict, unwrap, guards."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import rgc
from rgc.experts import SketchedExperts, expert_weight_names
from rgc.memory import track
from rgc.registry import sketched_owner_of
from tests.models import MOE_FAMILIES, tiny_moe


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if expert_weight_names(m) is not None]


def wrap_quietly(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return rgc.wrap(model, **kw)


def ids_for(model, shape=(2, 6), seed=0):
    return torch.randint(0, model.config.vocab_size, shape,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_family_wraps_and_sketches_its_experts(family):
    model = tiny_moe(family, torch.bfloat16)
    experts = experts_modules(model)
    assert experts, family
    wrap_quietly(model, rank=4)
    for _, module in experts:
        assert isinstance(module, SketchedExperts) and type(module).__name__.startswith(
            "Sketched")
        assert set(module.rgc_owners) == set(expert_weight_names(module))
    routers = rgc.router_parameters(model)
    assert routers and not any(p.requires_grad for _, p in routers)
    model(ids_for(model)).logits.float().square().mean().backward()
    for name, owner in rgc.sketched_weights(model):
        assert owner.weight.grad is None
        assert owner.sketch is not None, name  # every expert stack saw tokens
        assert owner.sketch_matrices().shape == (owner.num_matrices, owner.out_features,
                                                 owner.rank)
    summary = rgc.wrap_summary(model)
    assert summary.count(kind="experts") == 0  # nothing left of the experts
    assert summary.count(kind="sketched experts", status="sketched") == sum(
        getattr(m, w).numel() for _, m in experts for w in expert_weight_names(m))


def test_dense_first_layers_and_shared_experts_are_compressed_linears():
    model = wrap_quietly(tiny_moe("deepseek_v3"), rank=4)
    names = {n for n, _ in rgc.compressed_layers(model)}
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.shared_experts.up_proj"} <= names
    model = rgc.wrap(tiny_moe("qwen2_moe"), rank=4)
    names = {n for n, _ in rgc.compressed_layers(model)}
    assert "model.layers.1.mlp.shared_expert.gate_proj" in names
    assert not model.model.layers[1].mlp.shared_expert_gate.weight.requires_grad  # a router


def test_train_routers_gives_them_ordinary_gradients():
    model = rgc.wrap(tiny_moe("qwen3_moe"), rank=4, train_routers=True)
    routers = rgc.router_parameters(model)
    assert [n for n, _ in routers] == ["model.layers.0.mlp.gate.weight",
                                       "model.layers.1.mlp.gate.weight"]
    model(ids_for(model)).logits.square().mean().backward()
    assert all(p.requires_grad and p.grad is not None for _, p in routers)
    assert rgc.wrap_summary(model).count(kind="router", status="dense") == sum(
        p.numel() for _, p in routers)
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        rgc.wrap(tiny_moe("qwen3_moe").model.layers[0].self_attn, rank=4, train_routers=True)


def test_expert_targets_by_name_and_predicate():
    model = rgc.wrap(tiny_moe("mixtral"), rank=4, targets=["down_proj"])
    assert [n for n, _ in rgc.sketched_weights(model)] == [
        "model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj"]
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad
    model = rgc.wrap(tiny_moe("mixtral"), rank=4, targets=["model.layers.1.mlp.experts"])
    assert [n for n, _ in rgc.sketched_weights(model)] == [
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    model = rgc.wrap(tiny_moe("mixtral"), rank=4,
                     targets=lambda name, m: isinstance(m, nn.Linear))
    assert all(isinstance(o, rgc.CompressedLinear) for _, o in rgc.sketched_weights(model))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_state_dict_is_unchanged_and_unwrap_restores(family):
    model = tiny_moe(family, torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {n: type(m) for n, m in model.named_modules()}
    implementation = model.config._experts_implementation
    ids = ids_for(model)
    with torch.no_grad():
        reference = model(ids).logits
    rgc.wrap(model, rank=4)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(k.endswith("_projection") for k in after)
    weights = [o.weight for _, o in rgc.sketched_weights(model)]
    rgc.unwrap(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert model.config._experts_implementation == implementation
    assert not rgc.sketched_weights(model)
    assert all(sketched_owner_of(w) is None for w in weights)
    assert not [b for b, _ in model.named_buffers() if b.endswith("_projection")]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)
    rgc.wrap(model, rank=4)  # wraps again after unwrap
    assert rgc.sketched_weights(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_no_grad_generation_is_the_unwrapped_models(family):
    plain = tiny_moe(family, torch.bfloat16)
    wrapped = wrap_quietly(copy.deepcopy(plain), rank=4)
    ids = ids_for(plain, (2, 5), seed=3)
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, plain(ids).logits)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.generate(ids, **kw), plain.generate(ids, **kw))
    with torch.inference_mode():
        assert torch.equal(wrapped(ids).logits, plain(ids).logits)


def test_set_experts_implementation_keeps_sketching():
    """A later set_experts_implementation changes what runs under no_grad, never turns the
    sketching of the training forward off."""
    plain = tiny_moe("qwen3_moe")
    model = rgc.wrap(copy.deepcopy(plain), rank=4)
    ids = ids_for(model)
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        model.set_experts_implementation(implementation)
        plain.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        for _, owner in rgc.sketched_weights(model):
            owner.zero_sketch()
        model(ids).logits.square().mean().backward()
        for _, owner in rgc.sketched_weights(model):
            assert owner.sketch is not None and owner.weight.grad is None
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits)


def test_forward_and_backward_never_allocate_a_dense_expert_gradient():
    """Every allocation of a wrapped MoE's forward and backward is smaller than one expert's
    d x k (so no [E, d, k] and no expert's d x k exists), no sketched weight's d x k shape
    appears, and the sketches do arrive."""
    model = wrap_quietly(tiny_moe("qwen3_moe", torch.bfloat16, hidden=64, expert_inter=40,
                                  experts=6), rank=4)
    ids = ids_for(model, (2, 5))
    smallest = min(o.out_features * o.in_features for _, o in rgc.sketched_weights(model)
                   if o.num_matrices > 1)
    assert smallest == 40 * 64
    with track() as t:
        loss = model(ids).logits.float().square().mean()
        loss.backward()
    assert all(o.sketch is not None for _, o in rgc.sketched_weights(model))
    too_big = [a for a in t.allocations if a.nbytes // a.dtype.itemsize >= smallest]
    assert not too_big, too_big[:5]
    shapes = {(o.num_matrices, o.out_features, o.in_features)
              for _, o in rgc.sketched_weights(model)}
    t.assert_no_shape(*shapes, *((e, k, d) for e, d, k in shapes),
                      *((d, k) for _, d, k in shapes), *((k, d) for _, d, k in shapes))


def test_copies_and_pickles_keep_their_owners_and_sketch_their_own_weights():
    model = rgc.wrap(tiny_moe("gpt_oss"), rank=4)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        pairs = rgc.sketched_weights(copied)
        assert len(pairs) == len(rgc.sketched_weights(model))
        for name, owner in pairs:
            assert sketched_owner_of(owner.weight) is owner
            original = dict(rgc.sketched_weights(model))[name]
            assert owner.weight is not original.weight
            assert torch.equal(owner.projection, original.projection)
        copied(ids_for(copied)).logits.square().mean().backward()
        assert all(o.sketch is not None for _, o in pairs)
    assert all(o.sketch is None for _, o in rgc.sketched_weights(model))


def test_an_owner_that_outlives_its_module_leaves_the_registry():
    """A reference kept to an expert owner does not keep its registry entry once its module
    is collected: a new tensor that reuses the weight's id must not find a stale owner."""
    import gc

    from rgc.registry import _OWNERS

    model = rgc.wrap(tiny_moe("qwen3_moe", layers=1), 4)
    owners = [o for _, o in rgc.sketched_weights(model) if o.num_matrices > 1]
    keys = [o._registry_key for o in owners]
    assert owners and all(_OWNERS[k]() is o for k, o in zip(keys, owners, strict=True))
    del model
    gc.collect()
    assert all(k not in _OWNERS or _OWNERS[k]() is not o
               for k, o in zip(keys, owners, strict=True))


def test_cast_regenerates_the_projection_in_the_new_dtype():
    model = rgc.wrap(tiny_moe("olmoe", torch.bfloat16), rank=4)
    owner = model.model.layers[0].mlp.experts.rgc_owners["gate_up_proj"]
    model.to(torch.float32)
    assert owner.projection.dtype == torch.float32
    assert torch.equal(owner.projection, rgc.make_projection(
        "orthonormal", owner.in_features, 4, seed=owner.projection_seed))
    assert sketched_owner_of(owner.weight) is owner


def test_coverage_warning_names_what_the_default_targets_leave():
    with pytest.warns(UserWarning, match=r"in_proj_qkv.*targets=set\(rgc.DEFAULT_TARGETS\) \| "
                                         r"\{'in_proj_a', 'in_proj_b', 'in_proj_qkv', "
                                         r"'in_proj_z'\}"):
        rgc.wrap(tiny_moe("qwen3_5_moe"), rank=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rgc.wrap(tiny_moe("qwen3_moe"), rank=4)  # every matrix covered: no warning
        # with the names the warning gives, nothing is left
        rgc.wrap(tiny_moe("qwen3_5_moe"), rank=4, targets=set(rgc.DEFAULT_TARGETS) | {
            "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"})


class UnhandledExperts(nn.Module):
    """3-D expert weights without transformers' experts interface."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 8))

    def forward(self, x):
        return torch.einsum("ni,eoi->no", x, self.w)


def test_coverage_warning_names_experts_it_cannot_sketch():
    model = nn.Module()
    model.q_proj = nn.Linear(8, 8)
    model.moe = nn.Module()
    model.moe.experts = UnhandledExperts()
    model.moe.router = nn.Linear(8, 4)
    with pytest.warns(UserWarning, match=r"experts moe\.experts\.w .*does not sketch"):
        rgc.wrap(model, rank=2)
    summary = rgc.wrap_summary(model)
    assert summary.count(kind="experts", status="frozen") == 4 * 16 * 8
    assert summary.count(kind="router", status="frozen") == 8 * 4 + 4
    assert summary.count(status="sketched") == 64
    assert summary.total == sum(p.numel() for p in model.parameters())
    assert "experts | frozen" in str(summary)


def test_experts_overriding_the_interface_forward_stay_frozen_with_a_warning():
    """An Experts subclass with its own forward (Ergo's per-route rows and norm) would be run
    as a different model by rgc's sketched forward: it is left as it is, frozen."""
    model = tiny_moe("qwen3_moe")
    base = type(model.model.layers[0].mlp.experts)
    own = type("RescaledExperts", (base,), {
        "forward": lambda self, h, idx, w: 2 * base.forward(self, h, idx, w)})
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = own
    ids = ids_for(model)
    with torch.no_grad():
        reference = model(ids).logits
    with pytest.warns(UserWarning, match=r"model\.layers\.\*\.mlp\.experts \(RescaledExperts "
                                         "overrides the forward of transformers' experts "
                                         "interface"):
        rgc.wrap(model, rank=4)
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is own and not hasattr(experts, "rgc_owners")
    assert not experts.gate_up_proj.requires_grad and not experts.down_proj.requires_grad
    assert all(isinstance(o, rgc.CompressedLinear) for _, o in rgc.sketched_weights(model))
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)
    assert rgc.wrap_summary(model).count(kind="experts", status="frozen") == sum(
        getattr(layer.mlp.experts, w).numel() for layer in model.model.layers
        for w in ("gate_up_proj", "down_proj"))


def test_nested_routers_are_found():
    """A router holding its scoring Linear one level down (AFMoE's router.gate, Ergo's
    gate.linear, Gemma 4's router.proj): all its parameters are router parameters."""
    model = nn.Module()
    model.q_proj = nn.Linear(8, 8)
    model.moe = nn.Module()
    model.moe.experts = UnhandledExperts()
    model.moe.scorer = nn.Module()
    model.moe.scorer.proj = nn.Linear(8, 4)  # hidden -> one score per expert
    model.moe.scorer.scale = nn.Parameter(torch.ones(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rgc.wrap(model, rank=2, train_routers=True)
    assert [n for n, _ in rgc.router_parameters(model)] == [
        "moe.scorer.scale", "moe.scorer.proj.weight", "moe.scorer.proj.bias"]
    assert all(p.requires_grad for _, p in rgc.router_parameters(model))
    assert rgc.wrap_summary(model).count(kind="router", status="dense") == 8 + 8 * 4 + 4


def test_wrap_errors_leave_the_model_untouched():
    model = tiny_moe("qwen3_moe", torch.float16)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match="dtype"):
        rgc.wrap(model, rank=4, targets=["gate_up_proj"])
    model = tiny_moe("qwen3_moe")
    with pytest.raises(ValueError, match="rank"):
        rgc.wrap(model, rank=17, targets=["down_proj"])  # down's k is 16
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert not rgc.sketched_weights(model)
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallel"):
        rgc.wrap(model, rank=4)
    experts._is_expert_parallel = False
    rgc.wrap(model, rank=4)
    with pytest.raises(ValueError, match="already wrapped"):
        rgc.wrap(model, rank=4)


def test_a_dense_gradient_of_a_sketched_expert_weight_is_refused():
    model = rgc.wrap(tiny_moe("qwen3_moe"), rank=4)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(RuntimeError, match="AdamW is stepping the weight of a sketched expert "
                                           "stack \\(4 experts of 32 x 32\\)"):
        torch.optim.AdamW([experts.gate_up_proj]).step()
    with pytest.raises(RuntimeError, match="received a dense gradient"):
        experts.down_proj.square().sum().backward()  # a use outside the experts forward
    assert experts.down_proj.grad is None
    copied = copy.deepcopy(model).model.layers[0].mlp.experts  # the copy is guarded too
    with pytest.raises(RuntimeError, match="received a dense gradient"):
        copied.gate_up_proj.sum().backward()
    experts.down_proj.grad = torch.zeros_like(experts.down_proj)  # set, not accumulated: allowed
    rgc.unwrap(model)
    experts.down_proj.grad = None
    experts.down_proj.square().sum().backward()  # unwrapped: dense training again
    assert experts.down_proj.grad is not None


def test_activation_checkpointing_gives_the_same_sketches():
    plain = tiny_moe("mixtral")
    checkpointed = copy.deepcopy(plain)
    rgc.wrap(plain, rank=4)
    rgc.wrap(checkpointed, rank=4)
    checkpointed.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the method's old name
        checkpointed.gradient_checkpointing_enable()
    ids = ids_for(plain)
    for model in (plain, checkpointed):
        model(ids).logits.square().mean().backward()
    for (_, a), (_, b) in zip(rgc.sketched_weights(plain), rgc.sketched_weights(checkpointed)):
        assert torch.equal(a.sketch, b.sketch)


def test_calibration_and_grad_norm_count_the_experts():
    model = rgc.wrap(tiny_moe("qwen3_moe"), rank=4)
    weights = [o.weight for _, o in rgc.sketched_weights(model)]
    rms = torch.cat([w.detach().reshape(-1) for w in weights]).double().square().mean().sqrt()
    assert abs(rgc.calibrate_lr(model, adamw_lr=1e-4) - 1e-4 / float(rms)) < 1e-9
    from rgc.integrations import grad_norm

    model(ids_for(model)).logits.square().mean().backward()
    optimizer = rgc.RGCOptimizer([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    expected = sum(float((o.sketch_matrices().double() @ o.projection.double().T).square().sum())
                   for _, o in rgc.sketched_weights(model))
    assert abs(float(grad_norm(optimizer)) ** 2 - expected) <= 1e-4 * expected


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_of_a_wrapped_model_is_a_vanilla_checkpoint(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = rgc.wrap(tiny_moe(family, torch.bfloat16), rank=4)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj.add_(0.5)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not rgc.sketched_weights(reloaded)
    state = reloaded.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
