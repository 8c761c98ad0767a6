"""``CompressedLinear`` and the one-call ``wrap`` / ``unwrap`` of a model."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from rgc.autograd import SketchedLinearFunction, linear_in
from rgc.guards import check_wrap_targets, install_step_guard, register_wrapped
from rgc.projection import check_rank
from rgc.registry import SUPPORTED_WEIGHT_DTYPES, register_owner, sketched_owner_of
from rgc.seeding import derive_seed
from rgc.sketched import SketchedWeight, check_refresh

#: Default target names: the attention and MLP projections of Llama/Qwen/Mistral-style models
#: and their common aliases (GPT-2/nanoGPT, GPT-NeoX, Falcon, original Llama/Mistral code).
DEFAULT_TARGETS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "qkv_proj", "gate_up_proj", "out_proj",
    "c_attn", "c_proj", "c_fc",
    "query_key_value", "dense_h_to_4h", "dense_4h_to_h",
    "wq", "wk", "wv", "wo", "w1", "w2", "w3",
})


def compressed_layer_of(param: torch.Tensor) -> CompressedLinear | None:
    """The :class:`CompressedLinear` whose weight is ``param``, or ``None``."""
    owner = sketched_owner_of(param)
    return owner if isinstance(owner, CompressedLinear) else None


class CompressedLinear(SketchedWeight, nn.Linear):
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
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return SketchedLinearFunction.apply(x, self.weight, self.bias, self.projection,
                                                self._sketch_slot, self.compute_dtype)
        return linear_in(x, self.weight, self.bias, self.compute_dtype)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # Wrappers that swap the Parameter object itself (FSDP2's fully_shard installs a sharded
        # DTensor and swaps the gathered weight in and out around forward) must keep
        # compressed_layer_of(param) working for whatever Parameter the optimizer was given.
        if name == "weight" and isinstance(value, torch.Tensor):
            register_owner(value, self)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_sketch_slot", None)  # its hook points at this layer; a copy gets its own
        return state

    def __setstate__(self, state):
        state.setdefault("compute_dtype", None)
        super().__setstate__(state)
        self._register()
        self._new_sketch_slot()

    def _apply(self, fn, recurse=True):
        dtype = self.weight.dtype
        super()._apply(fn, recurse)
        # .to()/.cuda() may install new Parameter objects (overwrite-on-conversion mode) and
        # move the weight: keep the owner registry and the sketch slot's device in step.
        self._register()
        slot = getattr(self, "_sketch_slot", None)
        if slot is not None and slot.device != self.weight.device:
            self._new_sketch_slot()
        # P is a function of (seed, version, weight dtype). A cast such as model.to(float32)
        # would leave the old dtype's rounding in P, which a resumed run (regenerating P in the
        # new dtype) would not have: regenerate it so both use the same bits.
        if self.weight.dtype != dtype and self.projection.device.type != "meta":
            self.set_projection_version(self.projection_version)
        return self

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank={self.rank}, projection={self.projection_kind!r}, "
                f"refresh={self.refresh!r}")


Targets = Iterable[str] | Callable[[str, nn.Module], bool] | None


def _matches(targets, name: str, module: nn.Module) -> bool:
    if targets is None:
        return name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
    if callable(targets):
        return bool(targets(name, module))
    return name in targets or name.rsplit(".", 1)[-1] in targets


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def compressed_layers(model: nn.Module) -> list[tuple[str, CompressedLinear]]:
    """``(qualified name, layer)`` for every CompressedLinear in ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, CompressedLinear)]


#: ``wrap(..., preset=name)``: the projection kind and refresh schedule of each method.
PRESETS = {
    "rgc": {"projection": "orthonormal", "refresh": "every_step"},
    "logra": {"projection": "rademacher", "refresh": "never"},
}


def wrap(model: nn.Module, rank: int, *, targets: Targets = None,
         projection: str | None = None, refresh=None, seed: int = 0,
         freeze_others: bool = True, preset: str = "rgc") -> nn.Module:
    """Replace the target ``nn.Linear`` layers of ``model`` by CompressedLinear, in place.

    Args:
        model: any ``nn.Module``; it is modified in place and returned.
        rank: sketch rank ``r`` for every target.
        targets: ``None`` for :data:`DEFAULT_TARGETS` (matched on the last name component),
            a list of names (last component or fully qualified), or a predicate
            ``(qualified_name, module) -> bool``.
        projection: 'orthonormal', 'rademacher' or 'gaussian'; default from ``preset``.
        refresh: 'every_step' (new P after every update), 'never', or N (every N updates);
            default from ``preset``.
        seed: every layer's seed is derived from it and the layer's qualified name.
        freeze_others: set ``requires_grad=False`` on every parameter outside the targets.
            A target's bias keeps its ``requires_grad``; the target weights are made trainable.
        preset: 'rgc' (orthonormal P, refreshed every step) or 'logra' (Rademacher P, fixed);
            see :data:`PRESETS`. Explicit ``projection``/``refresh`` override it.

    All checks run before the model is touched. The weights are shared, not copied, and the
    wrapped model's ``state_dict()`` has the same keys as the original.
    """
    if compressed_layers(model):
        raise ValueError("the model is already wrapped; call rgc.unwrap(model) before wrapping "
                         "it again")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    projection = PRESETS[preset]["projection"] if projection is None else projection
    refresh = PRESETS[preset]["refresh"] if refresh is None else refresh
    check_refresh(refresh)
    linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                           if isinstance(m, nn.Linear)})
    chosen = [(n, m) for n, m in model.named_modules() if n and _matches(targets, n, m)]
    if not chosen:
        shown = DEFAULT_TARGETS if targets is None else targets
        if not callable(shown):
            shown = sorted(shown)
        raise ValueError(f"targets {shown!r} matched no module; the model's nn.Linear layers "
                         f"are named {linear_names}")
    check_wrap_targets(model, chosen)
    for name, module in chosen:
        if not isinstance(module, nn.Linear):
            hint = (" (transformers' GPT-2 Conv1D stores W transposed and is not supported; "
                    "pass targets= to select nn.Linear layers only)"
                    if type(module).__name__ == "Conv1D" else "")
            raise TypeError(f"target {name!r} is a {type(module).__name__}, not an nn.Linear"
                            f"{hint}")
        if module.weight.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise TypeError(f"target {name!r} has weight dtype {module.weight.dtype}; supported: "
                            f"{SUPPORTED_WEIGHT_DTYPES}. Convert the model first.")
        check_rank(projection, module.in_features, rank)

    bias_trainable = {name: m.bias is not None and m.bias.requires_grad for name, m in chosen}
    if freeze_others:
        for p in model.parameters():
            p.requires_grad_(False)
    for name, module in chosen:
        if module.bias is not None:
            module.bias.requires_grad_(bias_trainable[name])
        module.weight.requires_grad_(True)
        layer = CompressedLinear.from_linear(module, rank, projection=projection,
                                             refresh=refresh, seed=derive_seed(seed, name))
        _set_submodule(model, name, layer)
    register_wrapped(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Replace every CompressedLinear by a plain ``nn.Linear`` sharing its trained weight.

    Pending sketches are dropped; ``requires_grad`` flags are left as they are.
    Returns ``model`` (modified in place).
    """
    for name, layer in compressed_layers(model):
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           device="meta")
        linear.weight = layer.weight
        linear.bias = layer.bias
        layer.sketch = None
        _set_submodule(model, name, linear)
    return model
