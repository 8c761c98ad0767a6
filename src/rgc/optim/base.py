"""What every rgc optimizer shares: gather, measure, propose, scale, apply, refresh, record.

A step of a :class:`SketchOptimizer` measures, for every parameter with a sketch or gradient,
the sums its rule needs (:class:`Partials`: finiteness, norms), then proposes an update
in factored form (:class:`LowRankUpdate` or :class:`DenseUpdate`) from them, optionally lets a
step controller scale all proposals by one ``alpha`` (see :class:`rgc.PredictedKL`), applies
them, then clears sketches and, after the last update, refreshes projections. The same apply
functions serve a sync receiver (:func:`rgc.apply_update`), which is why its weights match the
trainer's bit for bit.

Measuring and proposing are two phases so that a distributed optimizer
(:mod:`rgc.distributed`) can sum the partial sums of row shards over its ranks, all
parameters in one collective, in between; on one process nothing happens there.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from rgc import ops
from rgc.payload import KeptUpdate, build_payload, fingerprint_tensor
from rgc.projection import advance_projections
from rgc.registry import sketched_owner_of
from rgc.seeding import derive_seed
from rgc.updates import DenseUpdate, LowRankUpdate, StackUpdate, resolve_chunk_rows, to_host

__all__ = ["DenseUpdate", "Entry", "LowRankUpdate", "Partials", "SketchOptimizer",
           "StackUpdate", "check_common_args", "rounding_seed"]


@dataclass
class Entry:
    """One parameter's share of a step: the Parameter, its owner (``None`` for a dense
    gradient), its param group and state, and the rounding seed of this update.

    ``offset`` is the flat index of the first element the entry holds in the whole parameter
    (0; a distributed optimizer's row shard starts at ``first_row * row length``), so that its
    elements get the rounding bits they have in the whole parameter.
    """
    param: torch.Tensor
    owner: object
    group: dict
    state: dict
    seed: int
    offset: int = 0


@dataclass
class Partials:
    """The statistics a rule forms its coefficients from, over a weight's elements.

    ``finite`` is ``[M, E]`` bool (M parameters of E matrices each; a dense parameter is one
    ``1 x 1``): no non-finite value in the matrix's sketch or gradient. ``sums`` maps a name
    to an ``[M, E]`` FP32 tensor of what the rule needs, e.g. ``sketch`` (``||C P^T||^2``)
    and ``weight`` (``||W||^2``). On one process they cover the whole weight. A distributed
    optimizer whose ranks hold rows of a weight combines them over those ranks (one
    collective for all parameters of a step) before the proposal reads them: ``finite`` as
    the number of ranks that saw a non-finite value, every entry of ``sums`` summed, so each
    must be additive over rows.
    """
    finite: torch.Tensor
    sums: dict[str, torch.Tensor]

    @classmethod
    def of(cls, finite: torch.Tensor, **sums: torch.Tensor) -> Partials:
        return cls(finite, sums)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums[name]


def _refresh_due(refresh, step: int) -> bool:
    return refresh == "every_step" or (isinstance(refresh, int) and step % refresh == 0)


def rounding_seed(seed: int, param_index: int, step: int) -> int:
    """Seed of the stochastic-rounding bits for one parameter's update at ``step``."""
    return derive_seed(seed, "round", param_index, step)


def check_lr(lr) -> None:
    """ValueError unless ``lr`` is a finite number >= 0 or a 1-element real tensor holding one.

    A tensor ``lr`` (e.g. one a scheduler fills in place) enters the step's coefficients as a
    tensor: it is read here once, never on the host during ``step()``.
    """
    value = lr
    if torch.is_tensor(lr):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"Tensor lr must be 1-element and real floating point, got shape "
                             f"{tuple(lr.shape)} of {lr.dtype}; pass a 0-dim tensor or a float")
        value = float(lr)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"lr must be a finite number >= 0 (or a 0-dim tensor holding one), "
                         f"got {lr!r}")


def group_lr(group: dict, device: torch.device) -> float | torch.Tensor:
    """``group['lr']`` for a step's coefficients: a float as it is, a tensor as a 0-dim FP32
    tensor on ``device`` (copied there, never read on the host), so both give the same bits."""
    lr = group["lr"]
    if torch.is_tensor(lr):
        return lr.detach().reshape(()).to(device=device, dtype=torch.float32)
    return lr


def check_common_args(lr, chunk_rows, seed) -> None:
    """ValueError for a bad ``lr``, ``chunk_rows`` (None or an int >= 1) or ``seed``."""
    check_lr(lr)
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an integer >= 1, got {chunk_rows!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


#: Per-parameter state entries that are Python ints. rgc's first state format stored them as
#: int64 0-dim tensors; ``load_state_dict`` converts those, so old checkpoints resume exactly.
INT_STATE_KEYS = ("step", "skipped", "layer_seed", "projection_version")

#: Attributes an optimizer pickled before they existed gets on unpickling.
_ATTRIBUTE_DEFAULTS = {"step_control": None, "keep_updates": False, "steps_taken": 0,
                       "last_updates": None, "_warned_nonfinite": False,
                       "sketch_norm_read": False}

#: Packages whose training loops clip and log the norm of ``.grad`` (0 for a sketched weight).
_GRAD_NORM_LOOPS = ("transformers.", "accelerate.", "trl.")


def _called_from_grad_norm_loop() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_GRAD_NORM_LOOPS):
            return True
        frame = frame.f_back
    return False


class SketchOptimizer(Optimizer):
    """Base of the rgc optimizers. Subclasses implement ``_stack_partials`` and
    ``_propose_stack`` (sketched weights, grouped by shape), may extend ``_dense_partials``,
    implement ``_propose_dense`` (return an update or ``None`` for "no change"), and may
    override ``_refresh_projections`` to carry state into a new projection.

    ``step()`` reads nothing on the host unless a step controller is set: the finiteness test
    of each sketch or gradient is a bool tensor handed to the proposal (``Partials.finite``),
    whose coefficients are 0 on the device where it is false (the weight then stays
    bit-identical), and ``state[p]['skipped']`` is a 0-dim int64 counter on the parameter's
    device. Read the
    counters with :meth:`skipped_updates` (or ``state_dict()``, which stores them as ints).
    With a controller, the active flags of all proposals are read once per step.

    Args (beyond torch.optim's ``params`` and ``defaults``):
        step_control: ``None`` or a controller with ``scale(optimizer, updates) -> float``,
            ``after_update()`` and optionally ``check_ready()`` (e.g. :class:`rgc.PredictedKL`):
            all proposals of a step are gathered, scaled by the returned ``alpha`` and then
            applied.
        keep_updates: keep the applied updates of the last step (one d x r FP32 copy per
            compressed weight) so that :meth:`export_update` can build a sync payload.

    Every param group has ``maximize`` (default False): subclasses negate their proposals
    for it. Where this contract differs from torch.optim is listed in ``docs/design.md``
    ("Where rgc differs from torch.optim"): among others, no trainable parameter only warns,
    complex parameters are refused, arithmetic is FP32 whatever the parameter dtype, state
    tensors keep their dtype on load, and ``copy.deepcopy``/``pickle`` keep the step control,
    kept updates and counters.
    """

    #: read by the global step guard (:mod:`rgc.guards`): this optimizer steps sketched weights
    updates_sketched_weights = True

    def __init__(self, params, defaults: dict, *, step_control=None, keep_updates: bool = False):
        super().__init__(params, {"maximize": False, **defaults})
        if not any(p.requires_grad for g in self.param_groups for p in g["params"]):
            warnings.warn(
                f"{type(self).__name__} was given no trainable parameter (requires_grad=True): "
                "step() will change nothing. Wrap the model with rgc.wrap() and pass "
                "model.parameters() (or the trainable ones)", UserWarning, stacklevel=3)
        if step_control is not None and not (hasattr(step_control, "scale")
                                             and hasattr(step_control, "after_update")):
            raise TypeError("step_control must provide scale(optimizer, updates) and "
                            f"after_update(), e.g. rgc.PredictedKL; got {step_control!r}")
        self.step_control = step_control
        self.keep_updates = bool(keep_updates)
        self.steps_taken = 0
        # the applied updates of the last step, with the fingerprints before them
        self.last_updates: list[KeptUpdate] | None = None
        self._warned_nonfinite = False
        # set by rgc.integrations.grad_norm / clip_grad_norm_ (the norms of the sketches)
        self.sketch_norm_read = False
        # p -> p._version when state[p]['weight_sq_norm'] was last made from p's stored values
        self._norm_versions: dict[torch.Tensor, int] = {}

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim, then :meth:`_check_group` on the new group (removed again if bad).

        Complex parameters are refused: the updates work on real numbers (take
        ``torch.view_as_real`` of the parameter and train that, or use a torch.optim optimizer).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            complex_params = [tuple(p.shape) for p in group["params"] if p.is_complex()]
            if complex_params:
                raise TypeError(
                    f"{type(self).__name__} does not support complex parameters (got shapes "
                    f"{complex_params}): its norms, moments and rounding act on real values. "
                    "Optimise torch.view_as_real(param) instead, or use a torch.optim optimizer")
            self._check_group(group)
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict) -> None:
        """Raise for a bad hyperparameter of one param group (subclasses extend it)."""
        check_common_args(group["lr"], group["chunk_rows"], group["seed"])
        if not isinstance(group["maximize"], bool):
            raise ValueError(f"maximize must be True or False, got {group['maximize']!r}")

    # -- copy and pickle: keep what a step needs ----------------------------------------
    def __getstate__(self) -> dict:
        # torch.optim keeps only defaults, state and param groups; an rgc optimizer also needs
        # its step control, kept updates and counters. Hooks are dropped, as torch does.
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items()
                      if k not in state and not k.startswith("_optimizer_")})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for name, value in _ATTRIBUTE_DEFAULTS.items():
            self.__dict__.setdefault(name, value)
        self.__dict__.setdefault("_norm_versions", {})
        for group in self.param_groups:  # groups saved before maximize existed
            group.setdefault("maximize", False)
        self.defaults.setdefault("maximize", False)

    @contextlib.contextmanager
    def _hooks_held(self, *names: str):
        """Run the body with the named hook tables empty; yields the held tables."""
        held = {name: getattr(self, name) for name in names}
        try:
            for name in names:
                setattr(self, name, OrderedDict())
            yield held
        finally:
            for name, hooks in held.items():
                setattr(self, name, hooks)

    # -- subclass interface -------------------------------------------------------------
    def _stack_partials(self, entries: list[Entry], group: dict) -> Partials:
        """The sums the rule needs of sketched weights of one shape and param group
        (``[M, E]`` each, over the rows each entry holds; see :class:`Partials`)."""
        raise NotImplementedError

    def _propose_stack(self, entries: list[Entry], group: dict,
                       partials: Partials) -> StackUpdate:
        """The updates of sketched weights of one shape and param group, in one record.

        ``partials`` are :meth:`_stack_partials`' sums over the whole weights (the skips of
        non-finite sketches are already counted); the proposal must give coefficients 0 (and
        ``active`` false) to a matrix whose sketch is not finite.
        """
        raise NotImplementedError

    def _dense_partials(self, entry: Entry) -> Partials:
        """The sums the rule needs of a parameter with a dense ``.grad`` (``1 x 1`` each):
        here whether the gradient is finite; subclasses add their sums."""
        return Partials.of(torch.isfinite(entry.param.grad).all().reshape(1, 1))

    def _propose_dense(self, p, group, state, seed, ok,
                       partials: Partials) -> DenseUpdate | None:
        """The update of a parameter with a dense ``.grad``; ``ok`` (0-dim bool) is false for a
        non-finite gradient, and the coefficients must then be 0 (and ``active`` false);
        ``partials``: :meth:`_dense_partials`' sums over the whole parameter."""
        raise NotImplementedError

    def _sum_partials(self, measured: list[tuple[list[Entry], Partials]]) -> None:
        """Complete every entry's partial sums in place (one process: they are complete).
        A distributed optimizer sums its row shards' over the ranks here."""

    def _refresh_projections(self, entries: list[Entry]) -> None:
        """Give every entry's owner its next ``P`` (the caller then renews the sketch slots).

        One batched regeneration per (kind, k, r, dtype, device): see
        :func:`rgc.projection.advance_projections`. Subclasses carry state into the new basis.
        """
        advance_projections([e.owner for e in entries])

    # -- shared machinery ---------------------------------------------------------------
    @staticmethod
    def _stack_update(entries: list[Entry], group: dict, factors, coefs, decays, active, *,
                      sq_norms=None) -> StackUpdate:
        """The :class:`StackUpdate` of ``entries`` with the given ``[M, E]`` coefficients."""
        return StackUpdate([e.param for e in entries], [e.owner for e in entries], factors,
                           coefs, decays, [e.seed for e in entries],
                           resolve_chunk_rows(group["chunk_rows"],
                                              entries[0].owner.weight_matrices().shape[2]),
                           group["stochastic_rounding"], active, sq_norms,
                           offsets=[e.offset for e in entries], extra={"entries": entries})

    def _init_state(self, p: torch.Tensor, layer) -> dict:
        # Seeds and step counts are Python ints, not tensors: Optimizer.load_state_dict casts
        # tensor state to the parameter's dtype, which would corrupt 63-bit seeds stored in a
        # BF16 parameter's state. 'skipped' is a device counter (stored as an int by
        # state_dict()); a Python int from a loaded state dict becomes one here.
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["skipped"] = 0
            if layer is not None:
                state["layer_seed"] = layer.seed
                state["projection_version"] = layer.projection_version
        if not torch.is_tensor(state["skipped"]):
            state["skipped"] = torch.tensor(int(state["skipped"]), dtype=torch.int64,
                                            device=p.device)
        return state

    @staticmethod
    def _count_skips(entries: list[Entry], finite: torch.Tensor) -> None:
        """Add one skip to each entry whose ``finite`` row (``[M, E]`` bool) is not all true
        (one grouped add for all entries)."""
        bad = (~finite.all(dim=1)).to(torch.int64)
        torch._foreach_add_([e.state["skipped"] for e in entries], list(bad.unbind(0)))

    def skipped_updates(self) -> int:
        """Updates skipped so far for a non-finite sketch or gradient, over all parameters.

        Reads the device counters (one copy per device); ``int(state[p]['skipped'])`` gives
        one parameter's count. Warns once when the count is first seen non-zero.
        """
        counts = to_host([s["skipped"] for s in self.state.values()
                          if isinstance(s, dict) and "skipped" in s])
        total = sum(int(c) for c in counts)
        self._warn_skipped(total)
        return total

    def _warn_skipped(self, total: int) -> None:
        if total and not self._warned_nonfinite:
            warnings.warn(f"non-finite sketch or gradient: {total} update(s) were skipped and "
                          "their weights left unchanged (counted in state[p]['skipped']); this "
                          "warning is shown once", RuntimeWarning, stacklevel=3)
            self._warned_nonfinite = True

    def _weight_sq_norms(self, entries: list[Entry], chunk_rows: int | None) -> torch.Tensor:
        """``||W_e||_F^2`` of every matrix of the entries, ``[M, E]`` FP32.

        The previous update of a weight left ``state['weight_sq_norm']`` from the values it
        stored; it is used while the weight has not been written since (its version counter
        is unchanged since that update or since ``load_state_dict``). The others are
        recomputed from W, in one :func:`rgc.ops.sum_squares` call.
        """
        rows: list[torch.Tensor | None] = []
        stale = []
        for e in entries:
            cached = e.state.get("weight_sq_norm")
            if cached is None or self._norm_versions.get(e.param) != e.param._version:
                stale.append(len(rows))
                rows.append(None)
            else:
                rows.append(cached.reshape(-1))
        if stale:
            weights = [entries[i].owner.weight_matrices() for i in stale]
            fresh = ops.sum_squares(weights, resolve_chunk_rows(chunk_rows, weights[0].shape[2]))
            for j, i in enumerate(stale):
                rows[i] = fresh[j]
        return torch.stack(rows)

    def _record_sq_norms(self, update: StackUpdate, entries: list[Entry]) -> None:
        """Keep each weight's ``||W_new||^2`` (views of the update's ``sq_norms``)."""
        for m, e in enumerate(entries):
            self._record_sq_norm(e, update.sq_norms[m])

    def _record_sq_norm(self, entry: Entry, norm: torch.Tensor) -> None:
        entry.state["weight_sq_norm"] = norm[0] if entry.param.dim() == 2 else norm
        self._norm_versions[entry.param] = entry.param._version

    # -- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a sketch or a gradient. Returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        control = self.step_control
        if control is not None and hasattr(control, "check_ready"):
            control.check_ready()  # raise before any state or weight changes
        records = [] if self.keep_updates else None
        work = self._gather()
        if self.steps_taken == 0 and work[0]:
            self._warn_unread_norm()
        self._step_entries(work, control, records)
        self.steps_taken += 1
        self.last_updates = records
        return loss

    def _warn_unread_norm(self) -> None:
        """Once, at the first step with sketches, when a transformers / accelerate / TRL loop
        drives this optimizer without reading the sketches' norm: its ``clip_grad_norm_`` of
        ``model.parameters()`` sees no gradient on a sketched weight, so it logs
        ``grad_norm = 0.0`` and clips nothing."""
        if not self.sketch_norm_read and _called_from_grad_norm_loop():
            warnings.warn(
                f"{type(self).__name__} is driven by a transformers/accelerate training loop "
                "whose gradient clipping reads .grad, which sketched weights do not have: it "
                "logs grad_norm = 0.0 and clips nothing. Build the trainer with "
                "rgc.integrations.with_rgc(TrainerClass)(...), or clip with "
                "rgc.integrations.clip_grad_norm_(optimizer, max_norm)", UserWarning,
                stacklevel=3)

    def _gather(self) -> tuple[dict, list[Entry]]:
        """The step's work: sketched entries grouped by (param group, shape, dtypes, device),
        and the entries with a dense gradient. Counts each parameter's step."""
        stacks: dict[tuple, list[Entry]] = {}
        dense: list[Entry] = []
        index = 0
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                owner = sketched_owner_of(p)
                if owner is not None and owner.sketch is not None:
                    entry = self._entry(p, owner, group, index - 1)
                    o = entry.owner  # the entry's view: all of the weight, or its rows here
                    key = (g, o.num_matrices, o.out_features, o.in_features, o.rank,
                           entry.param.dtype, o.projection.dtype, entry.param.device)
                    stacks.setdefault(key, []).append(entry)
                elif p.grad is not None:
                    dense.append(self._entry(p, None, group, index - 1))
        return stacks, dense

    def _entry(self, p, owner, group: dict, index: int) -> Entry:
        state = self._init_state(p, owner)
        state["step"] += 1
        return Entry(p, owner, group, state, rounding_seed(group["seed"], index, state["step"]))

    def _step_entries(self, work: tuple[dict, list[Entry]], control, records) -> None:
        """Measure, propose, scale, apply and finish the gathered work (refreshes after every
        update)."""
        stacks, dense = work
        groups = list(stacks.values())
        measured = [(entries, self._stack_partials(entries, entries[0].group))
                    for entries in groups]
        measured += [([e], self._dense_partials(e)) for e in dense]
        self._sum_partials(measured)
        updates: list = []
        for entries, partials in measured[:len(groups)]:
            self._count_skips(entries, partials.finite)
            updates.append(self._propose_stack(entries, entries[0].group, partials))
        if dense:
            finite = torch.cat([partials.finite for _, partials in measured[len(groups):]])
            self._count_skips(dense, finite)
        for e, (_, partials) in zip(dense, measured[len(groups):], strict=True):
            u = self._propose_dense(e.param, e.group, e.state, e.seed,
                                    partials.finite.reshape(()), partials)
            if u is not None:
                u.offset = e.offset
                updates.append(u)
        alpha, any_active = 1.0, False
        if control is not None:
            alpha, any_active = self._control(control, updates)
        for update in updates:
            update.scale(alpha)
            kept = self._kept(update) if records is not None else None
            update.apply()
            if isinstance(update, StackUpdate) and update.sq_norms is not None:
                self._record_sq_norms(update, update.extra["entries"])
            if kept is not None:
                records.extend(kept)
        self._finish(list(stacks.values()))
        if any_active:
            control.after_update()

    def _control(self, control, updates: list) -> tuple[float, bool]:
        """The step controller's ``alpha`` from the active updates (one host read of the
        active flags of all of them); ``(1.0, False)`` when none is active."""
        members = [m for u in updates for m in (u.members() if isinstance(u, StackUpdate)
                                                else [u])]
        flags = [m.active if not torch.is_tensor(m.active) or m.active.dim() == 0
                 else m.active.any() for m in members]
        active = [m for m, a in zip(members, to_host(flags), strict=True) if a]
        if not active:
            return 1.0, False
        return float(control.scale(self, self._whole_updates(active))), True

    def _whole_updates(self, updates: list) -> list:
        """The updates as a step controller sees them: of whole parameters of the model (a
        distributed optimizer gathers the factors of its row shards here)."""
        return updates

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the processes that train this model together (a step
        controller's probe statistics); on one process, ``values`` itself."""
        return values

    @staticmethod
    def _kept(update) -> list[KeptUpdate]:
        """A :class:`~rgc.payload.KeptUpdate` per parameter of ``update``, with the factors
        copied (the sketches are cleared after the step)."""
        kept = []
        for m in (update.members() if isinstance(update, StackUpdate) else [update]):
            if isinstance(m, LowRankUpdate):
                m.factor = m.factor.clone()
                kept.append(KeptUpdate(m, fingerprint_tensor(m.param), m.layer.projection_seed))
            else:
                kept.append(KeptUpdate(m, fingerprint_tensor(m.param), None))
        return kept

    def _finish(self, stacks: list[list[Entry]]) -> None:
        """Clear the sketches (one grouped zeroing), then refresh the projections that are due
        (batched per kind and shape) and renew their sketch slots."""
        entries = [e for group in stacks for e in group]
        sketches = [e.owner.sketch for e in entries if e.owner.sketch is not None]
        if sketches:
            torch._foreach_zero_(sketches)
        due = [e for e in entries if _refresh_due(e.owner.refresh, e.state["step"])]
        try:
            if due:
                self._refresh_projections(due)
        finally:
            for e in due:
                e.owner._new_sketch_slot()
            for e in entries:
                e.state["projection_version"] = e.owner.projection_version

    def export_update(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The last step's updates as a sync payload (see :func:`rgc.payload.build_payload`).

        ``model`` names the parameters (``model.named_parameters()``). Needs
        ``keep_updates=True`` and a completed ``step()``.
        """
        if not self.keep_updates:
            raise RuntimeError(f"export_update() needs {type(self).__name__}(..., "
                               "keep_updates=True): the factors of a step are not kept otherwise")
        if self.last_updates is None:
            raise RuntimeError("export_update() called before the first step()")
        return build_payload(model, self._payload_records(), self.steps_taken)

    def _payload_records(self) -> list[KeptUpdate]:
        """The kept updates as :func:`rgc.payload.build_payload` takes them (of whole
        parameters: a distributed optimizer gathers its row shards' here)."""
        return self.last_updates

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and the sketches of compressed weights."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                layer = sketched_owner_of(p)
                if layer is not None:
                    layer.zero_sketch(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """torch.optim's state dict, with the device counters ``skipped`` read as ints (one
        copy per device) and ``rgc_steps_taken``; post hooks see the final dict.
        ``weight_sq_norm`` (RGCOptimizer's cached ``||W||^2``) is kept as the FP32 tensor it is,
        so a resumed run uses the same bits."""
        with self._hooks_held("_optimizer_state_dict_post_hooks") as held:
            sd = super().state_dict()
        # entries a hook added under other keys may be anything (torch.optim keeps them as is)
        entries = [(k, v) for k, v in sd["state"].items()
                   if isinstance(v, dict) and "skipped" in v]
        counts = to_host([v["skipped"] for _, v in entries])
        self._warn_skipped(sum(int(c) for c in counts))
        state = dict(sd["state"])
        for (key, value), count in zip(entries, counts, strict=True):
            state[key] = {**value, "skipped": int(count)}
        sd["state"] = state
        sd["rgc_steps_taken"] = self.steps_taken
        # torch.distributed.checkpoint keeps only "state" and "param_groups": the count rides
        # in every group too (copies: the optimizer's own groups do not get the key)
        sd["param_groups"] = [{**g, "rgc_steps_taken": self.steps_taken}
                              for g in sd["param_groups"]]
        for hook in held["_optimizer_state_dict_post_hooks"].values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state and put every compressed layer back on its saved projection.

        torch.optim casts tensor state to the parameter's dtype; here every state tensor keeps
        its saved dtype (the FP32 moments of a BF16 weight stay FP32), and the counters of
        :data:`INT_STATE_KEYS` become Python ints whatever format wrote them, so resume is
        bit-identical. Load pre hooks run first and what they return is what is loaded; load
        post hooks run last, when projections and state are restored.
        """
        pre, post = "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"
        with self._hooks_held(pre, post) as held:
            state_dict = dict(state_dict)
            for hook in held[pre].values():
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
            state_dict = dict(state_dict)
            groups = [dict(g) for g in state_dict["param_groups"]]
            in_groups = [g.pop("rgc_steps_taken", None) for g in groups]
            state_dict["param_groups"] = groups
            steps_taken = int(state_dict.pop("rgc_steps_taken", in_groups[0] if in_groups
                                             and in_groups[0] is not None else 0))
            saved = state_dict["state"]
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            super().load_state_dict(state_dict)
            self.steps_taken = steps_taken
            params = [p for g in self.param_groups for p in g["params"]]
            for pid, p in zip(ids, params, strict=True):
                if pid not in saved:
                    continue
                state = self.state[p]
                for key, value in saved[pid].items():
                    if key in INT_STATE_KEYS:
                        state[key] = int(value)
                    elif torch.is_tensor(value):
                        state[key] = value.to(device=p.device, copy=True)
                if "weight_sq_norm" in state:
                    # the saved norm belongs to the weights loaded with it (load them first)
                    self._norm_versions[p] = p._version
                layer = sketched_owner_of(p)
                if layer is not None and "projection_version" in state:
                    layer.seed = state["layer_seed"]
                    layer.set_projection_version(state["projection_version"])
        for hook in held[post].values():
            hook(self)
