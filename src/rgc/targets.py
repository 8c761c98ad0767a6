"""What :func:`rgc.wrap` trains: one target plan, read by ``wrap``, ``wrap_summary`` and
``estimate_memory`` alike.

A *target* is a weight rgc sketches: the ``weight`` of an ``nn.Linear``, or a 3-D expert weight
(``gate_up_proj`` / ``up_proj``, ``down_proj``) of a transformers Experts module. ``targets=``
picks them (:func:`selects`): ``None`` for :data:`DEFAULT_TARGETS`, matched on the last
component of a module's qualified name; a collection of names (last component or fully
qualified); or a predicate ``(qualified_name, module) -> bool``. An expert weight is matched by
its parameter's qualified name (``model.layers.0.mlp.experts.gate_up_proj``, last component
``gate_up_proj``) with the experts module as ``module``; an explicit name (or a predicate) that
picks the experts module itself picks all its expert weights.

:func:`plan_targets` turns ``targets`` into a :class:`TargetPlan`:

* ``linears``: the selected ``nn.Linear`` layers;
* ``experts``: the selected weights of Experts modules whose forward is the one of
  transformers' experts interface (``use_experts_implementation``), the forward rgc's sketched
  experts forward reproduces;
* ``skipped``: selected modules rgc cannot sketch, each with the reason: a module that is not
  an ``nn.Linear`` (a custom projection, transformers' GPT-2 ``Conv1D``, a norm), or an Experts
  class that overrides the interface's forward (Ergo's per-route rows and per-expert norm):
  swapping in rgc's forward would train a different model, so such experts stay frozen;
* ``routers``: the parameters of the routers of mixture-of-experts blocks (:func:`routers`).

The routers are found structurally wherever transformers' families keep them: a sibling of a
module holding expert weights that is named ``gate``, ``router`` or ``shared_expert_gate``,
whose class name ends in ``Router`` or ``Gate``, or that is (or directly holds) a linear layer
with one output per expert. All their parameters count, nested ones included (``router.gate``,
``gate.linear``, ``router.proj``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.nn as nn

from rgc.experts.module import expert_weight_names, is_sketched_experts

#: Default target names: the attention and MLP projections of Llama/Qwen/Mistral-style models
#: and their common aliases (GPT-2/nanoGPT, GPT-NeoX, Falcon, original Llama/Mistral code).
DEFAULT_TARGETS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "qkv_proj", "gate_up_proj", "out_proj",
    "c_attn", "c_proj", "c_fc",
    "query_key_value", "dense_h_to_4h", "dense_4h_to_h",
    "wq", "wk", "wv", "wo", "w1", "w2", "w3",
})

Targets = Iterable[str] | Callable[[str, nn.Module], bool] | None

#: Names of the router modules of transformers' mixture-of-experts blocks (the block holds them
#: next to its experts module).
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


def selects(targets: Targets, name: str, module: nn.Module) -> bool:
    """True if ``targets`` picks the module (or expert weight) of qualified ``name``."""
    if targets is None:
        return name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
    if callable(targets):
        return bool(targets(name, module))
    return name in targets or name.rsplit(".", 1)[-1] in targets


def check_targets(targets: Targets) -> None:
    """Raise ``TypeError`` unless ``targets`` is ``None``, a predicate or a collection of names."""
    if targets is None or callable(targets):
        return
    if isinstance(targets, str) or not isinstance(targets, Iterable) or not all(
            isinstance(t, str) for t in targets):
        raise TypeError("targets must be None, a collection of module names (e.g. "
                        "['q_proj', 'v_proj']) or a predicate (name, module) -> bool, got "
                        f"{targets!r}")


def interface_forward(module: nn.Module) -> bool:
    """True if ``module``'s class runs the forward of transformers' experts interface.

    ``use_experts_implementation`` replaces the decorated class's ``forward`` by a dispatcher
    to the implementation the config names; a subclass that defines its own ``forward`` (even
    one calling the dispatcher) computes something else around the experts.
    """
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith(
        "transformers/integrations/moe.py") and hasattr(type(module).forward, "__wrapped__")


def holds_experts(module: nn.Module) -> bool:
    """True for a module holding 3-D expert weights: a transformers Experts module, or any
    non-convolution module with a 3-D Parameter of its own (experts rgc may not sketch)."""
    if expert_weight_names(module) is not None:
        return True
    return not isinstance(module, nn.modules.conv._ConvNd) and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def _expert_count(module: nn.Module) -> set[int]:
    count = getattr(module, "num_experts", None)
    counts = {count} if isinstance(count, int) else set()
    return counts | {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}


def _scores_experts(module: nn.Module, counts: set[int]) -> bool:
    """``module`` is, or directly holds, a linear layer with one output per expert."""
    return any(isinstance(m, nn.Linear) and m.out_features in counts
               for m in (module, *module.children()))


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the routers of the model's mixture-of-experts blocks:
    the siblings of a module holding expert weights named in :data:`ROUTER_NAMES`, of a class
    ending in ``Router`` or ``Gate``, or scoring the experts (see the module doc)."""
    found = []
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        counts = set().union(*(_expert_count(c) for _, c in children if holds_experts(c)))
        if not counts:
            continue
        for name, child in children:
            if holds_experts(child):
                continue
            if (name in ROUTER_NAMES or type(child).__name__.endswith(("Router", "Gate"))
                    or _scores_experts(child, counts)):
                found.append((f"{parent_name}.{name}" if parent_name else name, child))
    return found


@dataclass(frozen=True)
class TargetPlan:
    """What ``targets`` picks in a model (see the module doc). Names are qualified."""

    linears: tuple[tuple[str, nn.Linear], ...]
    experts: tuple[tuple[str, nn.Module, tuple[str, ...]], ...]
    skipped: tuple[tuple[str, str], ...]
    routers: tuple[tuple[str, nn.Parameter], ...]

    def weight_names(self) -> set[str]:
        """The sketched weights by layer: linear layers by module name, expert weights by
        parameter name (``...experts.gate_up_proj``), as :class:`rgc.memory.LinearShape`
        names them."""
        return {n for n, _ in self.linears} | {f"{n}.{w}" for n, _, ws in self.experts
                                                for w in ws}

    def __bool__(self) -> bool:
        return bool(self.linears or self.experts)


def _not_linear_reason(module: nn.Module) -> str:
    kind = type(module).__name__
    if kind == "Conv1D":
        return ("a Conv1D, not an nn.Linear (transformers' GPT-2 Conv1D stores W transposed "
                "and is not supported)")
    return f"a {kind}, not an nn.Linear"


def plan_targets(model: nn.Module, targets: Targets = None) -> TargetPlan:
    """The :class:`TargetPlan` of ``targets`` in ``model`` (read only; the root module itself
    is never a target). Modules inside a router are targets only when named explicitly."""
    check_targets(targets)
    router_list = routers(model)
    inside_router = {id(m) for _, r in router_list for m in r.modules()}
    linears, experts, skipped = [], [], []
    for name, module in model.named_modules():
        if not name:
            continue
        weights = expert_weight_names(module)
        if weights is not None:
            picked = (list(weights) if targets is not None and selects(targets, name, module)
                      else [w for w in weights if selects(targets, f"{name}.{w}", module)])
            if picked and (is_sketched_experts(module) or interface_forward(module)):
                experts.append((name, module, tuple(picked)))
            elif picked:
                skipped.append((name, f"{type(module).__name__} overrides the forward of "
                                "transformers' experts interface, which rgc's sketched experts "
                                "forward reproduces: sketching it would train a different "
                                "model, so its expert weights stay frozen"))
            continue
        if targets is None and id(module) in inside_router:
            continue
        if not selects(targets, name, module):
            continue
        if isinstance(module, nn.Linear):
            linears.append((name, module))
        else:
            skipped.append((name, _not_linear_reason(module)))
    trained = {id(m.weight) for _, m in linears}
    router_params = [(f"{rname}.{pname}", p) for rname, r in router_list
                     for pname, p in r.named_parameters() if id(p) not in trained]
    return TargetPlan(tuple(linears), tuple(experts), tuple(skipped), tuple(router_params))


def skipped_message(skipped: Iterable[tuple[str, str]]) -> str:
    """The skipped targets, one line per reason, layer indices collapsed to ``*``."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped:
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        names = by_reason.setdefault(reason, [])
        if pattern not in names:
            names.append(pattern)
    return "; ".join(f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''} ({reason})"
                     for reason, names in by_reason.items())
