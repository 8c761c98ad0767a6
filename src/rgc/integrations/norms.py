"""Gradient norm and clipping for rgc optimizers, where ``model.parameters()`` sees no gradient.

A compressed weight has no ``.grad``: its gradient estimate is ``H = C P^T``, held as the sketch
``C`` (d x r). ``torch.nn.utils.clip_grad_norm_(model.parameters())`` (what transformers'
``Trainer``, TRL and ``accelerate.Accelerator.clip_grad_norm_`` call) therefore reports 0 and
clips nothing. :func:`grad_norm` and :func:`clip_grad_norm_` work from the optimizer instead.

**Clipping decisions.**

* :class:`rgc.RGCOptimizer` (and :class:`rgc.DistributedRGCOptimizer`) normalise every update,
  ``W <- W - lr ||W|| H / ||H||``: scaling all gradients by one factor changes nothing, so
  clipping is declined with a one-time warning (the norm is still returned, for logging).
* :class:`rgc.RowAdam` (and any other rgc optimizer) honours it like torch: when the total norm
  exceeds ``max_norm`` every sketch and dense gradient is scaled by ``max_norm / norm`` in place
  (d x r per compressed weight, no dense temporary). As with AdamW, this bounds how much one
  outlier batch moves the moments.
* Under a distributed optimizer (:class:`rgc.DistributedRGCOptimizer`,
  :class:`rgc.DistributedRowAdam`: data parallel or FSDP2) the sketches are reduced inside
  ``step()``, so the clipping happens there, by the global norm of the reduced sketches and
  gradients, from the partial sums the step already measures and all-reduces
  (:meth:`rgc.optim.SketchOptimizer.clip_at_step`): every rank clips by the same factor, with
  no extra collective and no host read. The returned norm is then a 0-dim tensor that
  ``step()`` fills in place: read it after the step (trainers log it after the step).
* A single-process optimizer under an initialised process group (sketches averaged by the
  caller with :func:`rgc.distributed.all_reduce_sketches`, or not at all) cannot know whether
  the local sketches are the averaged ones: clipping is declined there (one-time warning) and
  the norm returned is the local one.
"""

from __future__ import annotations

import math
import warnings

import torch

from rgc import ops
from rgc.optim import SketchOptimizer
from rgc.optim.rules import sketch_norm, sqrt32
from rgc.registry import sketched_owner_of
from rgc.updates import sum_squares

_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def unwrap_optimizer(optimizer) -> SketchOptimizer:
    """The rgc optimizer inside ``optimizer`` (accelerate's ``AcceleratedOptimizer`` and other
    wrappers keep it as ``.optimizer``); TypeError if there is none."""
    inner = optimizer
    for _ in range(4):
        if isinstance(inner, SketchOptimizer):
            return inner
        inner = getattr(inner, "optimizer", None)
    raise TypeError(f"expected an rgc optimizer (rgc.RGCOptimizer, rgc.RowAdam) or a wrapper of "
                    f"one, got {type(optimizer).__name__}")


def _pending(optimizer: SketchOptimizer):
    """``(tensor, layer or None)`` for every pending sketch and dense gradient of ``optimizer``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            layer = sketched_owner_of(p)
            if layer is not None and layer.sketch is not None:
                yield layer.sketch, layer
            elif p.grad is not None:
                yield p.grad, None


def _square_norm(tensor: torch.Tensor, layer) -> torch.Tensor:
    if layer is not None:
        return sketch_norm(tensor, layer.projection).square()
    return sum_squares(tensor)


@torch.no_grad()
def grad_norm(optimizer) -> torch.Tensor:
    """Total L2 norm of the gradient estimates the next ``step()`` uses. 0-dim FP32 tensor.

    For a compressed weight that is ``||C P^T||_F`` (from the r x r Gram ``P^T P``, no d x k
    temporary), for any other parameter ``||grad||``; 0 when nothing is pending. Under data
    parallel it is this rank's (the sketches are reduced inside ``step()``).
    """
    opt = unwrap_optimizer(optimizer)
    opt.sketch_norm_read = True  # the trainer-loop warning of SketchOptimizer.step is not due
    squares = [_square_norm(t, layer) for t, layer in _pending(opt)]
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    device = squares[0].device
    return sqrt32(ops.pairwise_sums(torch.stack([s.to(device) for s in squares])))


def _distributed() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def clip_grad_norm_(optimizer, max_norm: float) -> torch.Tensor:
    """Clip the pending gradient estimates of ``optimizer`` to ``max_norm`` (see module docs).

    Returns the total norm before clipping (0-dim FP32), like ``torch.nn.utils.clip_grad_norm_``;
    under a distributed optimizer the global norm, filled in by ``step()`` (module docs).
    ``max_norm`` of ``inf`` (or <= 0) only measures. Call it after backward, before ``step()``.
    """
    opt = unwrap_optimizer(optimizer)
    if opt.comm.exchanges:
        opt.sketch_norm_read = True
        if not opt.clips_gradients and max_norm is not None and 0 < max_norm < math.inf:
            _warn_normalised(opt, max_norm)
        return opt.clip_at_step(math.inf if max_norm is None or max_norm <= 0 else max_norm)
    total = grad_norm(opt)
    if max_norm is None or max_norm <= 0 or math.isinf(max_norm):
        return total
    if not opt.clips_gradients:
        _warn_normalised(opt, max_norm)
        return total
    if _distributed():
        _warn_once("dist", "gradient clipping is skipped: this optimizer has no communication "
                   "strategy, so the local sketches may not be the averaged ones a norm must "
                   "come from. Use rgc.DistributedRGCOptimizer / rgc.DistributedRowAdam, which "
                   "clip inside step() by the global norm. The logged grad_norm is this rank's.")
        return total
    factor = float(max_norm) / (float(total) + 1e-6)
    if factor < 1.0:
        for tensor, _ in _pending(opt):
            tensor.mul_(factor)
    return total


def _warn_normalised(opt: SketchOptimizer, max_norm: float) -> None:
    _warn_once("rgc", f"gradient clipping (max_norm={max_norm}) has no effect with "
               f"{type(opt).__name__}: its update is normalised (W <- W - lr ||W|| H / ||H||),"
               " so the step size is set by lr alone and clipping is skipped. Set "
               "max_grad_norm=0 to silence this warning; the logged grad_norm is ||H||.")

