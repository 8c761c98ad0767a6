"""What a wrapped model trains and what it leaves: :func:`wrap_summary` and the coverage warning.

Every parameter is counted once, under a *kind* and a *status*:

* kinds: ``sketched linear`` (a :class:`rgc.CompressedLinear` weight), ``sketched experts`` (a
  3-D expert weight with an :class:`rgc.experts.ExpertWeight` owner), ``linear`` (another
  ``nn.Linear`` weight), ``experts`` (another 3-D parameter: experts rgc does not sketch),
  ``embedding`` (input embeddings and the output head), ``router`` (the routers of
  mixture-of-experts blocks, as :func:`rgc.targets.routers` finds them), ``bias``, ``norm``,
  ``other``;
* status: ``sketched`` (trained from sketches), ``dense`` (trainable, with an ordinary
  gradient: the optimizer's dense rule), ``frozen``.

:func:`rgc.wrap` with its default targets warns (``UserWarning``) when the frozen matrices of
the kinds ``linear``, ``experts`` and ``other`` (everything but embeddings, output head, routers,
norms and biases, which the default leaves frozen by design) hold more than
:data:`COVERAGE_WARN_SHARE` of the model's parameters, naming them and the ``targets=`` that
would cover them.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch.nn as nn

from rgc.registry import sketched_owner_of
from rgc.targets import holds_experts, routers

#: Share of a model's parameters left frozen in uncovered matrices above which wrap() warns.
COVERAGE_WARN_SHARE = 0.01

_GAP_KINDS = ("linear", "experts", "other")


@dataclass(frozen=True)
class SummaryRow:
    """``params`` elements in ``tensors`` parameters of one (kind, status, matrix); ``names``:
    where, with layer indices collapsed to ``*``; ``matrix``: the parameters are 2-D or more."""

    kind: str
    status: str
    params: int
    tensors: int
    names: tuple[str, ...]
    matrix: bool = True


@dataclass(frozen=True)
class WrapSummary:
    """Parameter counts of a model by kind and status (see the module doc)."""

    rows: tuple[SummaryRow, ...]
    total: int

    def count(self, *, kind: str | None = None, status: str | None = None) -> int:
        """Elements of the parameters of ``kind`` and/or ``status`` (``None``: any)."""
        return sum(r.params for r in self.rows if kind in (None, r.kind)
                   and status in (None, r.status))

    @property
    def trained(self) -> int:
        return self.total - self.count(status="frozen")

    @property
    def frozen(self) -> int:
        return self.count(status="frozen")

    def gap(self) -> list[SummaryRow]:
        """The frozen matrices (2-D and up) of the kinds the default targets are meant to cover
        (``linear``, ``experts``, ``other``)."""
        return [r for r in self.rows if r.status == "frozen" and r.kind in _GAP_KINDS
                and r.matrix]

    def __str__(self) -> str:
        lines = [f"{self.total:,} parameters: {self.trained:,} trained "
                 f"({_pct(self.trained, self.total)}), {self.frozen:,} frozen",
                 "", "| kind | status | parameters | share | tensors | where |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows:
            where = ", ".join(r.names[:4]) + (", ..." if len(r.names) > 4 else "")
            kind = r.kind if r.matrix or r.kind not in _GAP_KINDS else f"{r.kind} (vectors)"
            lines.append(f"| {kind} | {r.status} | {r.params:,} | "
                         f"{_pct(r.params, self.total)} | {r.tensors} | {where} |")
        return "\n".join(lines)


def _pct(part: int, total: int) -> str:
    return f"{100 * part / total:.1f}%" if total else "-"


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _embeddings(model: nn.Module) -> set[int]:
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else getattr(model, "lm_head", None)
    if isinstance(getattr(head, "weight", None), nn.Parameter):
        ids.add(id(head.weight))
    return ids


def _kind(name: str, p, owner, module: nn.Module, router_params: set[int],
          embeddings: set[int]) -> str:
    if owner is not None:
        return "sketched experts" if p.dim() == 3 else "sketched linear"
    if id(p) in embeddings:
        return "embedding"
    if id(p) in router_params:
        return "router"
    if p.dim() == 3 and holds_experts(module):
        return "experts"
    if isinstance(module, nn.Linear) and name.endswith(".weight"):
        return "linear"
    if name.rsplit(".", 1)[-1].endswith("bias"):
        return "bias"
    if "norm" in type(module).__name__.lower():
        return "norm"
    return "other"


def wrap_summary(model: nn.Module) -> WrapSummary:
    """Trained and frozen parameter counts of ``model`` by kind, as it is now (wrapped or not).

    ``print(rgc.wrap_summary(model))`` gives a table; ``.count(kind=..., status=...)``,
    ``.trained``, ``.frozen`` and ``.gap()`` the figures.
    """
    router_params = {id(p) for _, router in routers(model) for p in router.parameters()}
    embeddings = _embeddings(model)
    groups: dict[tuple[str, str], list] = {}
    seen: set[int] = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}" if mname else pname
            owner = sketched_owner_of(p)
            kind = _kind(name, p, owner, module, router_params, embeddings)
            status = ("sketched" if owner is not None and p.requires_grad
                      else "dense" if p.requires_grad else "frozen")
            groups.setdefault((kind, status, p.dim() >= 2), []).append((name, p.numel()))
    rows = []
    for (kind, status, matrix), items in groups.items():
        names = tuple(dict.fromkeys(_pattern(n) for n, _ in items))
        rows.append(SummaryRow(kind, status, sum(v for _, v in items), len(items), names,
                               matrix))
    rows.sort(key=lambda r: -r.params)
    return WrapSummary(tuple(rows), sum(r.params for r in rows))


def warn_coverage_gap(model: nn.Module, summary: WrapSummary | None = None) -> None:
    """Warn if the frozen uncovered matrices exceed :data:`COVERAGE_WARN_SHARE` of the model."""
    summary = summary or wrap_summary(model)
    gap = summary.gap()
    frozen = sum(r.params for r in gap)
    if not summary.total or frozen <= COVERAGE_WARN_SHARE * summary.total:
        return
    linears = sorted({n.rsplit(".", 2)[-2] for r in gap if r.kind == "linear" for n in r.names})
    details = "; ".join(f"{r.kind} {', '.join(r.names[:6])}{', ...' if len(r.names) > 6 else ''}"
                        f" ({_pct(r.params, summary.total)})" for r in gap)
    hint = []
    if linears:
        names = "{" + ", ".join(repr(n) for n in linears) + "}"
        hint.append(f"pass targets=set(rgc.DEFAULT_TARGETS) | {names} to train these linear "
                    "layers too")
    if any(r.kind == "experts" for r in gap):
        hint.append("the 3-D expert weights listed belong to experts modules without "
                    "transformers' experts interface (use_experts_implementation), or whose "
                    "class overrides its forward, which rgc does not sketch")
    if any(r.kind == "other" for r in gap):
        hint.append("the 'other' matrices are not nn.Linear layers and stay frozen")
    warnings.warn(
        f"rgc.wrap leaves {_pct(frozen, summary.total)} of the model's parameters frozen in "
        f"matrices its default targets do not cover: {details}. " + "; ".join(hint)
        + ". rgc.wrap_summary(model) shows what is trained.", UserWarning, stacklevel=3)
