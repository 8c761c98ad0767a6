"""The update rules as functions: partial sums and state tensors in, coefficients out.

As ``torch.optim.adamw.adamw`` is AdamW's arithmetic for the ``AdamW`` class, each function
here is one rule's arithmetic for a *stack*: M sketched weights of one shape and param group,
each a stack of E matrices (E = 1 for a 2-D weight; an expert stack has E > 1). It takes what
it reads of the weights' :class:`Partials` (sums over their elements, already summed over the
ranks that hold rows of them; RowAdam only the matrices they make active) and their state
tensors, and returns a :class:`Proposal`: the factors whose
product with ``P^T`` is the direction, and ``[M, E]`` coefficients. The optimizer class
collects the tensors, calls the function and hands the proposal to the step pipeline
(:mod:`rgc.optim.base`), which turns it into one :class:`rgc.updates.StackUpdate`.

Nothing here reads a tensor on the host: a matrix whose sketch is not finite (``finite``
false) gets coefficient 0 and ``active`` false, which leaves its weight bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rgc import ops

__all__ = ["Partials", "Proposal", "adamw_dense", "carry_moment", "decay_coefs", "normalized_coef",
           "normalize_rows_", "rgc_dense", "rgc_stack", "row_adam_stack", "sketch_momentum_",
           "sketch_norm", "sqrt32"]


@dataclass
class Partials:
    """The statistics a rule forms its coefficients from, over a weight's elements.

    ``finite`` is ``[M, E]`` bool (M parameters of E matrices each; a dense parameter is one
    ``1 x 1``): no non-finite value in the matrix's sketch or gradient. ``sums`` maps a name
    to an ``[M, E]`` FP32 tensor: ``sketch`` (``||C P^T||^2``), and when the rule asks for
    them ``weight`` (``||W||^2``) and, for a dense parameter, ``direction`` (``||grad||^2``).
    Every sum is additive over rows, so that a distributed step can complete the partial sums
    of row shards by summing them over the ranks (and ``finite`` by counting the ranks that
    saw a non-finite value).

    ``whole``: when this process updates only some of each weight's matrices (FSDP2's shard
    of an expert stack holds whole experts, not all of them), the same statistics of all of
    them (``[M, E_total]``), for a rule whose coefficient reads the whole stack; ``None``
    when the matrices here are all.
    """
    finite: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    whole: Partials | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def of_all_matrices(self) -> Partials:
        """The statistics of every matrix of each weight: ``whole``, else these."""
        return self if self.whole is None else self.whole


@dataclass
class Proposal:
    """A rule's update of a stack of M weights of E matrices each.

    ``factors``: the d x r factors (``[E, d, r]`` FP32 per weight) whose product with ``P^T``
    is the direction, or for a dense parameter its direction (the parameter's shape);
    ``coefs``: ``[M, E]`` FP32 (0-dim for a dense parameter), 0 where not ``active``;
    ``decays``: as ``coefs`` (decoupled weight decay, ``W <- W (1 - decay) - coef H``) or
    ``None``; ``active``: bool, the matrices that move; ``sq_norms``: ``None``, or an
    ``[M, E]`` FP32 tensor the apply fills with ``||W_new||^2`` for the next step.
    """
    factors: list[torch.Tensor] | torch.Tensor
    coefs: torch.Tensor
    decays: torch.Tensor | None
    active: torch.Tensor
    sq_norms: torch.Tensor | None = None


#: Elements of an FP32 sketch-sized tensor converted to float64 at once (:func:`carry_moment`,
#: :func:`normalize_rows_`).
FLOAT64_CHUNK = 1 << 16


# -- RGC: normalised SGD ----------------------------------------------------------------------

def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded FP32 square root of FP32 ``x``, so that its bits do not depend
    on the tensor's size: torch's CUDA kernel is; its CPU kernel is not in its vector loop,
    so there it goes through float64, whose 53 bits make the second rounding innocuous."""
    if x.device.type == "cuda":
        return x.sqrt()
    return x.double().sqrt().to(torch.float32)


def sketch_norm(sketch: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``||C P^T||_F`` from the r x r Gram ``P^T P`` without forming ``C P^T``. 0-dim FP32.

    ``||H||_F^2 = trace(C (P^T P) C^T)``; C: d x r FP32 (or a stack ``[E, d, r]``: the norm of
    the whole stack), P: k x r.
    """
    h2, _ = ops.sketch_stats([sketch.reshape(-1, *sketch.shape[-2:])], [projection])
    return sqrt32(ops.pairwise_sums(h2.view(-1)))


def normalized_coef(weight_sq_norm: torch.Tensor, direction_sq_norm: torch.Tensor, lr,
                    ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coef, active)`` on the device: ``coef = lr * sqrt(||W||^2 / ||H||^2)`` where
    ``active``, else 0.

    ``active = ok & (||H|| > 0) & (lr != 0)``; tensors of one shape (FP32, bool) or 0-dim,
    nothing read on the host.
    """
    active = ok & (direction_sq_norm > 0)
    if torch.is_tensor(lr) or lr == 0:
        active &= lr != 0
    return torch.where(active, sqrt32(weight_sq_norm / direction_sq_norm) * lr, 0.0), active


def rgc_stack(partials: Partials, sketches: list[torch.Tensor], *, lr, maximize: bool,
              expert_norm: str = "expert", weight_decay: float = 0.0) -> Proposal:
    """RGC's update of a stack: ``W <- W (1 - lr wd) - lr ||W|| H / ||H||``, ``H = C P^T``.

    ``partials``: ``sketch`` and ``weight`` sums (``[M, E]``); ``sketches``: the M weights'
    ``[E, d, r]`` FP32 sketches (the factors, unchanged); ``lr``: float or 0-dim FP32 tensor on
    the device. ``expert_norm='stack'`` gives all E matrices of a weight one coefficient from
    the norms of the whole stack (its finite matrices; ``partials.whole`` when only some are
    here); ``'expert'`` normalises each matrix
    by its own. ``weight_decay`` (``wd``) is decoupled, as AdamW's, and applied only to the
    matrices that move. The proposal asks for ``||W_new||^2`` (``sq_norms``).
    """
    h2, finite, w2 = partials["sketch"], partials.finite, partials["weight"]
    stack = partials.of_all_matrices()
    if stack.finite.shape[1] > 1 and expert_norm == "stack":
        coef, _ = normalized_coef(
            ops.pairwise_sums(stack["weight"]).unsqueeze(1),
            ops.pairwise_sums(torch.where(stack.finite, stack["sketch"], 0.0)).unsqueeze(1),
            lr, stack.finite.any(1, keepdim=True))
        active = finite & (h2 > 0)
        coefs = torch.where(active, coef, 0.0)
    else:
        coefs, active = normalized_coef(w2, h2, lr, finite)
    if maximize:
        coefs = -coefs
    return Proposal(sketches, coefs, decay_coefs(lr, weight_decay, active), active,
                    sq_norms=torch.empty_like(w2))


def rgc_dense(partials: Partials, grad: torch.Tensor, *, lr, maximize: bool,
              weight_decay: float = 0.0) -> Proposal:
    """RGC's normalised rule for a parameter with a dense gradient: ``partials`` has
    ``weight`` and ``direction`` (``1 x 1``); the direction is ``grad`` itself."""
    coef, active = normalized_coef(partials["weight"].reshape(()),
                                   partials["direction"].reshape(()), lr,
                                   partials.finite.reshape(()))
    return Proposal(grad, -coef if maximize else coef, decay_coefs(lr, weight_decay, active),
                    active)


def sketch_momentum_(sketches: list[torch.Tensor], buffers: list[torch.Tensor], *,
                     momentum: float, nesterov: bool) -> None:
    """Heavy-ball momentum in sketch space, in place: for every matrix (``[E, d, r]`` FP32
    sketches ``C`` and momentum buffers ``M`` of one shape)::

        M <- momentum * M + C
        C <- M                          (or C + momentum * M with ``nesterov``)

    With a fixed projection, ``M P^T`` is exactly the momentum of the projected gradients
    ``G P P^T``. A matrix whose sketch is not finite, or is all zero (an expert that received
    no token), keeps both: its sketch then still reads as skipped (or empty) to the rule.
    Products and sums are separate FP32 roundings, so the bits do not depend on the CPU's
    vector width.
    """
    for sketch, buffer in zip(sketches, buffers, strict=True):
        flat = sketch.flatten(1)
        moves = (torch.isfinite(flat).all(1) & (flat != 0).any(1)).view(-1, 1, 1)
        carried = buffer.mul(momentum).add_(sketch)
        buffer.copy_(torch.where(moves, carried, buffer))
        direction = sketch.add(carried.mul_(momentum)) if nesterov else carried
        sketch.copy_(torch.where(moves, direction, sketch))
        del carried, direction  # before the next matrix's


def normalize_rows_(sketches: list[torch.Tensor], projections: list[torch.Tensor]) -> None:
    """Divide every row of each sketch by the norm of its row of ``H``, in place::

        C[i] <- C[i] / ||C[i] P^T||,   ||C[i] P^T||^2 = C[i] (P^T P) C[i]^T

    so that every row of ``H = C P^T`` has norm 1 (a zero row stays zero; a non-finite one
    stays non-finite, and reads as skipped). ``sketches``: ``[E, d, r]`` FP32; ``projections``:
    their ``k x r`` P. The quadratic form is summed in float64 (:data:`FLOAT64_CHUNK` elements
    at a time) and its square root rounded once to FP32, so a row's bits do not depend on the
    rows given with it or on the CPU.
    """
    for sketch, projection in zip(sketches, projections, strict=True):
        p = projection.to(torch.float64)
        gram = p.t() @ p
        del p
        r = sketch.shape[-1]
        rows = sketch.reshape(-1, r)
        norms = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=sketch.device)
        step = max(1, FLOAT64_CHUNK // max(r, 1))
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step].to(torch.float64)
            norms[start:start + step] = ((part @ gram) * part).sum(1, keepdim=True).sqrt()
            del part  # before the next chunk's
        norms = norms.view(*sketch.shape[:-1], 1)
        sketch.copy_(torch.where(norms > 0, sketch / norms, sketch))


# -- RowAdam: Adam with one second moment per row of the sketch -------------------------------

def decay_coefs(lr, weight_decay: float, active: torch.Tensor) -> torch.Tensor | None:
    """Decoupled weight decay ``lr * weight_decay`` where ``active``, else 0 (FP32 on
    ``active``'s device); ``None`` when ``weight_decay == 0``.

    A tensor ``lr`` gives the bits of the float: the product is formed in float64 and rounded
    once to FP32, as Python's product is."""
    if weight_decay == 0.0:
        return None
    if torch.is_tensor(lr):
        lr = lr.detach().reshape(()).to(device=active.device, dtype=torch.float64)
        decay = (lr * weight_decay).to(torch.float32)
    else:
        decay = lr * weight_decay
    return torch.where(active, decay, 0.0)


def adam_coefs(lr, weight_decay: float, ok: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(coef, decay)``: ``lr`` where ``ok``, else 0, and :func:`decay_coefs` (device)."""
    coef = lr.detach().reshape(()).to(device=ok.device, dtype=torch.float32) \
        if torch.is_tensor(lr) else lr
    return torch.where(ok, coef, 0.0), decay_coefs(lr, weight_decay, ok)


def row_adam_stack(sketches: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor],
                   steps: torch.Tensor, active: torch.Tensor, *, lr, betas: tuple[float, float],
                   eps: float, weight_decay: float, maximize: bool) -> Proposal:
    """RowAdam's update of a stack (LoGRA's rule), moments updated in place::

        m <- beta1 m + (1 - beta1) S,   v <- beta2 v + (1 - beta2) mean_j S[:, j]^2
        U = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
        W <- W (1 - lr * weight_decay) - lr * U P^T

    ``sketches``: ``[E, d, r]`` FP32 each, overwritten with ``U`` (the factors);
    ``exp_avgs`` ``[E, d, r]`` and ``exp_avg_sqs`` ``[E, d]`` FP32 views of the moments;
    ``steps``: ``[M, E]`` int64, t counting this update; ``active``: ``[M, E]`` bool, the
    matrices whose moments move (from the partial sums: a finite sketch, and for experts a
    non-zero one; see :func:`rgc.ops.row_adam_`).
    """
    beta1, beta2 = betas
    ops.row_adam_(sketches, exp_avgs, exp_avg_sqs, active, steps, beta1, beta2, eps, maximize)
    coefs, decays = adam_coefs(lr, weight_decay, active)
    return Proposal(sketches, coefs, decays, active)


def adamw_dense(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                ok: torch.Tensor, t: torch.Tensor, *, lr, betas: tuple[float, float],
                eps: float, weight_decay: float, maximize: bool) -> Proposal:
    """Elementwise AdamW for a parameter with a dense gradient: updates ``exp_avg`` and
    ``exp_avg_sq`` (FP32, the parameter's shape) from ``grad`` where ``ok`` (0-dim bool; they
    are kept elsewhere) and proposes the direction (not finite where ``ok`` is false: its
    coefficient is then 0). ``t``: the applied-update count, 0-dim float64."""
    beta1, beta2 = betas
    g = (-grad if maximize else grad).to(torch.float32)
    exp_avg.copy_(torch.where(ok, exp_avg.mul(beta1).add_(g, alpha=1.0 - beta1), exp_avg))
    exp_avg_sq.copy_(torch.where(ok, exp_avg_sq.mul(beta2).add_(g.square(), alpha=1.0 - beta2),
                                 exp_avg_sq))
    # bias corrections formed in float64 (as Python's beta ** t was) and used in FP32
    correction1 = (1.0 - beta1 ** t).to(torch.float32)
    correction2 = (1.0 - beta2 ** t).to(torch.float32)
    denom = (exp_avg_sq / correction2).sqrt_().add_(eps)
    direction = torch.div(exp_avg, correction1).div_(denom)
    coef, decay = adam_coefs(lr, weight_decay, ok)
    return Proposal(direction, coef, decay, ok)


def carry_moment(moment: torch.Tensor, old_projection: torch.Tensor,
                 new_projection: torch.Tensor) -> torch.Tensor:
    """A first moment ``m`` (d x r FP32) in the basis of ``old_projection`` moved to the new one.

    ``m`` estimates ``G P_old``; the least-squares estimate of ``G`` within the old basis is
    ``m (P_old^T P_old)^+ P_old^T``, and its sketch in the new basis is::

        m_new = m (P_old^T P_old)^+ P_old^T P_new

    which is ``m P_old^T P_new / (k/r)`` for the scaled orthonormal kind and ``m`` itself when
    ``P_new = P_old``. Only r x r matrices are formed (in float64); returns a new FP32 tensor of
    ``m``'s shape (``[..., d, r]``).

    The product with ``m`` is formed in float64, :data:`FLOAT64_CHUNK` elements of ``m`` at a
    time, and rounded once to FP32: an FP32 GEMM's bits depend on how many rows it is given
    (MKL, on AVX2 and AVX-512 alike), so a rank's shard of ``m`` would otherwise not carry as
    the same rows of the whole ``m`` do; in float64 the order of the r products moves the FP32
    result only at a rounding tie.
    """
    old = old_projection.to(torch.float64)
    transfer = torch.linalg.pinv(old.t() @ old) @ (old.t() @ new_projection.to(torch.float64))
    del old
    r = moment.shape[-1]
    rows = moment.reshape(-1, r)
    out = torch.empty(moment.shape, dtype=torch.float32, device=moment.device)
    flat = out.view(-1, r)
    step = max(1, FLOAT64_CHUNK // max(r, 1))
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step].to(torch.float64)
        flat[start:start + step] = part @ transfer
        del part  # before the next chunk's
    return out
