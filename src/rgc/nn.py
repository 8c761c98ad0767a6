"""``CompressedLinear`` and the one-call ``wrap`` / ``unwrap`` of a model."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from rgc.autograd import SketchedLinearFunction, linear_in
from rgc.coverage import warn_coverage_gap
from rgc.experts import is_sketched_experts, sketch_experts, unsketch_experts
from rgc.experts.module import check_experts
from rgc.guards import check_wrap_targets, install_step_guard, register_wrapped
from rgc.projection import check_rank
from rgc.registry import SUPPORTED_WEIGHT_DTYPES, SketchedModule
from rgc.seeding import derive_seed
from rgc.sketched import SketchedWeight, check_refresh
from rgc.targets import DEFAULT_TARGETS, Targets, plan_targets, skipped_message


class CompressedLinear(SketchedModule, SketchedWeight, nn.Linear):
    """Drop-in ``nn.Linear`` whose weight is trained from a rank-``r`` gradient sketch.

    Same ``weight`` (d x k) and ``bias`` parameters and state_dict keys as ``nn.Linear``.
    In training, forward saves ``X P`` (P: k x r, the ``projection`` buffer, in the weight's
    dtype) instead of ``X``; backward returns the exact input gradient and accumulates the
    FP32 sketch ``sketch += D^T (X P)`` (d x r) over backward calls. ``weight.grad`` stays
    ``None``. A trainable bias gets its ordinary gradient. Under ``no_grad``/``inference_mode``,
    or with a frozen weight, it is a plain linear layer and saves nothing.

    ``P`` is regenerated from ``(seed, projection_version)``; the optimizer advances the
    version after an update according to ``refresh`` ('every_step', 'never' or every N).
    Casting the layer to another dtype (``model.to(torch.float32)``) regenerates ``P`` in it.

    ``compute_dtype`` (attribute, default ``None``: the weight's dtype) is the dtype of the
    layer's matmuls, forward and backward: e.g. ``torch.float32`` for BF16 weights on a CPU
    whose BF16 matmuls are slow (:func:`rgc.compute.use_compute_dtype` sets it). Each matmul
    then upcasts a transient copy of the weight (and of its other operand); the weight stays
    stored in its dtype, ``X P`` is saved in the input's dtype and the sketch is FP32 as always.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int,
                 projection: str = "orthonormal", refresh="every_step", seed: int = 0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(rank, projection, refresh, seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, *, projection: str = "orthonormal",
                    refresh="every_step", seed: int = 0) -> CompressedLinear:
        """A CompressedLinear sharing ``linear``'s weight and bias Parameters (no copy)."""
        if not isinstance(linear, nn.Linear) or isinstance(linear, CompressedLinear):
            raise TypeError(f"expected a plain nn.Linear, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer._setup(rank, projection, refresh, seed)
        return layer

    def _setup(self, rank: int, projection: str, refresh, seed: int) -> None:
        check_rank(projection, self.in_features, rank)
        if self.weight.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise TypeError(
                f"CompressedLinear supports weights in {SUPPORTED_WEIGHT_DTYPES}, got "
                f"{self.weight.dtype}; convert the model first, e.g. model.to(torch.bfloat16)")
        self._setup_sketching(rank, projection, refresh, seed)
        self.compute_dtype: torch.dtype | None = None
        self.register_buffer("projection", self._make_projection(), persistent=False)
        self._new_sketch_slot()
        self._register()
        install_step_guard()

    def weight_matrices(self) -> torch.Tensor:
        """The weight as a stack of one d x k matrix, ``[1, d, k]`` (a view)."""
        return self.weight.unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ensure_materialised()
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return SketchedLinearFunction.apply(x, self.weight, self.bias, self.projection,
                                                self._sketch_slot, self.compute_dtype)
        return linear_in(x, self.weight, self.bias, self.compute_dtype)

    def owners_by_attribute(self) -> dict:
        return {"weight": self}

    def _set_projection_buffer(self, projection: torch.Tensor) -> None:
        self.projection = projection

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_sketch_slot", None)  # its hook points at this layer; a copy gets its own
        return state

    def __setstate__(self, state):
        state.setdefault("compute_dtype", None)
        super().__setstate__(state)
        self._register()
        self._new_sketch_slot()

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank={self.rank}, projection={self.projection_kind!r}, "
                f"refresh={self.refresh!r}")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def compressed_layers(model: nn.Module) -> list[tuple[str, CompressedLinear]]:
    """``(qualified name, layer)`` for every CompressedLinear in ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, CompressedLinear)]


def sketched_weights(model: nn.Module) -> list[tuple[str, SketchedWeight]]:
    """``(qualified parameter name, owner)`` for every sketched weight of ``model``.

    Owners are :class:`CompressedLinear` layers (``<name>.weight``) and the
    :class:`rgc.experts.ExpertWeight` owners of sketched experts (``<name>.gate_up_proj``, ...),
    in module order.
    """
    out = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, CompressedLinear):
            out.append((f"{prefix}weight", module))
        elif is_sketched_experts(module):
            out += [(f"{prefix}{w}", owner) for w, owner in module.rgc_owners.items()]
    return out


def router_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the routers of the model's mixture-of-experts blocks (all
    parameters of each router module, nested ones included; see :func:`rgc.targets.routers`)."""
    return list(plan_targets(model).routers)


#: ``wrap(..., preset=name)``: the projection kind and refresh schedule of each method.
PRESETS = {
    "rgc": {"projection": "orthonormal", "refresh": "every_step"},
    "logra": {"projection": "rademacher", "refresh": "never"},
}


def wrap(model: nn.Module, rank: int, *, targets: Targets = None,
         projection: str | None = None, refresh=None, seed: int = 0,
         freeze_others: bool = True, preset: str = "rgc",
         train_routers: bool = False) -> nn.Module:
    """Sketch the target weights of ``model`` in place: linear layers and expert stacks.

    Target ``nn.Linear`` layers become :class:`CompressedLinear`; the target 3-D expert weights
    of transformers' mixture-of-experts ``Experts`` modules (``gate_up_proj``, ``down_proj``)
    are sketched per expert by :func:`rgc.experts.sketch_experts` (the module keeps its
    Parameters and state-dict keys; its class gains the sketched forward).

    Args:
        model: any ``nn.Module``; it is modified in place and returned.
        rank: sketch rank ``r`` for every target (an ``int`` >= 1; not a bool).
        targets: ``None`` for :data:`DEFAULT_TARGETS` (matched on the last name component),
            a list of names (last component or fully qualified), or a predicate
            ``(qualified_name, module) -> bool``. Expert weights are matched by their
            parameter names (``...experts.gate_up_proj``; a predicate gets the experts module).
            :func:`rgc.targets.plan_targets` resolves them: a selected module rgc cannot
            sketch (not an ``nn.Linear``; an Experts class overriding the forward of
            transformers' experts interface) is skipped with a ``UserWarning`` naming it.
        projection: 'orthonormal', 'rademacher' or 'gaussian'; default from ``preset``.
        refresh: 'every_step' (new P after every update), 'never', or N (every N updates);
            default from ``preset``.
        seed: every layer's seed is derived from it and the layer's qualified name.
        freeze_others: set ``requires_grad=False`` on every parameter outside the targets.
            A target's bias (expert biases included) keeps its ``requires_grad``; the target
            weights are made trainable.
        preset: 'rgc' (orthonormal P, refreshed every step) or 'logra' (Rademacher P, fixed);
            see :data:`PRESETS`. Explicit ``projection``/``refresh`` override it.
        train_routers: the routers of mixture-of-experts blocks (:func:`router_parameters`)
            are frozen by default (``requires_grad=False`` whatever ``freeze_others`` says);
            ``True`` makes them trainable with ordinary gradients (the optimizer's dense
            rule).

    All checks run before the model is touched. The weights are shared, not copied, and the
    wrapped model's ``state_dict()`` has the same keys and tensors as the original. With the
    default targets, a ``UserWarning`` names the matrices left frozen when they hold more than
    :data:`rgc.coverage.COVERAGE_WARN_SHARE` of the parameters; :func:`rgc.wrap_summary`
    tells what is trained.
    """
    if sketched_weights(model):
        raise ValueError("the model is already wrapped; call rgc.unwrap(model) before wrapping "
                         "it again")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    projection = PRESETS[preset]["projection"] if projection is None else projection
    refresh = PRESETS[preset]["refresh"] if refresh is None else refresh
    check_refresh(refresh)
    plan = plan_targets(model, targets)
    if not plan:
        shown = DEFAULT_TARGETS if targets is None else targets
        if not callable(shown):
            shown = sorted(shown)
        if plan.skipped:
            raise TypeError(f"targets {shown!r} matched only modules rgc cannot sketch: "
                            f"{skipped_message(plan.skipped)}; pass targets= naming nn.Linear "
                            "layers or transformers Experts modules")
        linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                               if isinstance(m, nn.Linear)})
        raise ValueError(f"targets {shown!r} matched no module; the model's nn.Linear layers "
                         f"are named {linear_names}")
    chosen, experts, routers = plan.linears, plan.experts, plan.routers
    if train_routers and not routers:
        raise ValueError("train_routers=True, but the model has no mixture-of-experts router")
    check_wrap_targets(model, [*chosen, *((n, m) for n, m, _ in experts)])
    for name, module in chosen:
        if module.weight.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise TypeError(f"target {name!r} has weight dtype {module.weight.dtype}; supported: "
                            f"{SUPPORTED_WEIGHT_DTYPES}. Convert the model first.")
        check_rank(projection, module.in_features, rank)
    for name, module, weights in experts:
        check_experts(name, module, weights, rank, projection)
    if plan.skipped:
        warnings.warn(f"rgc.wrap skips targets it cannot sketch (left as they are, frozen unless "
                      f"freeze_others=False): {skipped_message(plan.skipped)}", UserWarning,
                      stacklevel=2)

    biases = [m.bias for _, m in chosen if m.bias is not None]
    biases += [getattr(m, f"{w}_bias") for _, m, ws in experts if m.has_bias for w in ws]
    bias_trainable = [p.requires_grad for p in biases]
    if freeze_others:
        for p in model.parameters():
            p.requires_grad_(False)
    for p, trainable in zip(biases, bias_trainable, strict=True):
        p.requires_grad_(trainable)
    for _, p in routers:
        p.requires_grad_(train_routers)
    for name, module in chosen:
        module.weight.requires_grad_(True)
        layer = CompressedLinear.from_linear(module, rank, projection=projection,
                                             refresh=refresh, seed=derive_seed(seed, name))
        _set_submodule(model, name, layer)
    for name, module, weights in experts:
        for w in weights:
            getattr(module, w).requires_grad_(True)
        sketch_experts(module, {w: derive_seed(seed, f"{name}.{w}") for w in weights},
                       rank=rank, projection=projection, refresh=refresh)
    register_wrapped(model)
    if targets is None:
        warn_coverage_gap(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Replace every CompressedLinear by a plain ``nn.Linear`` sharing its trained weight, and
    give every sketched experts module its original class (and so its original forward).

    Pending sketches and projections are dropped; ``requires_grad`` flags are left as they
    are. Returns ``model`` (modified in place).
    """
    for _, module in model.named_modules():
        if is_sketched_experts(module):
            unsketch_experts(module)
    for name, layer in compressed_layers(model):
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           device="meta")
        linear.weight = layer.weight
        linear.bias = layer.bias
        layer.sketch = None
        _set_submodule(model, name, linear)
    return model
