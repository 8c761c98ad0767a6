"""RowAdam: Adam-style scaling per row of the sketch (LoGRA's update rule)."""

from __future__ import annotations

import math

import torch

from rgc import ops
from rgc.optim.base import Partials, SketchOptimizer, check_common_args
from rgc.updates import DenseUpdate, StackUpdate


def check_adam_args(betas, eps, weight_decay) -> None:
    """ValueError for bad ``betas``, ``eps`` or ``weight_decay`` (as torch.optim.AdamW takes)."""
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if (not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay)
            or weight_decay < 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def carry_moment(moment: torch.Tensor, old_projection: torch.Tensor,
                 new_projection: torch.Tensor) -> torch.Tensor:
    """A first moment ``m`` (d x r FP32) in the basis of ``old_projection`` moved to the new one.

    ``m`` estimates ``G P_old``; the least-squares estimate of ``G`` within the old basis is
    ``m (P_old^T P_old)^+ P_old^T``, and its sketch in the new basis is::

        m_new = m (P_old^T P_old)^+ P_old^T P_new

    which is ``m P_old^T P_new / (k/r)`` for the scaled orthonormal kind and ``m`` itself when
    ``P_new = P_old``. Only r x r matrices are formed (in float64); returns a new d x r FP32.
    """
    old = old_projection.to(torch.float64)
    transfer = torch.linalg.pinv(old.t() @ old) @ (old.t() @ new_projection.to(torch.float64))
    return moment @ transfer.to(torch.float32)


class RowAdam(SketchOptimizer):
    """Adam with one second moment per row of the sketch, for rgc-compressed weights.

    For every weight W (d x k) of a :class:`rgc.CompressedLinear` with sketch ``S = C``
    (d x r FP32) and projection ``P`` (k x r), at its ``t``-th applied update::

        m <- beta1 m + (1 - beta1) S                               (d x r, FP32)
        v <- beta2 v + (1 - beta2) mean_j S[:, j]^2                (d,     FP32)
        U = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)   (row i divided by its scale)
        W <- W (1 - lr * weight_decay) - lr * U P^T

    The weight decay is decoupled (AdamW-style) and folded into the update's one rounded
    write. The moments of all the weights of one shape are updated, and ``U`` written into
    their sketches, by one :func:`rgc.ops.row_adam_` call; ``U P^T`` is rebuilt by
    :func:`rgc.ops.lowrank_update_` (never a d x k temporary beyond ``chunk_rows`` rows) with
    the rounding bits of :class:`rgc.RGCOptimizer`. Every element of ``U P^T`` has size about
    1, so ``lr`` means what it means for Adam.

    **Experts.** A stack of E expert matrices (a 3-D weight) keeps ``m`` ``E x d x r`` and
    ``v`` ``E x d``, and counts each expert's applied updates (its ``t``) in
    ``state['expert_updates']``: an expert whose sketch is zero received no token and is not
    updated.

    **Projection refresh.** When the layer's schedule gives a new ``P``, ``m`` is carried into
    the new basis with :func:`carry_moment` (``m <- m (P_old^T P_old)^+ P_old^T P_new``); ``v``
    is kept, since a per-row mean square does not depend on the basis in expectation. With the
    LoGRA default (``refresh='never'``) nothing changes.

    **Other parameters** with an ordinary ``.grad`` (biases, norms, if left trainable) get plain
    elementwise AdamW with the same hyperparameters (``m``, ``v`` of the parameter's shape,
    FP32) and the same rounded write.

    A non-finite sketch or gradient skips the update (moments untouched, weight unchanged,
    ``state[p]['skipped']`` counts it); ``t`` counts applied updates (``step - skipped``).
    ``step()`` decides this on the device (selects, coefficients 0) and reads nothing on the
    host; :meth:`skipped_updates` reads the counts.

    Args:
        params: parameters or param groups (as torch.optim).
        lr: step size (Adam's): a float or a 0-dim tensor (used on the device, never read on
            the host).
            Default 1e-3, as ``torch.optim.Adam``.
        betas, eps, weight_decay: as ``torch.optim.AdamW``.
        chunk_rows: rows of ``U P^T`` rebuilt at once on the reference path; ``None``
            (default): ``max(128, 2^18 // k)``, as :class:`rgc.RGCOptimizer`.
        stochastic_rounding: round BF16 weights stochastically (default) or to nearest.
        seed: key of the rounding bits.
        step_control: e.g. :class:`rgc.PredictedKL`; scales each step's updates by one alpha.
        keep_updates: keep the last step's factors for :meth:`export_update` (policy sync).
        maximize: ascend the objective: the moments are fed ``-S`` (``-grad``), as
            ``torch.optim.AdamW(maximize=True)`` does; weight decay still shrinks W.

    **Dtypes.** Moments are FP32 and the arithmetic is FP32 whatever the parameter's dtype:
    BF16 weights are written with stochastic rounding, an FP64 parameter receives an
    FP32-computed value each step (precision beyond FP32 is lost), an FP16 one is rounded to
    nearest. Complex parameters are refused at construction.

    State per compressed weight: ``exp_avg`` (d x r FP32), ``exp_avg_sq`` (d FP32), step
    counters, layer seed and projection version; ``state_dict`` round-trips bit-exactly.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, chunk_rows: int | None = None,
                 stochastic_rounding: bool = True, seed: int = 0, step_control=None,
                 keep_updates: bool = False, maximize: bool = False):
        check_common_args(lr, chunk_rows, seed)
        check_adam_args(betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding, seed=seed,
                        maximize=maximize)
        super().__init__(params, defaults, step_control=step_control, keep_updates=keep_updates)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_adam_args(group["betas"], group["eps"], group["weight_decay"])

    @staticmethod
    def _moments(state: dict, group: dict, grad: torch.Tensor, ok: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """Elementwise Adam for a dense parameter: update ``exp_avg``/``exp_avg_sq`` from
        ``grad`` where ``ok`` (0-dim bool; the moments are selected unchanged elsewhere) and
        return the direction (not finite where ``ok`` is false: its coefficient is then 0).
        ``t``: the applied-update count, 0-dim float64."""
        beta1, beta2 = group["betas"]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = grad.to(torch.float32)
        m.copy_(torch.where(ok, m.mul(beta1).add_(g, alpha=1.0 - beta1), m))
        v.copy_(torch.where(ok, v.mul(beta2).add_(g.square(), alpha=1.0 - beta2), v))
        # bias corrections formed in float64 (as Python's beta ** t was) and used in FP32
        correction1 = (1.0 - beta1 ** t).to(torch.float32)
        correction2 = (1.0 - beta2 ** t).to(torch.float32)
        denom = (v / correction2).sqrt_().add_(group["eps"])
        return torch.div(m, correction1).div_(denom)

    @staticmethod
    def _coefs(group: dict, ok: torch.Tensor):
        """``(coef, decay)``: ``lr`` and ``lr * weight_decay`` where ``ok``, else 0 (device;
        ``decay`` is ``None`` when ``weight_decay == 0``).

        A tensor ``lr`` gives the bits of the float: ``lr * weight_decay`` is formed in float64
        and rounded once to FP32, as Python's product is."""
        lr, wd = group["lr"], group["weight_decay"]
        if torch.is_tensor(lr):
            lr = lr.detach().reshape(()).to(device=ok.device, dtype=torch.float64)
            decay = (lr * wd).to(torch.float32)
            lr = lr.to(torch.float32)
        else:
            decay = lr * wd
        decay = torch.where(ok, decay, 0.0) if wd != 0.0 else None
        return torch.where(ok, lr, 0.0), decay

    def _stack_partials(self, entries, group) -> Partials:
        owners = [e.owner for e in entries]
        h2, finite = ops.sketch_stats([o.sketch_matrices() for o in owners],
                                      [o.projection for o in owners])
        return Partials.of(finite, sketch=h2)

    def _propose_stack(self, entries, group, partials) -> StackUpdate:
        owners = [e.owner for e in entries]
        sketches = [o.sketch_matrices() for o in owners]
        h2, finite = partials["sketch"], partials.finite
        active = self._active(entries, finite, h2)
        steps = self._applied_updates(entries, active)
        exp_avgs, exp_avg_sqs = zip(*(self._row_moments(e.state, s, e.param.dim() == 2)
                                      for e, s in zip(entries, sketches, strict=True)))
        beta1, beta2 = group["betas"]
        ops.row_adam_(sketches, list(exp_avgs), list(exp_avg_sqs), active, steps, beta1, beta2,
                      group["eps"], group["maximize"])
        coefs, decays = self._coefs(group, active)
        return self._stack_update(entries, group, sketches, coefs, decays, active)

    @staticmethod
    def _active(entries, finite: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        """``[M, E]`` bool, the matrices whose moments move: a finite sketch, and for experts
        (E > 1, or a 3-D weight) one that is not zero (an expert that received no token)."""
        experts = [e.param.dim() != 2 for e in entries]
        if not any(experts):
            return finite
        received = h2 > 0
        if not all(experts):
            received |= ~torch.tensor(experts, device=h2.device).view(-1, 1)
        return finite & received

    @staticmethod
    def _applied_updates(entries, active: torch.Tensor) -> torch.Tensor:
        """``[M, E]`` int64: t, the updates applied so far counting this one. A 2-D weight's
        is ``step - skipped``; an expert stack counts its own per expert in
        ``state['expert_updates']`` (incremented here where active). A few grouped ops
        whatever M."""
        flat = [i for i, e in enumerate(entries) if e.param.dim() == 2]
        rows: list = [None] * len(entries)
        if flat:
            skipped = torch.stack([entries[i].state["skipped"] for i in flat])
            steps = {entries[i].state["step"] for i in flat}
            if len(steps) > 1:  # weights that missed steps: the counts travel as a table
                steps = torch.tensor([entries[i].state["step"] for i in flat], dtype=torch.int64)
                if skipped.device.type != "cpu":
                    steps = steps.pin_memory()
                steps = steps.to(skipped.device, non_blocking=True)
            else:
                steps = steps.pop()
            t = steps - skipped
            for j, i in enumerate(flat):
                rows[i] = t[j].reshape(1)
        stacked = [i for i, e in enumerate(entries) if e.param.dim() != 2]
        if stacked:
            for i in stacked:
                if "expert_updates" not in entries[i].state:
                    entries[i].state["expert_updates"] = torch.zeros(
                        active.shape[1], dtype=torch.int64, device=active.device)
            counts = [entries[i].state["expert_updates"] for i in stacked]
            applied = active.to(torch.int64)
            torch._foreach_add_(counts, [applied[i] for i in stacked])
            for i, c in zip(stacked, counts, strict=True):
                rows[i] = c
        return torch.stack(rows)

    @staticmethod
    def _row_moments(state: dict, sketch: torch.Tensor, flat: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m [E, d, r], v [E, d])``: views of ``state['exp_avg']`` (``d x r`` for a 2-D
        weight, ``flat``; ``E x d x r`` for a stack) and ``state['exp_avg_sq']`` (``d``,
        ``E x d``), zeros at first."""
        if "exp_avg" not in state:
            shape = sketch.shape[1:] if flat else sketch.shape
            state["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=sketch.device)
            state["exp_avg_sq"] = torch.zeros(shape[:-1], dtype=torch.float32,
                                              device=sketch.device)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        return (m, v) if m.dim() == 3 else (m.unsqueeze(0), v.unsqueeze(0))

    def _propose_dense(self, p, group, state, seed, ok, partials) -> DenseUpdate:
        grad = -p.grad if group["maximize"] else p.grad
        t = (state["step"] - state["skipped"]).to(torch.float64)
        direction = self._moments(state, group, grad, ok, t)
        coef, decay = self._coefs(group, ok)
        return DenseUpdate(p, direction, coef, 0.0 if decay is None else decay, seed,
                           group["stochastic_rounding"], ok)

    def _refresh_projections(self, entries) -> None:
        carried = [(e, e.owner.projection.clone()) for e in entries if "exp_avg" in e.state]
        super()._refresh_projections(entries)
        for e, old in carried:
            e.state["exp_avg"] = carry_moment(e.state["exp_avg"], old, e.owner.projection)
