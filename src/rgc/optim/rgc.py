"""RGCOptimizer: normalised SGD from rank-r sketches, no optimizer state per element."""

from __future__ import annotations

import torch

from rgc import dispatch
from rgc.optim.base import (
    DenseUpdate,
    LowRankUpdate,
    SketchOptimizer,
    check_common_args,
)


def sketch_norm(sketch: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``||C P^T||_F`` from the r x r Gram ``P^T P`` without forming ``C P^T``. 0-dim FP32.

    ``||H||_F^2 = trace(C (P^T P) C^T)``; C: d x r FP32, P: k x r.
    """
    p = projection.to(torch.float32)
    gram = p.t() @ p
    return ((sketch @ gram) * sketch).sum().clamp_min(0).sqrt()


def lowrank_normalized_coef(weight: torch.Tensor, sketch: torch.Tensor,
                            projection: torch.Tensor, lr: float, *, chunk_rows: int = 128) -> float:
    """``lr * ||W||_F / ||C P^T||_F``, or 0.0 when ``H = C P^T`` is zero or ``lr`` is 0."""
    h_norm = float(sketch_norm(sketch, projection))
    if h_norm == 0.0 or lr == 0.0:
        return 0.0
    return lr * float(dispatch.frobenius_norm(weight, chunk_rows=chunk_rows)) / h_norm


def dense_normalized_coef(param: torch.Tensor, grad: torch.Tensor, lr: float) -> float:
    """``lr * ||p|| / ||g||``, or 0.0 when ``g`` is zero or ``lr`` is 0."""
    g_norm = float(grad.to(torch.float32).norm())
    if g_norm == 0.0 or lr == 0.0:
        return 0.0
    return lr * float(param.to(torch.float32).norm()) / g_norm


class RGCOptimizer(SketchOptimizer):
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
        lr: ``tau``, the relative step ``||dW|| / ||W||``; see :func:`rgc.calibrate_lr`. A float
            or a 0-dim tensor (read with ``float()`` at each step, so a scheduler may fill it in
            place). Default 1e-3, torch.optim's default, for param groups that set their own.
        chunk_rows: rows of H rebuilt at once on the reference path (memory: chunk_rows x k FP32).
        stochastic_rounding: round BF16 weights stochastically (default) or to nearest.
        seed: key of the rounding bits.
        step_control: e.g. :class:`rgc.PredictedKL`; scales each step's updates by one alpha.
        keep_updates: keep the last step's factors for :meth:`export_update` (policy sync).
        maximize: step along ``+H`` (ascend the objective) instead of ``-H``.

    **Dtypes.** Weights of compressed layers are BF16 or FP32. Any other real parameter is
    updated with FP32 arithmetic: an FP64 parameter receives an FP32-computed value each step
    (precision beyond FP32 is lost), an FP16 one is written with round-to-nearest. Complex
    parameters are refused at construction.

    ``zero_grad()`` clears sketches as well as gradients. A backward must complete before
    ``step()``: a forward run before a step and backpropagated after it raises.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, *, chunk_rows: int = 128,
                 stochastic_rounding: bool = True, seed: int = 0, step_control=None,
                 keep_updates: bool = False, maximize: bool = False):
        check_common_args(lr, chunk_rows, seed)
        defaults = dict(lr=lr, chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding,
                        seed=seed, maximize=maximize)
        super().__init__(params, defaults, step_control=step_control, keep_updates=keep_updates)

    def _propose_lowrank(self, p, layer, group, state, seed) -> LowRankUpdate | None:
        coef = lowrank_normalized_coef(p, layer.sketch, layer.projection, float(group["lr"]),
                                       chunk_rows=group["chunk_rows"])
        if coef == 0.0:
            return None
        if group["maximize"]:
            coef = -coef
        return LowRankUpdate(p, layer, layer.sketch, coef, 0.0, seed, group["chunk_rows"],
                             group["stochastic_rounding"])

    def _propose_dense(self, p, group, state, seed) -> DenseUpdate | None:
        coef = dense_normalized_coef(p, p.grad, float(group["lr"]))
        if coef == 0.0:
            return None
        if group["maximize"]:
            coef = -coef
        return DenseUpdate(p, p.grad, coef, 0.0, seed, group["stochastic_rounding"])
