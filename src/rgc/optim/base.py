"""What every rgc optimizer shares: gather, propose, scale, apply, refresh, record.

A step of a :class:`SketchOptimizer` proposes, for every parameter with a sketch or gradient,
an update in factored form (:class:`LowRankUpdate` or :class:`DenseUpdate`), optionally lets
a step controller scale all proposals by one ``alpha`` (see :class:`rgc.PredictedKL`), applies
them, then clears sketches and, after the last update, refreshes projections. The same apply
functions serve a sync receiver (:func:`rgc.apply_update`), which is why its weights match the
trainer's bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict

import torch
from torch.optim import Optimizer

from rgc import dispatch
from rgc.nn import CompressedLinear, compressed_layer_of
from rgc.seeding import derive_seed
from rgc.sync import build_payload, fingerprint_tensor
from rgc.updates import DenseUpdate, LowRankUpdate, apply_update_record, scale_update, to_host

__all__ = ["DenseUpdate", "LowRankUpdate", "SketchOptimizer", "check_common_args",
           "rounding_seed"]


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
    """ValueError for a bad ``lr``, ``chunk_rows`` or ``seed``."""
    check_lr(lr)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


#: Per-parameter state entries that are Python ints. rgc's first state format stored them as
#: int64 0-dim tensors; ``load_state_dict`` converts those, so old checkpoints resume exactly.
INT_STATE_KEYS = ("step", "skipped", "layer_seed", "projection_version")

#: Attributes an optimizer pickled before they existed gets on unpickling.
_ATTRIBUTE_DEFAULTS = {"step_control": None, "keep_updates": False, "steps_taken": 0,
                       "last_updates": None, "_warned_nonfinite": False}


class SketchOptimizer(Optimizer):
    """Base of the rgc optimizers. Subclasses implement ``_propose_lowrank`` and
    ``_propose_dense`` (return an update or ``None`` for "no change"), and may override
    ``_refresh`` to carry state into a new projection.

    ``step()`` reads nothing on the host unless a step controller is set: the finiteness test
    of each sketch or gradient is a 0-dim bool tensor ``ok`` handed to the proposal, whose
    coefficients are 0 on the device where it is false (the weight then stays bit-identical),
    and ``state[p]['skipped']`` is a 0-dim int64 counter on the parameter's device. Read the
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
        # (update, fingerprint of the tensor before it, projection seed used) per parameter
        self.last_updates: list[tuple] | None = None
        self._warned_nonfinite = False
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
    def _propose_lowrank(self, p, layer, group, state, seed, ok) -> LowRankUpdate | None:
        """The update of a compressed weight; ``ok`` (0-dim bool) is false for a non-finite
        sketch, and the update's coefficients must then be 0 (and its ``active`` false)."""
        raise NotImplementedError

    def _propose_dense(self, p, group, state, seed, ok) -> DenseUpdate | None:
        """As :meth:`_propose_lowrank`, for a parameter with a dense ``.grad``."""
        raise NotImplementedError

    def _refresh(self, p, layer: CompressedLinear, state: dict) -> None:
        """The layer's next ``P``; the caller then renews the layer's sketch slot."""
        layer.set_projection_version(layer.projection_version + 1, renew_sketch_slot=False)

    # -- shared machinery ---------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, layer: CompressedLinear | None) -> dict:
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

    def _finite(self, state: dict, values: torch.Tensor) -> torch.Tensor:
        """0-dim bool: all of ``values`` finite; counts a skip in ``state`` otherwise."""
        ok = torch.isfinite(values).all()
        state["skipped"] += ~ok
        return ok

    def skipped_updates(self) -> int:
        """Updates skipped so far for a non-finite sketch or gradient, over all parameters.

        Reads the device counters (one copy per device); ``int(state[p]['skipped'])`` gives
        one parameter's count. Warns once when the count is first seen non-zero.
        """
        counts = to_host([s["skipped"] for s in self.state.values() if "skipped" in s])
        total = sum(int(c) for c in counts)
        self._warn_skipped(total)
        return total

    def _warn_skipped(self, total: int) -> None:
        if total and not self._warned_nonfinite:
            warnings.warn(f"non-finite sketch or gradient: {total} update(s) were skipped and "
                          "their weights left unchanged (counted in state[p]['skipped']); this "
                          "warning is shown once", RuntimeWarning, stacklevel=3)
            self._warned_nonfinite = True

    def _cached_sq_norm(self, p: torch.Tensor, state: dict, chunk_rows: int) -> torch.Tensor:
        """``||p||_F^2`` (0-dim FP32) for an update that will also refresh it.

        The previous update wrote ``state['weight_sq_norm']`` from the values it stored; it is
        used while ``p`` has not been written since (its version counter is unchanged since that
        update or since ``load_state_dict``), else it is recomputed from ``p`` (one read).
        """
        cached = state.get("weight_sq_norm")
        if cached is None or self._norm_versions.get(p) != p._version:
            fresh = dispatch.sum_squares(p, chunk_rows=chunk_rows)
            if cached is None:
                state["weight_sq_norm"] = fresh
            else:
                cached.copy_(fresh)
        return state["weight_sq_norm"]

    def _finish_layer(self, p, layer: CompressedLinear, state: dict) -> None:
        layer.zero_sketch(set_to_none=False)
        refresh, step = layer.refresh, state["step"]
        if refresh == "every_step" or (isinstance(refresh, int) and step % refresh == 0):
            deferred = self.__dict__.get("_deferred_refreshes")
            if deferred is not None:
                deferred.append((p, layer, state))
                return
            self._refresh(p, layer, state)
            layer._new_sketch_slot()
        state["projection_version"] = layer.projection_version

    def _run_deferred_refreshes(self) -> None:
        """Regenerate the projections whose refresh :meth:`step` deferred to its end, then
        renew their sketch slots."""
        deferred = self.__dict__.pop("_deferred_refreshes")
        try:
            for p, layer, state in deferred:
                self._refresh(p, layer, state)
                state["projection_version"] = layer.projection_version
        finally:
            for _, layer, _ in deferred:
                layer._new_sketch_slot()

    def _apply(self, update, alpha: float, records: list | None) -> None:
        if update is None:
            return
        scale_update(update, alpha)
        if records is not None:
            base = fingerprint_tensor(update.param)
            projection_seed = getattr(getattr(update, "layer", None), "projection_seed", None)
        apply_update_record(update)
        if getattr(update, "sq_norm_out", None) is not None:
            self._norm_versions[update.param] = update.param._version
        if records is not None:
            if isinstance(update, LowRankUpdate):
                # the sketch is zeroed in place next; the record needs its own copy
                update.factor = update.factor.clone()
            records.append((update, base, projection_seed))

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
        # Refreshes run after every update, one layer's P right after another's: interleaved
        # with the updates, the regeneration ran about 1.5x slower on a CPU (evicted caches).
        self._deferred_refreshes = []
        try:
            self._step_all(control, records)
        finally:
            self._run_deferred_refreshes()
        self.steps_taken += 1
        self.last_updates = records
        return loss

    def _step_all(self, control, records) -> None:
        """Gather, propose, scale and apply every update of a step (refreshes are deferred)."""
        pending = []
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                layer = compressed_layer_of(p)
                if layer is not None and layer.sketch is not None:
                    item = self._gather_compressed(p, layer, group, index - 1)
                elif p.grad is not None:
                    item = self._gather_dense(p, group, index - 1)
                else:
                    continue
                if control is None:  # stream: nothing proposed is held longer than needed
                    self._commit(item, 1.0, records)
                else:
                    pending.append(item)
        if control is not None:
            # the one host read of the step's proposals: which of them are active
            active = to_host([u.active if u is not None else False for u, _ in pending])
            pending = [(u if a else None, finish) for (u, finish), a in
                       zip(pending, active, strict=True)]
            updates = [u for u, _ in pending if u is not None]
            alpha = float(control.scale(self, updates)) if updates else 1.0
            for item in pending:
                self._commit(item, alpha, records)
            if updates:
                control.after_update()

    def _gather_compressed(self, p, layer: CompressedLinear, group: dict, index: int):
        """Count the step and propose (a non-finite sketch: coefficients 0, counted)."""
        state = self._init_state(p, layer)
        state["step"] += 1
        ok = self._finite(state, layer.sketch)
        seed = rounding_seed(group["seed"], index, state["step"])
        return self._propose_lowrank(p, layer, group, state, seed, ok), (p, layer, state)

    def _gather_dense(self, p, group: dict, index: int):
        state = self._init_state(p, None)
        state["step"] += 1
        ok = self._finite(state, p.grad)
        seed = rounding_seed(group["seed"], index, state["step"])
        return self._propose_dense(p, group, state, seed, ok), None

    def _step_compressed(self, p, layer: CompressedLinear, group: dict, index: int) -> None:
        """The whole update of one compressed weight, without step control or records."""
        self._commit(self._gather_compressed(p, layer, group, index), 1.0, None)

    def _step_dense(self, p, group: dict, index: int) -> None:
        """The whole update of one parameter with a dense gradient (no control, no records)."""
        self._commit(self._gather_dense(p, group, index), 1.0, None)

    def _commit(self, item, alpha: float, records) -> None:
        update, finish = item
        self._apply(update, alpha, records)
        if finish is not None:
            self._finish_layer(*finish)

    def export_update(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The last step's updates as a sync payload (see :func:`rgc.sync.build_payload`).

        ``model`` names the parameters (``model.named_parameters()``). Needs
        ``keep_updates=True`` and a completed ``step()``.
        """
        if not self.keep_updates:
            raise RuntimeError(f"export_update() needs {type(self).__name__}(..., "
                               "keep_updates=True): the factors of a step are not kept otherwise")
        if self.last_updates is None:
            raise RuntimeError("export_update() called before the first step()")
        return build_payload(model, self.last_updates, self.steps_taken)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and the sketches of compressed weights."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                layer = compressed_layer_of(p)
                if layer is not None:
                    layer.zero_sketch(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """torch.optim's state dict, with the device counters ``skipped`` read as ints (one
        copy per device) and ``rgc_steps_taken``; post hooks see the final dict.
        ``weight_sq_norm`` (RGCOptimizer's cached ``||W||^2``) is kept as the FP32 tensor it is,
        so a resumed run uses the same bits."""
        with self._hooks_held("_optimizer_state_dict_post_hooks") as held:
            sd = super().state_dict()
        entries = [(k, v) for k, v in sd["state"].items() if "skipped" in v]
        counts = to_host([v["skipped"] for _, v in entries])
        self._warn_skipped(sum(int(c) for c in counts))
        state = dict(sd["state"])
        for (key, value), count in zip(entries, counts, strict=True):
            state[key] = {**value, "skipped": int(count)}
        sd["state"] = state
        sd["rgc_steps_taken"] = self.steps_taken
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
            steps_taken = int(state_dict.pop("rgc_steps_taken", 0))
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
                layer = compressed_layer_of(p)
                if layer is not None and "projection_version" in state:
                    layer.seed = state["layer_seed"]
                    layer.set_projection_version(state["projection_version"])
        for hook in held[post].values():
            hook(self)
