"""Sketched experts: the owners of 3-D expert weights and the experts forward that sketches them.

transformers (>= 5) stores the experts of a mixture-of-experts layer as 3-D Parameters of one
``Experts`` module whose class is decorated by ``use_experts_implementation``: ``gate_up_proj``
``[E, 2I, H]`` (``up_proj`` ``[E, I, H]`` without a gate) and ``down_proj`` ``[E, H, I]``, or
transposed (``is_transposed``: ``[E, H, 2I]`` and ``[E, I, H]``, gpt-oss), with optional
``*_bias`` ``[E, d]``. The decorator gives the class its flags (``has_gate``, ``has_bias``,
``is_transposed``, ``has_post_expert_norm``) and a ``forward`` that dispatches, on every call,
to the function ``config._experts_implementation`` names.

:func:`sketch_experts` changes the class of such a module in place to a subclass of it
(:class:`SketchedExperts` mixed in; the module object, its Parameters, hooks and state-dict keys
stay what they were). Its ``forward`` runs, when grad is enabled and an expert weight is
trainable, the grouped computation of transformers' ``grouped_mm`` implementation with the
expert products replaced by :class:`rgc.experts.autograd.SketchedExpertsFunction`; otherwise
(``no_grad``, ``inference_mode``, frozen experts) it calls the original class's ``forward``,
i.e. whatever implementation the config names, so generation is the unwrapped model's.
A later ``model.set_experts_implementation(...)`` therefore changes what runs under ``no_grad``
and never turns sketching off. :func:`unsketch_experts` puts the original class back.

Each sketched weight has an :class:`ExpertWeight` owner (a
:class:`rgc.sketched.SketchedWeight`: ``num_matrices = E``, ``in_features = k``,
``out_features = d`` for the ``d x k`` matrix the layer multiplies by, ``sketch`` ``[E, d, r]``
FP32), found from the Parameter with :func:`rgc.registry.sketched_owner_of`. Its projection
``P`` (``k x r``, the weight's dtype) is a non-persistent buffer of the experts module named
``<weight>_projection``, shared by the experts of that weight.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

from rgc.experts.autograd import SketchedExpertsFunction
from rgc.experts.grouped import grouped_mm
from rgc.projection import check_rank
from rgc.registry import (
    SUPPORTED_WEIGHT_DTYPES,
    SketchedModule,
    unregister_owner,
    unregister_owner_key,
)
from rgc.sketched import SketchedWeight
from rgc.updates import is_zero

_FLAGS = ("has_gate", "has_bias", "is_transposed", "num_experts")


def expert_weight_names(module: nn.Module) -> tuple[str, str] | None:
    """``(up, down)`` weight names of a transformers Experts module, or ``None`` if not one.

    ``up`` is ``'gate_up_proj'`` (``'up_proj'`` for experts without a gate), ``down`` is
    ``'down_proj'``; both must be 3-D Parameters.
    """
    if not all(hasattr(module, flag) for flag in _FLAGS):
        return None
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    for name in names:
        p = module._parameters.get(name)
        if p is None or p.dim() != 3:
            return None
    return names


def is_sketched_experts(module: nn.Module) -> bool:
    return isinstance(module, SketchedExperts)


def _projection_buffer(name: str) -> str:
    return f"{name}_projection"


class ExpertWeight(SketchedWeight):
    """Owner of one 3-D expert weight: projection, sketch and seed of a stack of E experts.

    ``weight`` is the module's Parameter (``[E, d, k]``, or ``[E, k, d]`` when
    ``transposed``); :meth:`weight_matrices` is always ``[E, d, k]`` (a strided view for
    transposed storage). ``projection`` is the module's buffer ``<name>_projection``.
    """

    def __init__(self, module: nn.Module, name: str, *, rank: int, projection: str,
                 refresh, seed: int):
        self.name = name
        self.transposed = bool(module.is_transposed)
        self._bind(module)
        weight = getattr(module, name)
        experts, rows, cols = weight.shape
        self.num_matrices = experts
        self.out_features, self.in_features = (cols, rows) if self.transposed else (rows, cols)
        check_rank(projection, self.in_features, rank)
        self._setup_sketching(rank, projection, refresh, seed)
        module.register_buffer(_projection_buffer(name), self._make_projection(),
                               persistent=False)
        self._new_sketch_slot()
        self._register()
        self._guard_dense_gradient()

    def _guard_dense_gradient(self) -> None:
        """Refuse, in backward, a dense gradient of the weight: a use of the expert weights
        outside the sketched forward (a hub or custom kernel computing the MoE block), whose
        contribution the sketch would miss. Copies and pickles drop tensor hooks;
        :meth:`_attach` adds it again."""
        self._grad_guard = self.weight.register_hook(_refuse_dense_gradient)

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError("the experts module of this expert weight no longer exists")
        return module

    @property
    def weight(self) -> nn.Parameter:
        return getattr(self.module, self.name)

    @property
    def projection(self) -> torch.Tensor:
        return getattr(self.module, _projection_buffer(self.name))

    @property
    def sketch_shape(self) -> tuple[int, int, int]:
        return (self.num_matrices, self.out_features, self.rank)

    def _set_projection_buffer(self, projection: torch.Tensor) -> None:
        setattr(self.module, _projection_buffer(self.name), projection)

    def weight_matrices(self) -> torch.Tensor:
        """The weight as ``[E, d, k]`` (the transposed view of ``[E, k, d]`` storage)."""
        return _matrices(self.module, self.name)

    def _bind(self, module: nn.Module) -> None:
        """Hold ``module`` weakly; when it is collected, drop this owner's registry entry: an
        owner that outlives its module (kept by a reference elsewhere) must not match a new
        tensor that reuses its weight's id."""
        me = weakref.ref(self)

        def gone(_):
            owner = me()
            key = getattr(owner, "_registry_key", None)
            if key is not None:
                unregister_owner_key(key, owner)

        self._module = weakref.ref(module, gone)

    def _attach(self, module: nn.Module) -> None:
        """Bind to ``module`` (after a copy or unpickling) and register the weight."""
        self._bind(module)
        self._register()
        self._new_sketch_slot()
        self._guard_dense_gradient()

    def __getstate__(self):
        state = self.__dict__.copy()
        # the module re-attaches its owners (a weak reference cannot be copied); the slot's
        # hook points at this owner, a copy gets its own
        state.pop("_module", None)
        state.pop("_sketch_slot", None)
        state.pop("_grad_guard", None)
        return state

    def __repr__(self) -> str:
        return (f"ExpertWeight({self.name!r}, experts={self.num_matrices}, d={self.out_features},"
                f" k={self.in_features}, rank={self.rank})")


def _refuse_dense_gradient(grad: torch.Tensor | None) -> None:
    # autograd calls the hook with None for the weight the sketched Function saw (it returns
    # no weight gradient); a tensor is a dense gradient on its way to .grad
    if grad is None:
        return
    raise RuntimeError(
        f"a sketched expert weight {tuple(grad.shape)} received a dense gradient: something "
        "computed with it outside the experts module's forward (a hub or custom MoE kernel, "
        "e.g. after kernelize(model), or a direct use of the Parameter), and the sketch would "
        "miss that use. Run the model's own experts forward, or rgc.unwrap(model) to train the "
        "experts densely")


def _rebuild(base: type) -> nn.Module:
    """An empty instance of the sketched subclass of ``base`` (pickle's constructor)."""
    cls = sketched_class(base)
    return cls.__new__(cls)


class SketchedExperts(SketchedModule):
    """Mixed into the class of a transformers Experts module by :func:`sketch_experts`.

    Attributes added to the module: ``rgc_owners`` (``{weight name: ExpertWeight}``) and one
    projection buffer per sketched weight. ``_rgc_base`` (class attribute) is the original class.
    """

    _rgc_base: type

    def forward(self, hidden_states, *args, **kwargs):
        for owner in self.rgc_owners.values():
            owner.ensure_materialised()
        tangents = self.__dict__.get("_rgc_tangents")
        if tangents is None and fwAD.unpack_dual(hidden_states).tangent is not None:
            tangents = {}  # forward AD through experts with no update: no grouped GEMM's JVP
        if tangents is None and (not torch.is_grad_enabled() or not any(
                o.weight.requires_grad for o in self.rgc_owners.values())):
            return super().forward(hidden_states, *args, **kwargs)
        # the routing arguments by position, whatever the class names them (gpt-oss:
        # router_indices, routing_weights; the others: top_k_index, top_k_weights)
        bound = _forward_signature(self._rgc_base).bind(self, hidden_states, *args, **kwargs)
        bound.apply_defaults()
        _, _, top_k_index, top_k_weights = bound.args[:4]
        return sketched_experts_forward(self, hidden_states, top_k_index, top_k_weights,
                                        tangents=tangents)

    def owners_by_attribute(self) -> dict:
        return self.__dict__.get("rgc_owners", {})

    def __reduce_ex__(self, protocol):
        return _rebuild, (self._rgc_base,), self.__getstate__()

    def __setstate__(self, state):
        super().__setstate__(state)
        for owner in self.rgc_owners.values():
            owner._attach(self)

    def extra_repr(self) -> str:
        parts = [super().extra_repr()] + [
            f"{name}: rank={o.rank}, projection={o.projection_kind!r}, refresh={o.refresh!r}"
            for name, o in self.rgc_owners.items()]
        return ", ".join(p for p in parts if p)


_SKETCHED_CLASSES: dict[type, type] = {}


@functools.cache
def _forward_signature(base: type) -> inspect.Signature:
    return inspect.signature(base.forward)


def sketched_class(base: type) -> type:
    """The subclass of ``base`` with :class:`SketchedExperts` mixed in (one per class)."""
    if base not in _SKETCHED_CLASSES:
        _SKETCHED_CLASSES[base] = type(f"Sketched{base.__name__}", (SketchedExperts, base),
                                       {"_rgc_base": base, "__module__": __name__})
    return _SKETCHED_CLASSES[base]


def check_experts(name: str, module: nn.Module, weights: list[str], rank: int,
                  projection: str) -> None:
    """Raise before any change if ``module``'s ``weights`` cannot be sketched."""
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"experts module {name!r} runs expert parallel (its experts are sharded across "
            "ranks by transformers' tensor-parallel plan); rgc sketches experts held whole on "
            "each rank: load the model without the expert-parallel plan")
    for w in weights:
        p = getattr(module, w)
        if p.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise TypeError(f"expert weight {name}.{w} has dtype {p.dtype}; supported: "
                            f"{SUPPORTED_WEIGHT_DTYPES}. Convert the model first.")
        k = p.shape[1] if module.is_transposed else p.shape[2]
        check_rank(projection, k, rank)


def sketch_experts(module: nn.Module, weights: dict[str, int], *, rank: int, projection: str,
                   refresh) -> None:
    """Sketch ``module``'s expert ``weights`` (``{name: seed}``) in place; see the module doc."""
    if is_sketched_experts(module):
        raise ValueError("these experts are already sketched; call rgc.unwrap(model) first")
    base = type(module)
    module.__class__ = sketched_class(base)
    module.rgc_owners = {}
    for name, seed in weights.items():
        module.rgc_owners[name] = ExpertWeight(module, name, rank=rank, projection=projection,
                                               refresh=refresh, seed=seed)


def unsketch_experts(module: nn.Module) -> None:
    """Give a sketched experts module back its class; drop projections and pending sketches."""
    for name, owner in module.rgc_owners.items():
        owner.sketch = None
        owner._grad_guard.remove()
        unregister_owner(owner.weight, owner)
        buffer = _projection_buffer(name)
        del module._buffers[buffer]
        module._non_persistent_buffers_set.discard(buffer)
    del module.rgc_owners
    module.__class__ = module._rgc_base


@contextlib.contextmanager
def update_tangents(updates: list):
    """While open, the sketched experts forward gives the outputs of the expert products of
    ``updates`` (:class:`rgc.updates.LowRankUpdate` of expert weights) their forward-mode
    tangent: what a step controller's probe (:func:`rgc.control.logits_jvp`) needs, inside an
    ``fwAD.dual_level()``. Other modules are untouched."""
    modules: dict[nn.Module, dict] = {}
    for u in updates:
        modules.setdefault(u.layer.module, {})[u.layer.name] = u
    try:
        for module, by_name in modules.items():
            module.__dict__["_rgc_tangents"] = by_name
        yield
    finally:
        for module in modules:
            module.__dict__.pop("_rgc_tangents", None)


def sketched_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                             top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                             tangents: dict | None = None) -> torch.Tensor:
    """The experts layer on ``n`` tokens with sketched expert weights.

    ``hidden_states`` [n, H]; ``top_k_index`` [n, K] (int, expert of each of a token's K
    slots) and ``top_k_weights`` [n, K] (routing weights). Returns [n, H] in the input's dtype.
    The rows are sorted by expert (``torch.sort``, as transformers' ``grouped_mm``
    implementation sorts them, so the outputs are its outputs bit for bit), run through the up
    (gate/up) weight, its bias, the module's own gate/activation, the down weight, its bias and
    optional post-expert norm, then weighted and summed per token in the same order.

    ``tangents`` (``{weight name: LowRankUpdate}``, set by :func:`update_tangents`): the
    forward-mode form of the same computation, the products by :func:`_product_with_tangent`
    (no sketch is accumulated).
    """
    up_name, down_name = expert_weight_names(module)
    up, down = getattr(module, up_name), getattr(module, down_name)
    owners = module.rgc_owners
    num_top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    expert_sorted, perm = torch.sort(expert_ids)
    token_of_row = perm // num_top_k
    # rows per expert in a tensor of static shape (bincount's depends on the data, a graph
    # break under torch.compile); an id past the last expert, if a family emits one for a
    # dropped slot, is counted apart and its rows lie past offs[-1], where nothing is written
    num_experts = module.num_experts
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.clamp(0, num_experts).long(),
                        torch.ones_like(expert_ids, dtype=torch.int64))
    offs = torch.cumsum(counts[:num_experts], dim=0, dtype=torch.int32)

    x = hidden_states.to(up.dtype)
    up_owner = owners.get(up_name)
    if tangents is not None:
        h = _product_with_tangent(x[token_of_row], _matrices(module, up_name), offs,
                                  expert_sorted, tangents.get(up_name))
    elif up_owner is not None and up.requires_grad:
        up_owner._register()
        # one X P per token, shared by the token's experts (P is the same for all of them)
        xp = torch.matmul(x.detach(), up_owner.projection)
        h = SketchedExpertsFunction.apply(x[token_of_row], _matrices(module, up_name), offs,
                                          up_owner.projection, xp, token_of_row,
                                          up_owner._sketch_slot)
    else:
        h = SketchedExpertsFunction.apply(x[token_of_row], _matrices(module, up_name), offs,
                                          None, None, None, None)
    if module.has_bias:
        h = h + getattr(module, f"{up_name}_bias")[expert_sorted]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)

    down_owner = owners.get(down_name)
    sketched = down_owner is not None and down.requires_grad
    if tangents is not None:
        y = _product_with_tangent(h.to(down.dtype), _matrices(module, down_name), offs,
                                  expert_sorted, tangents.get(down_name))
    else:
        if sketched:
            down_owner._register()
        y = SketchedExpertsFunction.apply(
            h.to(down.dtype), _matrices(module, down_name), offs,
            down_owner.projection if sketched else None, None, None,
            down_owner._sketch_slot if sketched else None)
    if module.has_bias:
        y = y + getattr(module, f"{down_name}_bias")[expert_sorted]
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)

    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    out = y[inverse].view(hidden_states.shape[0], num_top_k, -1).sum(dim=1)
    return out.to(hidden_states.dtype)


def _product_with_tangent(x: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor,
                          expert_of_row: torch.Tensor, update) -> torch.Tensor:
    """``x[rows of e] W_e^T`` with its forward-mode tangent: ``x``'s and ``W``'s own tangents
    (either may be a dual tensor) carried through, plus, for ``update`` (a
    :class:`rgc.updates.LowRankUpdate` ``W_e <- W_e (1 - decay_e) - coef_e U_e P^T``, or
    ``None``), ``-(coef_e (X P) U_e^T + decay_e X W_e^T)`` per row: from ``X P`` (S x r) and
    ``U`` (E x d x r), with no d x k tensor.

    x: ``[S, k]`` sorted by expert (``offs``, ``expert_of_row`` ``[S]``); weights ``[E, d, k]``.
    Returns ``[S, d]`` in ``x``'s dtype, dual when it has a tangent.
    """
    x, x_tangent = fwAD.unpack_dual(x)
    weights, w_tangent = fwAD.unpack_dual(weights)
    out = grouped_mm(x, weights.transpose(1, 2), offs)
    parts = []
    if x_tangent is not None:
        parts.append(grouped_mm(x_tangent, weights.transpose(1, 2), offs))
    if w_tangent is not None:
        parts.append(grouped_mm(x, w_tangent.transpose(1, 2), offs))
    if update is not None:
        # rows past offs[-1] (a dropped slot) are left unwritten by grouped_mm: any expert id
        expert = expert_of_row.clamp(max=weights.shape[0] - 1)
        xp = x.to(torch.float32) @ update.layer.projection.to(torch.float32)
        own = grouped_mm(xp, update.factor.to(torch.float32).transpose(1, 2), offs)
        own.mul_(torch.as_tensor(update.coef, device=own.device)[expert].unsqueeze(-1))
        if not is_zero(update.decay):
            decay = torch.as_tensor(update.decay, device=own.device)[expert].unsqueeze(-1)
            own.add_(out.to(torch.float32) * decay)
        parts.append(own.neg_().to(out.dtype))
    if not parts:
        return out
    return fwAD.make_dual(out, functools.reduce(torch.add, parts))


def _matrices(module: nn.Module, name: str) -> torch.Tensor:
    """Expert weight ``name`` as ``[E, d, k]`` (a view)."""
    weight = getattr(module, name)
    return weight.transpose(1, 2) if module.is_transposed else weight
