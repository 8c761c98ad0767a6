"""The generic torch.optim contract, applied to every rgc optimizer.

What PyTorch's own optimizer suite checks for every built-in optimizer (state_dict round trips,
copy and pickle, hooks, tensor lr, default lr, maximize, param groups, schedulers, closures,
error inputs), run on RGCOptimizer, RowAdam, DistributedRGCOptimizer and DistributedRowAdam
(single process, no process group) over small wrapped and unwrapped models in BF16 and FP32.
Expected values come from uninterrupted runs, from the objective's negation, or from float64
formulas written here. Where rgc deliberately differs from torch.optim, the test asserts the
behaviour documented in docs/design.md ("Where rgc differs from torch.optim").
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import rgc
from rgc.distributed import DistributedRGCOptimizer, DistributedRowAdam
from tests.models import TwoLayerNet

D_IN, HIDDEN, D_OUT, RANK = 12, 10, 6, 3

OPTIMIZERS = {
    "rgc": (rgc.RGCOptimizer, dict(lr=2e-2)),
    "rowadam": (rgc.RowAdam, dict(lr=1e-2, weight_decay=0.1)),
    "distributed": (DistributedRGCOptimizer, dict(lr=2e-2)),
    "distributed-rowadam": (DistributedRowAdam, dict(lr=1e-2, weight_decay=0.1)),
}
PRESET = {"rgc": "rgc", "rowadam": "logra", "distributed": "rgc",
          "distributed-rowadam": "logra"}
KINDS = ("wrapped", "unwrapped")
DTYPES = (torch.bfloat16, torch.float32)
MATRIX = [(o, k, d) for o in OPTIMIZERS for k in KINDS for d in DTYPES]
MATRIX_IDS = [f"{o}-{k}-{str(d)[6:]}" for o, k, d in MATRIX]


def make_model(opt_name: str, kind: str, dtype: torch.dtype, seed: int = 0) -> TwoLayerNet:
    torch.manual_seed(seed)
    net = TwoLayerNet(D_IN, HIDDEN, D_OUT).to(dtype)
    if kind == "wrapped":
        rgc.wrap(net, RANK, preset=PRESET[opt_name], seed=7, freeze_others=False)
    return net


def make_opt(opt_name: str, params, **kwargs):
    cls, defaults = OPTIMIZERS[opt_name]
    return cls(params, **{**defaults, **kwargs})


def inputs(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(5, D_IN, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)


def objective(model: nn.Module, step: int) -> torch.Tensor:
    x = inputs(step, next(model.parameters()).dtype)
    return model(x).float().logsumexp(-1).mean()


def train(model, opt, steps, *, start: int = 0, sign: float = 1.0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = objective(model, step)
        (sign * loss).backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name} differs"


def assert_same_state(opt_a, opt_b) -> None:
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for p, q in zip(params_a, params_b, strict=True):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if torch.is_tensor(value):
                assert value.dtype == sb[key].dtype and torch.equal(value, sb[key]), key
            else:
                assert type(value) is type(sb[key]) and value == sb[key], key


def projections(model: nn.Module) -> list[torch.Tensor]:
    return [layer.projection.clone() for _, layer in rgc.compressed_layers(model)]


# ---------------------------------------------------------------- checkpoints, copies, pickle


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_state_dict_through_torch_save_weights_only_resumes_bit_identically(opt_name, kind,
                                                                             dtype):
    model, ref_model = make_model(opt_name, kind, dtype), make_model(opt_name, kind, dtype)
    opt, ref_opt = make_opt(opt_name, model.parameters()), make_opt(opt_name,
                                                                    ref_model.parameters())
    train(model, opt, 2)
    train(ref_model, ref_opt, 4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    resumed = make_model(opt_name, kind, dtype, seed=99)  # other weights, overwritten by the load
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = make_opt(opt_name, resumed.parameters())
    resumed_opt.load_state_dict(ckpt["opt"])
    train(resumed, resumed_opt, 2, start=2)
    assert_same_params(resumed, ref_model)
    assert_same_state(resumed_opt, ref_opt)
    assert resumed_opt.state_dict()["rgc_steps_taken"] == 4


def _copy_pair(pair, how: str):
    if how == "deepcopy":
        return copy.deepcopy(pair)
    if how == "pickle":
        return pickle.loads(pickle.dumps(pair))
    buffer = io.BytesIO()
    torch.save(pair, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_model_and_optimizer_copied_together_continue_bit_identically(opt_name, kind, dtype,
                                                                      how):
    model = make_model(opt_name, kind, dtype)
    opt = make_opt(opt_name, model.parameters(), keep_updates=True)
    train(model, opt, 2)
    model2, opt2 = _copy_pair((model, opt), how)
    assert opt2.steps_taken == opt.steps_taken == 2
    assert opt2.keep_updates == opt.keep_updates
    assert bool(projections(model2)) == (kind == "wrapped")
    assert all(torch.equal(a, b) for a, b in zip(projections(model), projections(model2),
                                                 strict=True))
    train(model, opt, 2, start=2)
    train(model2, opt2, 2, start=2)
    assert_same_params(model, model2)
    assert_same_state(opt, opt2)
    assert opt2.steps_taken == 4
    a, b = opt.export_update(model), opt2.export_update(model2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("opt_name", ["rgc", "rowadam"])
def test_copied_pair_with_step_control_continues_bit_identically(opt_name, how):
    model = make_model(opt_name, "wrapped", torch.bfloat16)
    ctl = rgc.PredictedKL(1e-3, 1e-4, anneal_steps=5, max_scale=4.0)
    opt = make_opt(opt_name, model.parameters(), step_control=ctl)
    ctl.set_probe(model, inputs(-1, torch.bfloat16))
    train(model, opt, 2)
    model2, opt2 = _copy_pair((model, opt), how)
    assert opt2.step_control is not ctl and opt2.step_control.steps == ctl.steps
    train(model, opt, 2, start=2)
    train(model2, opt2, 2, start=2)
    assert_same_params(model, model2)
    assert [r["alpha"] for r in ctl.history] == [r["alpha"] for r in opt2.step_control.history]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_copied_alone_keeps_its_attributes_and_steps(opt_name):
    """As torch: a copy of the optimizer alone holds copies of the parameters. It must still
    step (torch.optim's __getstate__ keeps only defaults, state and groups)."""
    model = make_model(opt_name, "wrapped", torch.bfloat16)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 1)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.steps_taken == 1 and clone.step_control is None
        before = [p.clone() for g in clone.param_groups for p in g["params"]]
        clone.step()  # no gradients, no sketches: nothing moves, nothing raises
        after = [p for g in clone.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------- old formats, dtype casts


def _first_format(state_dict: dict) -> dict:
    """rgc's first optimizer state format: the counters were int64 0-dim tensors."""
    old = copy.deepcopy(state_dict)
    for entry in old["state"].values():
        for key in ("step", "skipped", "layer_seed", "projection_version"):
            if key in entry:
                entry[key] = torch.tensor(entry[key], dtype=torch.int64)
    return old


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_steps_taken_survives_a_checkpoint_of_state_and_groups_only(opt_name):
    """torch.distributed.checkpoint keeps only 'state' and 'param_groups' of a state dict."""
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 3)
    sd = opt.state_dict()
    fresh = make_opt(opt_name, make_model(opt_name, "wrapped", torch.float32).parameters())
    fresh.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"]})
    assert fresh.steps_taken == 3
    assert all("rgc_steps_taken" not in g for g in fresh.param_groups)


@pytest.mark.parametrize("with_steps_taken", [True, False])
@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_first_state_format_resumes_bit_identically(opt_name, kind, dtype, with_steps_taken):
    model, ref_model = make_model(opt_name, kind, dtype), make_model(opt_name, kind, dtype)
    opt, ref_opt = make_opt(opt_name, model.parameters()), make_opt(opt_name,
                                                                    ref_model.parameters())
    train(model, opt, 3)
    train(ref_model, ref_opt, 5)
    old = _first_format(opt.state_dict())
    if not with_steps_taken:  # as written before the count existed
        del old["rgc_steps_taken"]
        for group in old["param_groups"]:
            del group["rgc_steps_taken"]
    buffer = io.BytesIO()
    torch.save(old, buffer)
    buffer.seek(0)
    resumed = make_model(opt_name, kind, dtype, seed=5)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = make_opt(opt_name, resumed.parameters())
    resumed_opt.load_state_dict(torch.load(buffer, weights_only=True))
    for state in resumed_opt.state.values():
        assert all(type(state[k]) is int for k in ("step", "skipped"))
    train(resumed, resumed_opt, 2, start=3)
    assert_same_params(resumed, ref_model)
    assert_same_state(resumed_opt, ref_opt)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_checkpoint_after_casting_a_wrapped_bf16_model_to_fp32_resumes_with_the_same_p(opt_name):
    model = make_model(opt_name, "wrapped", torch.bfloat16)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 2)
    model.to(torch.float32)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    live_p = projections(model)
    train(model, opt, 2, start=2)

    resumed = make_model(opt_name, "wrapped", torch.float32, seed=3)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = make_opt(opt_name, resumed.parameters())
    resumed_opt.load_state_dict(ckpt["opt"])
    for a, b in zip(live_p, projections(resumed), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    train(resumed, resumed_opt, 2, start=2)
    assert_same_params(model, resumed)


# ---------------------------------------------------------------- hooks


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_step_and_state_dict_hooks(opt_name, kind, dtype):
    model = make_model(opt_name, kind, dtype)
    opt = make_opt(opt_name, model.parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    train(model, opt, 2)
    assert calls == ["pre", "post"] * 2

    seen = {}
    opt.register_state_dict_pre_hook(lambda o: seen.setdefault("pre", True))

    def post(o, sd):
        seen["steps_taken"] = sd.get("rgc_steps_taken")
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert seen == {"pre": True, "steps_taken": 2}
    assert sd["extra"] == 1 and sd["rgc_steps_taken"] == 2


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_state_dict_pre_hook_may_store_a_non_dict_entry(opt_name):
    """As torch.optim's own test does: a pre hook writes a plain value into ``opt.state``;
    state_dict() keeps it, and the skip counters are still read."""
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 1)

    def pre(o):
        o.state["test"] = 1

    opt.register_state_dict_pre_hook(pre)
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    assert all(isinstance(v["skipped"], int) for k, v in sd["state"].items() if k != "test")
    assert opt.skipped_updates() == 0


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_load_state_dict_pre_hook_result_is_what_is_loaded(opt_name, kind, dtype):
    model = make_model(opt_name, kind, dtype)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 2)
    original = opt.state_dict()

    def pre(o, sd):
        changed = copy.deepcopy(sd)
        changed["param_groups"][0]["lr"] = 0.125
        changed["rgc_steps_taken"] = 40  # the top-level count wins over the groups' copies
        for entry in changed["state"].values():
            for key, value in entry.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    entry[key] = value * 2
        return changed

    fresh_model = make_model(opt_name, kind, dtype)
    fresh = make_opt(opt_name, fresh_model.parameters())
    fresh.register_load_state_dict_pre_hook(pre)
    fresh.load_state_dict(original)
    assert fresh.param_groups[0]["lr"] == 0.125 and fresh.steps_taken == 40
    doubled = 0
    params = [p for g in fresh.param_groups for p in g["params"]]
    for pid, entry in original["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.is_floating_point():
                loaded = fresh.state[params[pid]][key]
                assert loaded.dtype == value.dtype and torch.equal(loaded, value * 2), key
                doubled += 1
    assert doubled > 0 or not opt_name.endswith("rowadam")  # RowAdam always holds FP32 moments
    assert original["param_groups"][0]["lr"] == OPTIMIZERS[opt_name][1]["lr"]  # input untouched


@pytest.mark.parametrize("opt_name, dtype", [(o, d) for o in OPTIMIZERS for d in DTYPES])
def test_load_state_dict_post_hook_sees_restored_projections_and_state(opt_name, dtype):
    model = make_model(opt_name, "wrapped", dtype)
    opt = make_opt(opt_name, model.parameters())
    for layer in (layer for _, layer in rgc.compressed_layers(model)):
        layer.refresh = "every_step"
    train(model, opt, 3)
    saved = opt.state_dict()
    saved_p = projections(model)
    fresh_model = make_model(opt_name, "wrapped", dtype)
    fresh = make_opt(opt_name, fresh_model.parameters())
    seen = []

    def post(o):
        versions = [layer.projection_version for _, layer in rgc.compressed_layers(fresh_model)]
        dtypes = {k: v.dtype for s in o.state.values() for k, v in s.items()
                  if torch.is_tensor(v)}
        seen.append((versions, projections(fresh_model), dtypes, o.steps_taken))

    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(saved)
    (versions, post_p, dtypes, steps_taken), = seen
    assert versions == [3, 3] and steps_taken == 3
    assert all(torch.equal(a, b) for a, b in zip(saved_p, post_p, strict=True))
    if opt_name.endswith("rowadam"):  # FP32 moments stay FP32 even for BF16 weights (rgc's rule)
        assert dtypes == {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}


# ---------------------------------------------------------------- lr: tensor, default, groups


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_tensor_lr_equals_float_lr_also_under_a_scheduler(opt_name, kind, dtype):
    lr = OPTIMIZERS[opt_name][1]["lr"]
    runs = []
    for value in (lr, torch.tensor(lr, dtype=torch.float64)):
        model = make_model(opt_name, kind, dtype)
        opt = make_opt(opt_name, model.parameters(), lr=value)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(3):
            train(model, opt, 1, start=step)
            sched.step()
        runs.append((model, opt))
    (m_float, o_float), (m_tensor, o_tensor) = runs
    assert torch.is_tensor(o_tensor.param_groups[0]["lr"])  # filled in place, as torch does
    assert float(o_tensor.param_groups[0]["lr"]) == o_float.param_groups[0]["lr"] == lr / 8
    assert_same_params(m_float, m_tensor)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bad_lr_is_refused_with_torch_like_messages(opt_name):
    params = list(make_model(opt_name, "wrapped", torch.float32).parameters())
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make_opt(opt_name, params, lr=torch.tensor([1e-3, 2e-3]))
    for bad in (-1.0, float("nan"), float("inf"), torch.tensor(-1.0), "0.1", True):
        with pytest.raises(ValueError, match="lr"):
            make_opt(opt_name, params, lr=bad)
    make_opt(opt_name, params, lr=torch.tensor([1e-3]))  # 1 element: accepted, as torch


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_lr_has_a_default_when_every_group_sets_its_own(opt_name):
    cls = OPTIMIZERS[opt_name][0]
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = cls([{"params": model.up_proj.parameters(), "lr": 1e-3},
               {"params": list(model.down_proj.parameters()) + list(model.norm.parameters()),
                "lr": 3e-3}])
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 3e-3]
    assert opt.defaults["lr"] == 1e-3  # torch.optim's default for Adam and SGD
    train(model, opt, 1)


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_param_groups_and_add_param_group(opt_name, kind, dtype):
    """Two groups with their own lr equal two optimizers; a group added later trains; a bad
    group is refused and leaves the optimizer as it was."""
    model = make_model(opt_name, kind, dtype)
    first = list(model.up_proj.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = make_opt(opt_name, [{"params": first, "lr": 5e-3}])
    opt.add_param_group({"params": rest})
    assert opt.param_groups[1]["lr"] == OPTIMIZERS[opt_name][1]["lr"]
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": -1.0})
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group({"params": first})
    assert len(opt.param_groups) == 2
    train(model, opt, 2)
    start = dict(make_model(opt_name, kind, dtype).named_parameters())
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
    assert "up_proj.weight" in moved and "down_proj.weight" in moved


# ---------------------------------------------------------------- maximize


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_maximize_equals_minimising_the_negated_objective(opt_name, kind, dtype):
    up, down = make_model(opt_name, kind, dtype), make_model(opt_name, kind, dtype)
    opt_up = make_opt(opt_name, up.parameters(), maximize=True)
    opt_down = make_opt(opt_name, down.parameters())
    losses = train(up, opt_up, 3)  # backward of +objective, maximised
    train(down, opt_down, 3, sign=-1.0)  # backward of -objective, minimised
    assert_same_params(up, down)
    assert_same_state(opt_up, opt_down)
    assert opt_up.param_groups[0]["maximize"] is True
    plain = make_model(opt_name, kind, dtype)
    assert train(plain, make_opt(opt_name, plain.parameters()), 3)[0] == losses[0]
    assert not torch.equal(plain.down_proj.weight, up.down_proj.weight)
    # to first order the step raises the objective it was computed on: compare on one batch
    probe_up, probe_down = make_model(opt_name, kind, dtype), make_model(opt_name, kind, dtype)
    before = float(objective(probe_up, 0))
    for net, flag in ((probe_up, True), (probe_down, False)):
        o = make_opt(opt_name, net.parameters(), maximize=flag, lr=1e-3)
        objective(net, 0).backward()
        o.step()
    with torch.no_grad():
        assert float(objective(probe_up, 0)) > before > float(objective(probe_down, 0))


def test_maximize_is_a_per_group_option_and_is_checked():
    model = make_model("rowadam", "wrapped", torch.float32)
    opt = make_opt("rowadam", model.parameters())
    assert all(g["maximize"] is False for g in opt.param_groups)
    with pytest.raises(ValueError, match="maximize"):
        make_opt("rgc", model.parameters(), maximize="yes")


# ---------------------------------------------------------------- edge inputs


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_no_trainable_parameter_builds_with_a_warning_and_steps_as_a_no_op(opt_name):
    model = make_model(opt_name, "unwrapped", torch.float32).requires_grad_(False)
    with pytest.warns(UserWarning, match="no trainable parameter"):
        opt = make_opt(opt_name, model.parameters())
    before = copy.deepcopy(model.state_dict())
    assert opt.step() is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="empty parameter list"):
        make_opt(opt_name, [])


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_complex_parameters_are_refused_at_construction(opt_name):
    z = torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(TypeError, match="complex.*view_as_real"):
        make_opt(opt_name, [z])
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = make_opt(opt_name, model.parameters())
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1
    real = torch.view_as_real(z.detach()).clone().requires_grad_(True)
    make_opt(opt_name, [real])  # the documented way round


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_float64_parameters_get_fp32_arithmetic_as_documented(opt_name):
    """docs: an FP64 parameter receives an FP32-computed value each step. The result is
    FP32-representable and equals the float64 formula to FP32 precision."""
    torch.manual_seed(3)
    p = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, 5, dtype=torch.float64)
    lr = 1e-2
    no_decay = {"weight_decay": 0.0} if opt_name.endswith("rowadam") else {}
    opt = make_opt(opt_name, [p], lr=lr, **no_decay)
    p0 = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    if opt_name.endswith("rowadam"):  # first Adam step: m_hat = g, v_hat = g^2
        expected = p0 - lr * g / (g.abs() + 1e-8)
    else:
        expected = p0 - lr * p0.norm() / g.norm() * g
    assert p.dtype == torch.float64
    assert torch.equal(p.detach(), p.detach().float().double())
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(p.detach(), expected)  # FP64 precision is not kept


@pytest.mark.parametrize("opt_name, kind, dtype", MATRIX, ids=MATRIX_IDS)
def test_closure_zero_grad_and_step_without_gradients(opt_name, kind, dtype):
    model = make_model(opt_name, kind, dtype)
    opt = make_opt(opt_name, model.parameters())
    before = copy.deepcopy(model.state_dict())
    opt.step()  # nothing accumulated: nothing moves
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    def closure():
        opt.zero_grad()
        loss = objective(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.requires_grad
    objective(model, 1).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(layer.sketch is None for _, layer in rgc.compressed_layers(model))


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_load_state_dict_with_other_groups_is_refused(opt_name):
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = make_opt(opt_name, model.parameters())
    train(model, opt, 1)
    sd = opt.state_dict()
    other = make_opt(opt_name, list(model.parameters())[:2])
    with pytest.raises(ValueError, match="parameter group"):
        other.load_state_dict(sd)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_profiler_sees_the_step_by_class_name_also_after_a_copy(opt_name):
    model = make_model(opt_name, "wrapped", torch.float32)
    opt = make_opt(opt_name, model.parameters())
    clone_model, clone = copy.deepcopy((model, opt))
    name = f"Optimizer.step#{type(opt).__name__}.step"
    for m, o in ((model, opt), (clone_model, clone)):
        objective(m, 0).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                o.step()
        assert name in {e.name for e in prof.events()}


def test_state_tensors_keep_their_dtype_on_load_unlike_torch():
    """rgc's documented difference: torch.optim casts floating state to the parameter dtype
    (BF16 here); RowAdam keeps its FP32 moments so that resume is bit-identical."""
    model = make_model("rowadam", "wrapped", torch.bfloat16)
    opt = make_opt("rowadam", model.parameters())
    train(model, opt, 1)
    fresh = make_opt("rowadam", model.parameters())
    fresh.load_state_dict(opt.state_dict())
    assert fresh.state
    for state in fresh.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # torch.optim would have cast them: the same dict loaded by a torch optimizer
    torch_sgd = torch.optim.SGD(model.parameters())
    torch_sgd.load_state_dict({"state": opt.state_dict()["state"],
                               "param_groups": torch_sgd.state_dict()["param_groups"]})
    assert torch_sgd.state[model.up_proj.weight]["exp_avg"].dtype == torch.bfloat16
