"""RGCOptimizer: normalised SGD from rank-r sketches, no optimizer state per element."""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim import Optimizer

from rgc import dispatch
from rgc.nn import CompressedLinear, compressed_layer_of
from rgc.reference.update import write_rows
from rgc.seeding import derive_seed


def sketch_norm(sketch: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``||C P^T||_F`` from the r x r Gram ``P^T P`` without forming ``C P^T``. 0-dim FP32.

    ``||H||_F^2 = trace(C (P^T P) C^T)``; C: d x r FP32, P: k x r.
    """
    p = projection.to(torch.float32)
    gram = p.t() @ p
    return ((sketch @ gram) * sketch).sum().clamp_min(0).sqrt()


def rounding_seed(seed: int, param_index: int, step: int) -> int:
    """Seed of the stochastic-rounding bits for one parameter's update at ``step``."""
    return derive_seed(seed, "round", param_index, step)


def lowrank_normalized_update_(weight: torch.Tensor, sketch: torch.Tensor,
                               projection: torch.Tensor, lr: float, *, seed: int,
                               chunk_rows: int = 128, stochastic_rounding: bool = True) -> float:
    """``W <- W - lr * ||W||_F * H / ||H||_F`` with ``H = C P^T`` rebuilt in row chunks.

    Returns the coefficient applied to ``H`` (0.0 when ``H`` is zero: nothing changes).
    """
    h_norm = float(sketch_norm(sketch, projection))
    if h_norm == 0.0 or lr == 0.0:
        return 0.0
    coef = lr * float(dispatch.frobenius_norm(weight, chunk_rows=chunk_rows)) / h_norm
    dispatch.lowrank_update_(weight, sketch, projection, coef, seed=seed, chunk_rows=chunk_rows,
                             stochastic_rounding=stochastic_rounding)
    return coef


def dense_normalized_update_(param: torch.Tensor, grad: torch.Tensor, lr: float, *, seed: int,
                             stochastic_rounding: bool = True) -> float:
    """``p <- p - lr * ||p|| * g / ||g||`` for a parameter with an ordinary gradient."""
    g_norm = float(grad.to(torch.float32).norm())
    if g_norm == 0.0 or lr == 0.0:
        return 0.0
    coef = lr * float(param.to(torch.float32).norm()) / g_norm
    new = param.to(torch.float32) - coef * grad.to(torch.float32)
    write_rows(param, new, seed=seed, offset=0, stochastic_rounding=stochastic_rounding)
    return coef


class RGCOptimizer(Optimizer):
    """Randomized gradient compression: normalised SGD on sketched weights.

    For every weight of a :class:`rgc.CompressedLinear` with a sketch ``C`` (d x r FP32) and
    projection ``P`` (k x r)::

        H = C P^T                                   (rebuilt chunk_rows rows at a time)
        W <- W - lr * ||W||_F * H / ||H||_F         (||H||_F from the r x r Gram P^T P)

    written with stochastic rounding when W is BF16 (unbiased, counter-based bits keyed by
    ``(seed, parameter index, step)``) and with plain arithmetic when W is FP32. Then ``P`` is
    refreshed per the layer's schedule and ``C`` is cleared. Any other parameter with a dense
    ``.grad`` gets the same normalised rule from its gradient (a parameter that is exactly zero,
    such as a fresh bias, therefore never moves: put it in a torch optimizer instead).

    There is no state per element: per parameter a step count, a count of skipped updates,
    and the layer's seed and projection version, all Python ints. A non-finite sketch or
    gradient skips that update, leaves the weight untouched, warns once and increments
    ``state[p]['skipped']``.

    Args:
        params: iterable of parameters or param groups (as torch.optim).
        lr: ``tau``, the relative step ``||dW|| / ||W||``; see :func:`rgc.calibrate_lr`.
        chunk_rows: rows of H rebuilt at once on the reference path (memory: chunk_rows x k FP32).
        stochastic_rounding: round BF16 weights stochastically (default) or to nearest.
        seed: key of the rounding bits.

    ``zero_grad()`` clears sketches as well as gradients. A backward must complete before
    ``step()``: a forward run before a step and backpropagated after it raises.
    """

    def __init__(self, params, lr: float, *, chunk_rows: int = 128,
                 stochastic_rounding: bool = True, seed: int = 0):
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr (tau) must be a finite number >= 0, got {lr!r}")
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        defaults = dict(lr=lr, chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding,
                        seed=seed)
        super().__init__(params, defaults)
        if not any(p.requires_grad for g in self.param_groups for p in g["params"]):
            raise ValueError(
                "RGCOptimizer was given no trainable parameter; wrap the model with rgc.wrap() "
                "and pass model.parameters() (or the trainable ones)")
        self._warned_nonfinite = False

    def _init_state(self, p: torch.Tensor, layer: CompressedLinear | None) -> dict:
        # Python ints, not tensors: Optimizer.load_state_dict casts tensor state to the
        # parameter's dtype, which would corrupt 63-bit seeds stored in a BF16 parameter's state.
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["skipped"] = 0
            if layer is not None:
                state["layer_seed"] = layer.seed
                state["projection_version"] = layer.projection_version
        return state

    def _skip(self, state: dict, what: str) -> None:
        state["skipped"] += 1
        if not self._warned_nonfinite:
            warnings.warn(f"non-finite {what}: the update of that parameter was skipped and its "
                          "weight left unchanged (counted in state['skipped']); this warning is "
                          "shown once", RuntimeWarning, stacklevel=3)
            self._warned_nonfinite = True

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a sketch or a gradient. Returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                layer = compressed_layer_of(p)
                if layer is not None and layer.sketch is not None:
                    self._step_compressed(p, layer, group, index - 1)
                elif p.grad is not None:
                    self._step_dense(p, group, index - 1)
        return loss

    def _step_compressed(self, p, layer: CompressedLinear, group: dict, index: int) -> None:
        state = self._init_state(p, layer)
        state["step"] += 1
        step = state["step"]
        sketch = layer.sketch
        if bool(torch.isfinite(sketch).all()):
            lowrank_normalized_update_(
                p, sketch, layer.projection, group["lr"],
                seed=rounding_seed(group["seed"], index, step), chunk_rows=group["chunk_rows"],
                stochastic_rounding=group["stochastic_rounding"])
        else:
            self._skip(state, "sketch")
        layer.zero_sketch(set_to_none=False)
        refresh = layer.refresh
        if refresh == "every_step" or (isinstance(refresh, int) and step % refresh == 0):
            layer.set_projection_version(layer.projection_version + 1)
        state["projection_version"] = layer.projection_version

    def _step_dense(self, p, group: dict, index: int) -> None:
        state = self._init_state(p, None)
        state["step"] += 1
        if bool(torch.isfinite(p.grad).all()):
            dense_normalized_update_(p, p.grad, group["lr"],
                                     seed=rounding_seed(group["seed"], index, state["step"]),
                                     stochastic_rounding=group["stochastic_rounding"])
        else:
            self._skip(state, "gradient")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and the sketches of compressed weights."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                layer = compressed_layer_of(p)
                if layer is not None:
                    layer.zero_sketch(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state and put every compressed layer back on its saved projection."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                layer = compressed_layer_of(p)
                state = self.state.get(p)
                if layer is None or not state or "projection_version" not in state:
                    continue
                layer.seed = state["layer_seed"]
                layer.set_projection_version(state["projection_version"])
