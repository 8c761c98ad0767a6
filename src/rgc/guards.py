"""Misuse that would otherwise train nothing, or train wrongly, without a word.

Each check raises before any weight changes, with what to do instead:

* :func:`check_wrap_targets` (called by :func:`rgc.wrap`): a model that already carries peft
  adapters, and target weights shared with another module (tied embeddings).
* A global ``torch.optim`` step pre-hook (:func:`install_step_guard`, installed when the first
  :class:`rgc.CompressedLinear` is built) runs before every optimizer step in the process and
  refuses

  - a non-rgc optimizer (e.g. ``torch.optim.AdamW``, transformers' default) that holds a
    trainable compressed weight: such a weight has no ``.grad`` (its gradient is the sketch),
    so the optimizer would change nothing while the sketches pile up;
  - an rgc optimizer stepping a compressed weight whose dtype is not BF16/FP32 (e.g.
    ``model.to(torch.float16)`` after :func:`rgc.wrap`);
  - the first step of any optimizer while a wrapped model holds peft adapter layers around
    compressed layers (``get_peft_model(rgc.wrap(model))``): peft freezes the base weights, and the
    normalised rgc update never moves LoRA's zero-initialised ``B``.

The hook costs one dictionary lookup per parameter per step, and at an optimizer's first step
one pass over the modules of the live wrapped models.
"""

from __future__ import annotations

import functools
import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rgc.registry import SUPPORTED_WEIGHT_DTYPES, sketched_owner_of

_GUARD_HANDLE = None
_WRAPPED_ROOTS: weakref.WeakSet = weakref.WeakSet()
_PEFT_CHECKED: weakref.WeakSet = weakref.WeakSet()

PEFT_HINT = ("rgc trains the full weights from sketches and takes the place of adapters; the "
             "two do not combine. Use rgc.wrap on the plain model (no peft), or merge the "
             "adapters first (peft_model.merge_and_unload()) and then rgc.wrap the result")


@functools.cache
def _is_peft_layer_type(cls: type) -> bool:
    return any(c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft.")
               for c in cls.__mro__)


def is_peft_layer(module: nn.Module) -> bool:
    """True for a peft tuner layer (LoRA, IA3, ...), found by type without importing peft."""
    return _is_peft_layer_type(type(module))


def _is_peft_module(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def check_wrap_targets(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> None:
    """ValueError if ``model`` holds peft modules or a target weight is shared."""
    peft = next(((n, m) for n, m in model.named_modules() if _is_peft_module(m)), None)
    if peft is not None:
        raise ValueError(f"the model holds peft modules ({type(peft[1]).__name__} at "
                         f"{peft[0] or '<root>'!r}); {PEFT_HINT}")
    users: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name)
    for name, module in chosen:
        weight = getattr(module, "weight", None)
        others = [n for n in users.get(id(weight), []) if n != f"{name}.weight"]
        if others:
            raise ValueError(
                f"target {name!r} shares its weight with {others} (tied weights, e.g. lm_head "
                "tied to the input embeddings): the other use's dense gradient would be "
                f"silently ignored. Leave {name!r} out of targets, or untie the weights first "
                "(give the module its own copy: module.weight = nn.Parameter(w.detach().clone()),"
                " and set config.tie_word_embeddings = False)")


def register_wrapped(model: nn.Module) -> None:
    """Remember ``model`` (weakly) so the step guard can find peft layers added later."""
    _WRAPPED_ROOTS.add(model)
    install_step_guard()


def _holds_sketched_weight(module: nn.Module) -> bool:
    return any(sketched_owner_of(p) is not None for p in module.parameters(recurse=False))


def _peft_around_compressed() -> str | None:
    for root in list(_WRAPPED_ROOTS):
        for module in root.modules():
            if is_peft_layer(module) and any(_holds_sketched_weight(c)
                                             for c in module.children()):
                name = next(n for n, m in root.named_modules() if m is module)
                return f"{type(module).__name__} at {name!r}"
    return None


def _describe(owner) -> str:
    if owner.num_matrices == 1:
        return f"CompressedLinear ({owner.out_features} x {owner.in_features})"
    return (f"sketched expert stack ({owner.num_matrices} experts of {owner.out_features} x "
            f"{owner.in_features})")


def _step_guard(optimizer, args, kwargs) -> None:
    # rgc's optimizers say so with a class attribute: importing rgc.optim here would be a cycle
    is_rgc = getattr(optimizer, "updates_sketched_weights", False)
    for group in optimizer.param_groups:
        for p in group["params"]:
            layer = sketched_owner_of(p)
            if layer is None:
                continue
            if not is_rgc and p.requires_grad:
                raise RuntimeError(
                    f"{type(optimizer).__name__} is stepping the weight of a "
                    f"{_describe(layer)}; a compressed weight has no "
                    ".grad (its gradient is the sketch), so this optimizer would change nothing. "
                    "Use rgc.RGCOptimizer or rgc.RowAdam for the compressed weights (with "
                    "transformers/TRL: rgc.integrations.with_rgc(TrainerClass)(...), which "
                    "builds one), or rgc.unwrap(model) to train densely")
            if is_rgc and p.dtype not in SUPPORTED_WEIGHT_DTYPES:
                raise TypeError(
                    f"a compressed weight ({_describe(layer)}) has dtype "
                    f"{p.dtype}; rgc updates {SUPPORTED_WEIGHT_DTYPES} weights only (was the "
                    "model converted after rgc.wrap?). Convert it back, e.g. "
                    "model.to(torch.bfloat16), before optimizer.step()")
    # peft is applied before an optimizer is built on its parameters: scan at its first step
    if _WRAPPED_ROOTS and optimizer not in _PEFT_CHECKED:
        where = _peft_around_compressed()
        if where is not None:
            raise RuntimeError(f"a wrapped model holds a peft adapter layer ({where}) around a "
                               f"CompressedLinear; {PEFT_HINT}")
        _PEFT_CHECKED.add(optimizer)


def install_step_guard() -> None:
    """Install the global optimizer step pre-hook (once per process)."""
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        _GUARD_HANDLE = register_optimizer_step_pre_hook(_step_guard)
