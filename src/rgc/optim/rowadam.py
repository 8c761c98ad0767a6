"""RowAdam: Adam-style scaling per row of the sketch (LoGRA's update rule)."""

from __future__ import annotations

import math

import torch

from rgc.optim.base import (
    SketchOptimizer,
    check_common_args,
    check_weight_decay,
    stack_state,
)
from rgc.optim.rules import Proposal, adamw_dense, row_adam_stack


def check_adam_args(betas, eps, weight_decay) -> None:
    """ValueError for bad ``betas``, ``eps`` or ``weight_decay`` (as torch.optim.AdamW takes)."""
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    check_weight_decay(weight_decay)


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
        comm: the communication strategy (``None``: one process); see
            :class:`rgc.DistributedRowAdam` for ``torch.distributed``.
        maximize: ascend the objective: the moments are fed ``-S`` (``-grad``), as
            ``torch.optim.AdamW(maximize=True)`` does; weight decay still shrinks W.

    **Dtypes.** Moments are FP32 and the arithmetic is FP32 whatever the parameter's dtype:
    BF16 weights are written with stochastic rounding, an FP64 parameter receives an
    FP32-computed value each step (precision beyond FP32 is lost), an FP16 one is rounded to
    nearest. Complex parameters are refused at construction.

    State per compressed weight: ``exp_avg`` (d x r FP32), ``exp_avg_sq`` (d FP32), step
    counters, layer seed and projection version; ``state_dict`` round-trips bit-exactly.
    """

    carried_in_sketch_space = ("exp_avg",)

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, chunk_rows: int | None = None,
                 stochastic_rounding: bool = True, seed: int = 0, step_control=None,
                 keep_updates: bool = False, maximize: bool = False, comm=None):
        check_common_args(lr, chunk_rows, seed)
        check_adam_args(betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding, seed=seed,
                        maximize=maximize)
        super().__init__(params, defaults, step_control=step_control, keep_updates=keep_updates,
                         comm=comm)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_adam_args(group["betas"], group["eps"], group["weight_decay"])

    def _propose_stack(self, entries, group, partials) -> Proposal:
        sketches = [e.owner.sketch_matrices() for e in entries]
        active = self._active(entries, partials.finite, partials["sketch"])
        steps = self._applied_updates(entries, active)
        flat = [e.param.dim() == 2 for e in entries]
        # m [E, d, r] and v [E, d] of each weight (d x r and d stored for a 2-D weight)
        exp_avgs = [stack_state(e.state, "exp_avg", s, f)
                    for e, s, f in zip(entries, sketches, flat, strict=True)]
        exp_avg_sqs = [stack_state(e.state, "exp_avg_sq", s, f, per_row=True)
                       for e, s, f in zip(entries, sketches, flat, strict=True)]
        return row_adam_stack(sketches, exp_avgs, exp_avg_sqs, steps,
                              active, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"], maximize=group["maximize"])

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

    def _propose_dense(self, entry, partials) -> Proposal:
        p, state, group = entry.param, entry.state, entry.group
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p.grad, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.grad.shape, dtype=torch.float32,
                                              device=p.grad.device)
        t = (state["step"] - state["skipped"]).to(torch.float64)
        return adamw_dense(p.grad, state["exp_avg"], state["exp_avg_sq"],
                           partials.finite.reshape(()), t, lr=group["lr"], betas=group["betas"],
                           eps=group["eps"], weight_decay=group["weight_decay"],
                           maximize=group["maximize"])
