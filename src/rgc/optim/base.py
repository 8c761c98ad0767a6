"""The optimizer every rgc rule shares: torch.optim's conventions and the step pipeline.

A step of a :class:`SketchOptimizer` runs one pipeline for every rule and every set-up:

1. **gather**: the communication strategy (``comm``, :mod:`rgc.optim.comm`) exchanges the
   sketches and gradients; every parameter with a sketch or gradient becomes an
   :class:`Entry` (the rows of it this process updates), sketched ones grouped by shape;
2. **measure**: per group, the sums the rule's coefficients need (:class:`Partials`:
   finiteness, ``||C P^T||^2``, and for a rule that reads them ``||W||^2``, ``||grad||^2``);
3. **reduce**: the strategy completes the sums over the processes (one process: nothing);
4. **propose**: the rule's functional form (:mod:`rgc.optim.rules`) turns the sums and its
   state into a :class:`rgc.optim.rules.Proposal`, one per group, which becomes one
   :class:`rgc.updates.StackUpdate` (or a :class:`rgc.updates.DenseUpdate`);
5. **scale**: an optional step controller scales all proposals by one ``alpha``
   (see :class:`rgc.PredictedKL`);
6. **apply**: one :func:`rgc.ops.lowrank_update_` call per group, the same function a sync
   receiver applies (:func:`rgc.apply_update`), which is why its weights match the trainer's
   bit for bit;
7. **finish**: clear the sketches and refresh the projections that are due.

A rule is a subclass that implements ``_propose_stack`` and ``_propose_dense`` (and sets
``reads_norms`` when its coefficients need ``||W||^2``); everything else is shared.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from rgc import ops
from rgc.optim.comm import Local
from rgc.optim.rules import Partials, Proposal, carry_moment, sqrt32
from rgc.payload import KeptUpdate, build_payload
from rgc.projection import advance_projections
from rgc.registry import sketched_owner_of
from rgc.seeding import derive_seed
from rgc.updates import (
    DenseUpdate,
    LowRankUpdate,
    StackUpdate,
    resolve_chunk_rows,
    sum_squares,
    to_host,
)

__all__ = ["DenseUpdate", "Entry", "LowRankUpdate", "Partials", "SketchOptimizer",
           "StackUpdate", "check_common_args", "rounding_seed"]


@dataclass
class Entry:
    """One parameter's share of a step: the Parameter, its owner (``None`` for a dense
    gradient), its param group and state, and the rounding seed of this update.

    ``offset`` is the flat index of the first element the entry holds in the whole parameter
    (0; a distributed optimizer's row shard starts at ``first_row * row length``), so that its
    elements get the rounding bits they have in the whole parameter. ``index`` is the
    parameter's position among the optimizer's parameters (the order in which processes
    communicate about it).
    """
    param: torch.Tensor
    owner: object
    group: dict
    state: dict
    seed: int
    offset: int = 0
    index: int = 0


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
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an integer >= 1, got {chunk_rows!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def check_weight_decay(weight_decay) -> None:
    """ValueError unless ``weight_decay`` is a finite number >= 0 (as torch.optim.AdamW)."""
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not math.isfinite(weight_decay) or weight_decay < 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


#: Per-parameter state entries that are Python ints (never cast to the parameter's dtype).
INT_STATE_KEYS = ("step", "skipped", "layer_seed", "projection_version")

#: The key under which ``state_dict()`` stores :attr:`SketchOptimizer.steps_taken`.
STEPS_KEY = "rgc_steps_taken"


def stack_state(state: dict, key: str, sketch: torch.Tensor, flat: bool, *,
                per_row: bool = False) -> torch.Tensor:
    """``state[key]`` of a sketched weight, seen as a stack: ``[E, d, r]`` (``[E, d]`` when
    ``per_row``) FP32, zeros at first. A 2-D weight (``flat``) stores it without the leading
    E; ``sketch`` is its ``[E, d, r]`` sketch view."""
    if key not in state:
        shape = sketch.shape[:-1] if per_row else sketch.shape
        state[key] = torch.zeros(shape[1:] if flat else shape, dtype=torch.float32,
                                 device=sketch.device)
    value = state[key]
    return value.unsqueeze(0) if flat else value


class SketchOptimizer(Optimizer):
    """Base of the rgc optimizers: torch.optim's conventions around the step pipeline
    (module docstring).

    A rule subclass implements ``_propose_stack(entries, group, partials) -> Proposal`` for
    sketched weights of one shape and param group, and ``_propose_dense(entry, partials) ->
    Proposal | None`` for a parameter with a dense ``.grad`` (``None``: no change), both
    calling its functional form in :mod:`rgc.optim.rules`; it sets ``reads_norms = True`` if
    the partial sums must include ``||W||^2`` (and ``||grad||^2``), and names in
    ``carried_in_sketch_space`` the state tensors to carry into a new projection.

    ``step()`` reads nothing on the host unless a step controller is set: the finiteness test
    of each sketch or gradient is a bool tensor handed to the proposal (``Partials.finite``),
    whose coefficients are 0 on the device where it is false (the weight then stays
    bit-identical), and ``state[p]['skipped']`` is a 0-dim int64 counter on the parameter's
    device. Read the counters with :meth:`skipped_updates` (or ``state_dict()``, which stores
    them as ints). With a controller, the active flags of all proposals are read once per step.

    Args (beyond torch.optim's ``params`` and ``defaults``):
        step_control: ``None`` or a controller with ``scale(optimizer, updates) -> float``,
            ``after_update()`` and optionally ``check_ready()`` (e.g. :class:`rgc.PredictedKL`):
            all proposals of a step are gathered, scaled by the returned ``alpha`` and then
            applied.
        keep_updates: keep the applied updates of the last step (one d x r FP32 copy per
            compressed weight) so that :meth:`export_update` can build a sync payload.
        comm: the communication strategy (:mod:`rgc.optim.comm`); ``None``: one process
            (:class:`rgc.optim.comm.Local`). :class:`rgc.distributed.DataParallel` and
            :class:`rgc.distributed.FSDP2` train over ``torch.distributed``
            (:class:`rgc.DistributedRGCOptimizer` picks one for you).

    Every param group has ``maximize`` (default False). Where this contract differs from
    torch.optim is listed in ``docs/design.md`` ("Where rgc differs from torch.optim"): among
    others, no trainable parameter only warns, complex parameters are refused, arithmetic is
    FP32 whatever the parameter dtype, state tensors keep their dtype on load, and
    ``copy.deepcopy``/``pickle`` keep the step control, kept updates and counters.

    Trainer loops: transformers' ``Trainer`` (and TRL's trainers) call the optimizer's
    :meth:`train` at every training step; their gradient clipping reads ``.grad``, which
    sketched weights do not have. Unless the norm of the sketches is read
    (:func:`rgc.integrations.clip_grad_norm_`, which :func:`rgc.integrations.with_rgc` uses),
    the first step warns once that such a loop logs ``grad_norm = 0.0`` and clips nothing.
    """

    #: read by the global step guard (:mod:`rgc.guards`): this optimizer steps sketched weights
    updates_sketched_weights = True
    #: the rule's partial sums include ``||W||^2`` (and a dense parameter's ``||grad||^2``)
    reads_norms = False
    #: gradient clipping changes the rule's update (not so for a normalised rule)
    clips_gradients = True
    #: state tensors of a sketched weight that live in the basis of its ``P`` (``... x r``)
    carried_in_sketch_space: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, *, step_control=None, keep_updates: bool = False,
                 comm=None):
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
        # set by train(): a trainer loop (transformers' protocol) drives this optimizer
        self.driven_by_trainer = False
        # p -> p._version when state[p]['weight_sq_norm'] was last made from p's stored values
        self._norm_versions: dict[torch.Tensor, int] = {}
        # (max_norm, output) of clip_at_step(), for the next step
        self._clip_request: tuple[float, torch.Tensor] | None = None
        self.comm = Local() if comm is None else comm
        self.comm.attach(self)

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

    # -- trainer loops ------------------------------------------------------------------
    def train(self) -> None:
        """Called by transformers' ``Trainer`` (through accelerate) at every training step, as
        for schedule-free optimizers: records that a trainer loop drives this optimizer (see
        the class docstring); the update does not depend on it."""
        self.driven_by_trainer = True

    def eval(self) -> None:
        """Called by transformers' ``Trainer`` before evaluation; nothing to do."""

    def _warn_unread_norm(self) -> None:
        if self.driven_by_trainer and not self.sketch_norm_read:
            warnings.warn(
                f"{type(self).__name__} is driven by a transformers/accelerate training loop "
                "whose gradient clipping reads .grad, which sketched weights do not have: it "
                "logs grad_norm = 0.0 and clips nothing. Build the trainer with "
                "rgc.integrations.with_rgc(TrainerClass)(...), or clip with "
                "rgc.integrations.clip_grad_norm_(optimizer, max_norm)", UserWarning,
                stacklevel=3)

    # -- the rule's interface -----------------------------------------------------------
    def _propose_stack(self, entries: list[Entry], group: dict, partials: Partials) -> Proposal:
        """The update of sketched weights of one shape and param group: ``partials`` are
        the sums over the whole weights (the skips of non-finite sketches already counted);
        coefficients 0 (and ``active`` false) where a sketch is not finite."""
        raise NotImplementedError

    def _propose_dense(self, entry: Entry, partials: Partials) -> Proposal | None:
        """The update of a parameter with a dense ``.grad`` (``partials``: ``1 x 1`` sums of
        the whole parameter; coefficient 0 where ``partials.finite`` is false), or ``None``."""
        raise NotImplementedError

    def _refresh_projections(self, entries: list[Entry]) -> None:
        """Give every entry's owner its next ``P`` (the caller then renews the sketch slots),
        and carry the state tensors named in :attr:`carried_in_sketch_space` into the new
        basis (:func:`rgc.optim.rules.carry_moment`).

        One batched regeneration per (kind, k, r, dtype, device): see
        :func:`rgc.projection.advance_projections`.
        """
        carried = [(e, e.owner.projection.clone()) for e in entries
                   if any(key in e.state for key in self.carried_in_sketch_space)]
        advance_projections([e.owner for e in entries])
        for e, old in carried:
            for key in self.carried_in_sketch_space:
                if key in e.state:
                    e.state[key] = carry_moment(e.state[key], old, e.owner.projection)

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
        stacks, dense = self._gather()
        if self.steps_taken == 0 and stacks:
            self._warn_unread_norm()
        measured = [(entries, self._stack_sums(entries)) for entries in stacks]
        measured += [([e], self._dense_sums(e)) for e in dense]
        self.comm.reduce(measured)
        if self._clip_request is not None:
            self._clip(measured)
        updates = self._propose(measured[:len(stacks)], measured[len(stacks):])
        alpha, any_active = 1.0, False
        if control is not None:
            alpha, any_active = self._control(control, [u for u, _ in updates])
        records = [] if self.keep_updates else None
        for update, entries in updates:
            update.scale(alpha)
            if records is not None:
                records.extend(self.comm.keep(update))
            update.apply()
            if isinstance(update, StackUpdate) and update.sq_norms is not None:
                for m, e in enumerate(entries):
                    self._record_sq_norm(e, update.sq_norms[m])
        self._finish(stacks)
        if any_active:
            control.after_update()
        self.steps_taken += 1
        self.last_updates = records
        return loss

    def _gather(self) -> tuple[list[list[Entry]], list[Entry]]:
        """The step's work, after the strategy's exchange: sketched entries grouped by
        (param group, shape, dtypes, device), and the entries with a dense gradient. Counts
        each parameter's step."""
        exchanged = self.comm.exchange([p for g in self.param_groups for p in g["params"]
                                        if p.requires_grad])
        stacks: dict[tuple, list[Entry]] = {}
        dense: list[Entry] = []
        index = 0
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                owner = sketched_owner_of(p)
                if owner is not None and owner.sketch is not None:
                    entry = self.comm.view(self._entry(p, owner, group, index - 1), exchanged)
                    o = entry.owner  # the entry's view: all of the weight, or its share here
                    # a view of some experts of a stack groups with views of stacks as large
                    key = (g, o.num_matrices, getattr(o, "total_matrices", None),
                           o.out_features, o.in_features, o.rank, entry.param.dtype,
                           o.projection.dtype, entry.param.device)
                    stacks.setdefault(key, []).append(entry)
                elif p.grad is not None:
                    dense.append(self.comm.view(self._entry(p, None, group, index - 1),
                                                exchanged))
        return list(stacks.values()), dense

    def _entry(self, p, owner, group: dict, index: int) -> Entry:
        state = self._init_state(p, owner)
        state["step"] += 1
        return Entry(p, owner, group, state, rounding_seed(group["seed"], index, state["step"]),
                     index=index)

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

    def _stack_sums(self, entries: list[Entry]) -> Partials:
        """Measure: ``finite`` and ``||C P^T||^2`` of every matrix (one
        :func:`rgc.ops.sketch_stats` call), and ``||W||^2`` if the rule reads it, over the
        rows each entry holds (``[M, E]`` each)."""
        owners = [e.owner for e in entries]
        h2, finite = ops.sketch_stats([o.sketch_matrices() for o in owners],
                                      [o.projection for o in owners])
        partials = Partials(finite, {"sketch": h2})
        if self.reads_norms:
            partials.sums["weight"] = self._weight_sq_norms(entries)
        return partials

    def _dense_sums(self, entry: Entry) -> Partials:
        """Measure a parameter with a dense ``.grad``: whether it is finite, and ``||W||^2``
        and ``||grad||^2`` if the rule reads them (``1 x 1`` each)."""
        p = entry.param
        partials = Partials(torch.isfinite(p.grad).all().reshape(1, 1))
        if self.reads_norms:
            partials.sums["weight"] = sum_squares(p).reshape(1, 1)
        if self.reads_norms or self._clip_request is not None:
            partials.sums["direction"] = sum_squares(p.grad).reshape(1, 1)
        return partials

    # -- clipping by the global norm --------------------------------------------------------
    def clip_at_step(self, max_norm: float) -> torch.Tensor:
        """Clip the next ``step()``'s gradient estimates to ``max_norm`` by their global norm.

        The norm is that of everything the step applies (``||C P^T||`` of every sketch, the
        dense gradients), after the communication strategy has reduced them over the
        processes, from the partial sums the step measures anyway (under FSDP2 they ride in its
        one all-reduce): every rank clips by the same factor, ``max_norm / (norm + 1e-6)`` when
        the norm exceeds ``max_norm`` and is finite. ``max_norm = inf`` only measures, as does
        a rule whose update is normalised (``clips_gradients`` false). Returns a 0-dim FP32
        tensor on the parameters' device that the step fills in place with the norm before
        clipping (read it after ``step()``; nothing is read on the host).
        :func:`rgc.integrations.clip_grad_norm_` uses this under a distributed strategy.
        """
        if max_norm is None or not (max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0 (inf: only measure), got "
                             f"{max_norm!r}")
        device = next((p.device for g in self.param_groups for p in g["params"]),
                      torch.device("cpu"))
        out = torch.zeros((), dtype=torch.float32, device=device)
        self._clip_request = (float(max_norm), out)
        return out

    def _clip(self, measured: list) -> None:
        """Fill the clip request's norm from the completed sums, in parameter order (the same
        bits on every rank, whatever the grouping by local shape), and scale the sketches,
        gradients and their sums by the clip factor (on the device)."""
        max_norm, out = self._clip_request
        self._clip_request = None
        per_param = {}
        for entries, partials in measured:
            stack = partials.of_all_matrices()
            sums = stack["sketch"] if "sketch" in stack.sums else stack["direction"]
            for e, total in zip(entries, ops.pairwise_sums(sums), strict=True):
                per_param[e.index] = total
        if not per_param:
            return
        norm = sqrt32(ops.pairwise_sums(torch.stack([per_param[i] for i in sorted(per_param)])))
        out.copy_(norm)
        if not self.clips_gradients or math.isinf(max_norm):
            return
        factor = torch.where(torch.isfinite(norm) & (norm > max_norm),
                             max_norm / (norm + 1e-6), 1.0)
        tensors = [e.owner.sketch_matrices() if e.owner is not None else e.param.grad
                   for entries, _ in measured for e in entries]
        torch._foreach_mul_(tensors, factor)
        square = factor * factor
        for _, partials in measured:
            for stats in {id(s): s for s in (partials, partials.of_all_matrices())}.values():
                for name in ("sketch", "direction"):
                    if name in stats.sums:
                        stats.sums[name].mul_(square)

    def _weight_sq_norms(self, entries: list[Entry]) -> torch.Tensor:
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
            chunk_rows = resolve_chunk_rows(entries[0].group["chunk_rows"], weights[0].shape[2])
            fresh = ops.sum_squares(weights, chunk_rows)
            for j, i in enumerate(stale):
                rows[i] = fresh[j]
        return torch.stack(rows)

    def _record_sq_norm(self, entry: Entry, norm: torch.Tensor) -> None:
        """Keep ``||W_new||^2`` (a view of the update's ``sq_norms``) for the next step, unless
        the entry is a share of a weight (its norm is then recomputed each step, so that no
        per-rank value enters the checkpointed state)."""
        if self.comm.keeps_weight_norm(entry):
            entry.state["weight_sq_norm"] = norm[0] if entry.param.dim() == 2 else norm
            self._norm_versions[entry.param] = entry.param._version

    def _propose(self, stacks: list, dense: list) -> list[tuple]:
        """Propose: count the skips, then one update per stack and per dense parameter with
        a proposal; ``(update, entries)`` pairs."""
        updates = []
        for entries, partials in stacks:
            self._count_skips(entries, partials.finite)
            group = entries[0].group
            proposal = self._propose_stack(entries, group, partials)
            k = entries[0].owner.weight_matrices().shape[2]
            updates.append((StackUpdate(
                [e.param for e in entries], [e.owner for e in entries], proposal.factors,
                proposal.coefs, proposal.decays, seeds=[e.seed for e in entries],
                chunk_rows=resolve_chunk_rows(group["chunk_rows"], k),
                stochastic_rounding=group["stochastic_rounding"], active=proposal.active,
                sq_norms=proposal.sq_norms, offsets=[e.offset for e in entries]), entries))
        if dense:
            self._count_skips([e for (e,), _ in dense],
                              torch.cat([partials.finite for _, partials in dense]))
        for (e,), partials in dense:
            proposal = self._propose_dense(e, partials)
            if proposal is not None:
                updates.append((DenseUpdate(
                    e.param, proposal.factors, proposal.coefs,
                    0.0 if proposal.decays is None else proposal.decays, e.seed,
                    e.group["stochastic_rounding"], proposal.active, e.offset), [e]))
        return updates

    @staticmethod
    def _count_skips(entries: list[Entry], finite: torch.Tensor) -> None:
        """Add one skip to each entry whose ``finite`` row (``[M, E]`` bool) is not all true
        (one grouped add for all entries)."""
        bad = (~finite.all(dim=1)).to(torch.int64)
        torch._foreach_add_([e.state["skipped"] for e in entries], list(bad.unbind(0)))

    def _control(self, control, updates: list) -> tuple[float, bool]:
        """The step controller's ``alpha`` from the active updates of whole parameters (one
        host read of the active flags of all of them); ``(1.0, False)`` when none is active.
        The flags are read after the shards are gathered: a rank's share of an expert stack
        may have no active expert where another rank's has one."""
        members = [m for u in updates for m in (u.members() if isinstance(u, StackUpdate)
                                                else [u])]
        whole = self.comm.whole_updates(members)
        flags = [m.active if not torch.is_tensor(m.active) or m.active.dim() == 0
                 else m.active.any() for m in whole]
        active = [m for m, a in zip(whole, to_host(flags), strict=True) if a]
        if not active:
            return 1.0, False
        return float(control.scale(self, active)), True

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the processes that train this model together (a step
        controller's probe statistics); on one process, ``values`` itself."""
        return self.comm.sum_over_ranks(values)

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
            self.comm.finish()

    # -- counters, sync, zero_grad --------------------------------------------------------
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

    def export_update(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The last step's updates as a sync payload (see :func:`rgc.payload.build_payload`).

        ``model`` names the parameters (``model.named_parameters()``). Needs
        ``keep_updates=True`` and a completed ``step()``; collective under a distributed
        strategy (every rank calls it).
        """
        if not self.keep_updates:
            raise RuntimeError(f"export_update() needs {type(self).__name__}(..., "
                               "keep_updates=True): the factors of a step are not kept otherwise")
        if self.last_updates is None:
            raise RuntimeError("export_update() called before the first step()")
        return build_payload(model, self.comm.payload_records(self.last_updates),
                             self.steps_taken)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and the sketches of compressed weights."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                layer = sketched_owner_of(p)
                if layer is not None:
                    layer.zero_sketch(set_to_none=set_to_none)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim's state dict, with the device counters ``skipped`` read as ints (one
        copy per device) and ``rgc_steps_taken``; post hooks see the final dict.
        ``weight_sq_norm`` (RGCOptimizer's cached ``||W||^2``) is kept as the FP32 tensor it is,
        so a resumed run uses the same bits."""
        handle = self.register_state_dict_post_hook(SketchOptimizer._complete_state_dict,
                                                    prepend=True)
        try:
            return super().state_dict()
        finally:
            handle.remove()

    @staticmethod
    def _complete_state_dict(self, sd: dict) -> dict:
        """rgc's state dict post hook, run before any other: counters as ints, step count."""
        # entries a hook added under other keys may be anything (torch.optim keeps them as is)
        entries = [(k, v) for k, v in sd["state"].items()
                   if isinstance(v, dict) and "skipped" in v]
        counts = to_host([v["skipped"] for _, v in entries])
        self._warn_skipped(sum(int(c) for c in counts))
        state = dict(sd["state"])
        for (key, value), count in zip(entries, counts, strict=True):
            state[key] = {**value, "skipped": int(count)}
        sd["state"] = state
        sd[STEPS_KEY] = self.steps_taken
        # torch.distributed.checkpoint keeps only "state" and "param_groups": the count rides
        # in every group too (copies: the optimizer's own groups do not get the key)
        sd["param_groups"] = [{**g, STEPS_KEY: self.steps_taken} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state and put every compressed layer back on its saved projection.

        torch.optim casts tensor state to the parameter's dtype; here every state tensor keeps
        its saved dtype (the FP32 moments of a BF16 weight stay FP32), and the counters of
        :data:`INT_STATE_KEYS` are Python ints, so resume is bit-identical. Load pre hooks run
        first and what they return is what is loaded; load post hooks run last, when
        projections and state are restored.
        """
        loaded: dict = {}

        def take(optimizer, sd: dict) -> dict:  # after the user's pre hooks: what is loaded
            sd = dict(sd)
            groups = [dict(g) for g in sd["param_groups"]]
            in_groups = [g.pop(STEPS_KEY, None) for g in groups]
            sd["param_groups"] = groups
            steps = sd.pop(STEPS_KEY, in_groups[0] if in_groups else None)
            loaded.update(sd=sd, steps=0 if steps is None else int(steps))
            return sd

        pre = self.register_load_state_dict_pre_hook(take)
        post = self.register_load_state_dict_post_hook(
            lambda optimizer: self._restore_state(loaded["sd"], loaded["steps"]), prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _restore_state(self, sd: dict, steps_taken: int) -> None:
        """rgc's load post hook, run before any other: the saved state tensors with their
        dtypes, the counters as ints, and every compressed layer on its saved projection."""
        self.steps_taken = steps_taken
        saved = sd["state"]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
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
