"""RGCOptimizer: normalised SGD from rank-r sketches, no optimizer state per element."""

from __future__ import annotations

import torch

from rgc.optim.base import (
    SketchOptimizer,
    check_common_args,
    check_weight_decay,
    group_lr,
    stack_state,
)
from rgc.optim.rules import (
    Partials,
    Proposal,
    normalize_rows_,
    rgc_dense,
    rgc_stack,
    sketch_momentum_,
)

EXPERT_NORMS = ("stack", "expert")


def check_expert_norm(expert_norm) -> None:
    if expert_norm not in EXPERT_NORMS:
        raise ValueError(f"expert_norm must be one of {EXPERT_NORMS}, got {expert_norm!r}")


def check_direction_options(momentum, nesterov, row_norm) -> None:
    """ValueError for a ``momentum`` outside [0, 1), ``nesterov`` without momentum, or a
    ``row_norm`` that is not a bool."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
            or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs a momentum > 0 (as torch.optim.SGD)")
    if not isinstance(row_norm, bool):
        raise ValueError(f"row_norm must be True or False, got {row_norm!r}")


class RGCOptimizer(SketchOptimizer):
    """Randomized gradient compression: normalised SGD on sketched weights.

    For every weight of a :class:`rgc.CompressedLinear` with a sketch ``C`` (d x r FP32) and
    projection ``P`` (k x r)::

        H = C P^T                                   (rebuilt chunk_rows rows at a time)
        W <- W (1 - lr wd) - lr * ||W||_F * H / ||H||_F   (||H||_F from the Gram P^T P)

    written with stochastic rounding when W is BF16 (unbiased, counter-based bits keyed by
    ``(seed, parameter index, step)``) and with plain arithmetic when W is FP32. Then ``P`` is
    refreshed per the layer's schedule and ``C`` is cleared. Any other parameter with a dense
    ``.grad`` gets the same normalised rule from its gradient (a parameter that is exactly zero,
    such as a fresh bias, therefore never moves: put it in a torch optimizer instead).

    There is no state per element: per parameter a step count, the layer's seed and projection
    version (Python ints), a device counter of skipped updates, and for a compressed weight
    ``weight_sq_norm``, ``||W||_F^2`` (0-dim FP32) of the values the last update stored: the
    update produces it, so the next step does not read W again to get ``||W||``. It is saved in
    the state dict (a resumed run uses the same bits); after W is written by anything else it
    is recomputed from W. ``step()`` reads nothing on the host: a non-finite sketch or gradient
    makes the coefficient 0 on the device, which leaves the weight bit-identical, and
    increments ``state[p]['skipped']``; :meth:`skipped_updates` reads the counts (and warns
    once when one is non-zero).

    Args:
        params: iterable of parameters or param groups (as torch.optim).
        lr: ``tau``, the relative step ``||dW|| / ||W||``; see :func:`rgc.calibrate_lr`. A float
            or a 0-dim tensor (used on the device, never read on the host, so a scheduler may
            fill it in place). Default 1e-3, torch.optim's default, for param groups that set
            their own.
        chunk_rows: rows of H rebuilt at once on the reference path (memory: chunk_rows x k
            FP32); ``None`` (default): ``max(128, 2^18 // k)``, at least 128 rows and 1 MiB.
        stochastic_rounding: round BF16 weights stochastically (default) or to nearest.
        seed: key of the rounding bits.
        step_control: e.g. :class:`rgc.PredictedKL`; scales each step's updates by one alpha.
        keep_updates: keep the last step's factors for :meth:`export_update` (policy sync).
        comm: the communication strategy (``None``: one process); see
            :class:`rgc.DistributedRGCOptimizer` for ``torch.distributed``.
        maximize: step along ``+H`` (ascend the objective) instead of ``-H``.
        expert_norm: the normalisation of a stack of experts (a 3-D expert weight):
            ``'expert'`` (default) normalises every expert by its own norms, so every expert
            that received tokens moves by ``lr`` relative to its own size; ``'stack'`` takes
            ``||W||`` and ``||H||`` of the whole stack, one coefficient for all its experts
            (normalised SGD on the tensor: a busy expert moves more than a rarely routed one).
            Measured on a tiny Qwen3-MoE at equal ``lr`` (``benchmarks/moe_expert_norm.py``):
            'expert' reached a lower held-out loss in 6 of 6 runs (3 seeds x 2 batch sizes,
            by 0.0003 to 0.017 nats). An expert that received no token (``C_e = 0``) is not
            updated under either rule: its bits are kept.
        weight_decay: decoupled weight decay, as ``torch.optim.AdamW``'s: each step multiplies
            W by ``1 - lr * weight_decay`` in the same rounded write as the update (so with
            ``lr = tau`` the decay per step is ``tau * weight_decay``), for the matrices that
            move this step (a finite, non-zero sketch or gradient); with ``maximize`` it still
            shrinks W. Default 0 (RGC's rule keeps ``||W||``'s scale by itself; trainers such as
            verl pass a ``weight_decay`` to every optimizer).
        momentum: the momentum of the sketches (see **Momentum**); default 0 (none).
        nesterov: Nesterov's variant of that momentum (as ``torch.optim.SGD``'s).
        row_norm: give every row of the direction the same norm (see **Rows**); default False.

    **Dtypes.** Weights of compressed layers are BF16 or FP32. Any other real parameter is
    updated with FP32 arithmetic: an FP64 parameter receives an FP32-computed value each step
    (precision beyond FP32 is lost), an FP16 one is written with round-to-nearest. Complex
    parameters are refused at construction.

    **Momentum** (``momentum > 0``): the direction of a sketched weight is built from a
    momentum buffer ``M`` in sketch space (d x r FP32, ``state['momentum_buffer']``; ``E x d
    x r`` for an expert stack) instead of the step's sketch alone (:func:`rgc.optim.rules.
    sketch_momentum_`)::

        M <- momentum * M + C,   H = M P^T    (Nesterov: H = (C + momentum * M) P^T)

    then normalised as above. With a fixed projection (``refresh='never'`` or every N
    updates) this is exactly heavy-ball momentum on the projected gradient; when ``P`` is
    refreshed, ``M`` is carried into the new basis by the r x r change of basis
    (:func:`rgc.optim.rules.carry_moment`), which keeps only its part in the span of the
    new ``P``: with a new ``P`` every step most of it is lost, so use momentum with a
    projection refreshed every N updates. A matrix whose sketch is not finite or all zero
    (an expert that received no token) keeps its buffer and does not move. Dense parameters
    take the normalised rule on their gradient without momentum. Costs one d x r FP32 tensor
    per sketched weight.

    **Rows** (``row_norm=True``): before the normalisation above, every row of the direction's
    sketch is divided by the norm of its row of ``H`` (from the Gram ``P^T P``; after the
    momentum, if any: :func:`rgc.optim.rules.normalize_rows_`), so that every row of W that
    has a gradient moves by the same amount, ``tau ||W||_F / sqrt(rows)``: a per-row scale
    estimated from the sketch, with no state.

    ``zero_grad()`` clears sketches as well as gradients. A backward must complete before
    ``step()``: a forward run before a step and backpropagated after it raises.
    """

    reads_norms = True
    clips_gradients = False  # the update is normalised: scaling H changes nothing
    carried_in_sketch_space = ("momentum_buffer",)

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, *, chunk_rows: int | None = None,
                 stochastic_rounding: bool = True, seed: int = 0, step_control=None,
                 keep_updates: bool = False, maximize: bool = False,
                 expert_norm: str = "expert", weight_decay: float = 0.0,
                 momentum: float = 0.0, nesterov: bool = False, row_norm: bool = False,
                 comm=None):
        check_common_args(lr, chunk_rows, seed)
        check_expert_norm(expert_norm)
        check_weight_decay(weight_decay)
        check_direction_options(momentum, nesterov, row_norm)
        defaults = dict(lr=lr, chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding,
                        seed=seed, maximize=maximize, expert_norm=expert_norm,
                        weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        row_norm=row_norm)
        super().__init__(params, defaults, step_control=step_control, keep_updates=keep_updates,
                         comm=comm)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_expert_norm(group["expert_norm"])
        check_weight_decay(group["weight_decay"])
        check_direction_options(group.setdefault("momentum", 0.0),
                                group.setdefault("nesterov", False),
                                group.setdefault("row_norm", False))

    def _stack_sums(self, entries) -> Partials:
        """With momentum or ``row_norm``, the step's direction replaces each sketch before it
        is measured."""
        group = entries[0].group
        sketches = [e.owner.sketch_matrices() for e in entries]
        if group.get("momentum", 0.0):  # a group saved before these options has none
            buffers = [stack_state(e.state, "momentum_buffer", s, e.param.dim() == 2)
                       for e, s in zip(entries, sketches, strict=True)]
            sketch_momentum_(sketches, buffers, momentum=group["momentum"],
                             nesterov=group.get("nesterov", False))
        if group.get("row_norm", False):
            normalize_rows_(sketches, [e.owner.projection for e in entries])
        return super()._stack_sums(entries)

    def _propose_stack(self, entries, group, partials) -> Proposal:
        return rgc_stack(partials, [e.owner.sketch_matrices() for e in entries],
                         lr=group_lr(group, partials.finite.device), maximize=group["maximize"],
                         expert_norm=group["expert_norm"], weight_decay=group["weight_decay"])

    def _propose_dense(self, entry, partials) -> Proposal:
        p, group = entry.param, entry.group
        return rgc_dense(partials, p.grad, lr=group_lr(group, p.device),
                         maximize=group["maximize"], weight_decay=group["weight_decay"])
