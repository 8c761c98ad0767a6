"""Update records and the functions that apply them: shared by the optimizers and policy sync.

An optimizer step proposes one :class:`StackUpdate` per group of sketched weights that share
a shape (every matrix of the group is updated by one :func:`rgc.ops.lowrank_update_` call,
one kernel launch on the Triton path) and one :class:`DenseUpdate` per other parameter, then
applies them. A sync receiver (:func:`rgc.apply_update`) rebuilds each weight's update from a
payload and applies it with the same op, one weight at a time: a matrix's result does not
depend on the company it is updated in, so its weights match the trainer's bit for bit.

Coefficients live on the device. ``coefs`` and ``decays`` are FP32 tensors on the weights'
device; nothing here reads them on the host, and a zero coefficient (with a zero decay)
leaves the matrix bit-identical (a select, not arithmetic with 0), so an optimizer skips a
weight with a non-finite sketch by setting its coefficients to 0 on the device instead of
testing the sketch on the host. Python floats are converted to FP32 the same way, so a
trainer's tensor coefficient and a receiver's float copy of it give the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rgc import ops

Scalar = float | torch.Tensor

#: The reference path's default chunk of H, ``chunk_rows=None``: at least 128 rows, and at
#: least this many elements (1 MiB of FP32), so that a narrow matrix is not rebuilt in chunks
#: too small to amortise the per-chunk calls (measured on a 2-core CPU: 128-row chunks of
#: k = 512 matrices made the step 1.3x slower than 512-row ones).
CHUNK_ELEMENTS = 1 << 18


def default_chunk_rows(k: int) -> int:
    """Rows of a d x k weight's H rebuilt at once by default: ``max(128, 2^18 // k)``."""
    return max(128, CHUNK_ELEMENTS // max(k, 1))


def resolve_chunk_rows(chunk_rows: int | None, k: int) -> int:
    """``chunk_rows`` as given, or :func:`default_chunk_rows` of ``k`` for ``None``."""
    return default_chunk_rows(k) if chunk_rows is None else chunk_rows


@dataclass
class LowRankUpdate:
    """One sketched weight's share of a :class:`StackUpdate`, for step control and sync.

    ``W_e <- W_e (1 - decay_e) - coef_e U_e P^T`` for every matrix ``e`` of ``param`` (one for
    a 2-D weight). ``factor`` is U in the owner's sketch shape (d x r, or E x d x r), ``coef``
    and ``decay`` 0-dim (2-D weight) or ``[E]`` FP32 tensors (``decay`` may be the float 0),
    ``active`` likewise bool: false where there is no update (non-finite sketch, zero
    direction), with coefficients 0. Views of the stack's tensors.
    """

    param: torch.Tensor
    layer: object  # the owner, a rgc.sketched.SketchedWeight
    factor: torch.Tensor
    coef: Scalar
    decay: Scalar
    seed: int
    chunk_rows: int
    stochastic_rounding: bool
    active: bool | torch.Tensor = True


@dataclass
class StackUpdate:
    """The low-rank updates of ``M`` sketched weights of one shape, applied in one op call.

    For member ``m`` (``params[m]``, owner ``owners[m]``) and matrix ``e`` of its stack::

        W_e <- W_e (1 - decays[m, e]) - coefs[m, e] * U_e P^T     (U = factors[m], P its owner's)

    factors[m]: ``[E, d, r]`` FP32; coefs, decays (or ``None``: no decay), active: ``[M, E]``
    on the weights' device; seeds: the rounding seed of each member (matrix ``e`` continues
    the flat index at ``e d k``); offsets: the flat index of each member's first element
    (``None``: all 0; a row shard's ``first_row * k``). ``sq_norms`` (``[M, E]`` FP32) receives
    ``||W_new||_F^2``.
    """

    params: list[torch.Tensor]
    owners: list
    factors: list[torch.Tensor]
    coefs: torch.Tensor
    decays: torch.Tensor | None
    seeds: list[int]
    chunk_rows: int
    stochastic_rounding: bool
    active: torch.Tensor
    sq_norms: torch.Tensor | None = None
    offsets: list[int] | None = None

    def scale(self, alpha: float) -> None:
        """Multiply every coefficient and decay by the step controller's ``alpha``."""
        if alpha != 1.0:
            self.coefs = self.coefs * alpha
            if self.decays is not None:
                self.decays = self.decays * alpha

    def members(self) -> list[LowRankUpdate]:
        """The per-weight views of this update (same order as ``params``)."""
        out = []
        for m, (p, owner, u) in enumerate(zip(self.params, self.owners, self.factors,
                                              strict=True)):
            flat = owner.num_matrices == 1 and p.dim() == 2
            pick = (lambda t, m=m: t[m, 0]) if flat else (lambda t, m=m: t[m])
            out.append(LowRankUpdate(
                p, owner, u.view(owner.sketch_shape), pick(self.coefs),
                0.0 if self.decays is None else pick(self.decays), self.seeds[m],
                self.chunk_rows, self.stochastic_rounding, pick(self.active)))
        return out

    def apply(self) -> None:
        """Apply every member's update (one :func:`rgc.ops.lowrank_update_` call)."""
        weights = [owner.weight_matrices() for owner in self.owners]
        m = len(weights)
        ops.lowrank_update_(weights, self.factors, [o.projection for o in self.owners],
                            self.coefs, self.decays, self.seeds, self.offsets or [0] * m,
                            [w.shape[2] for w in weights], self.stochastic_rounding,
                            self.chunk_rows, self.sq_norms)


@dataclass
class DenseUpdate:
    """``p <- p (1 - decay) - coef * direction`` for a parameter with an ordinary gradient.

    ``direction`` has ``p``'s shape (any float dtype; used in FP32). ``coef``, ``decay`` and
    ``active`` are floats / 0-dim tensors as in :class:`LowRankUpdate`. ``offset``: the flat
    index of ``p``'s first element in the whole parameter (a row shard's rounding bits).
    """

    param: torch.Tensor
    direction: torch.Tensor
    coef: Scalar
    decay: Scalar
    seed: int
    stochastic_rounding: bool
    active: bool | torch.Tensor = True
    offset: int = 0

    def scale(self, alpha: float) -> None:
        if alpha != 1.0:
            self.coef = self.coef * alpha
            self.decay = self.decay * alpha

    def apply(self) -> None:
        apply_dense_update_(self.param, self.direction, self.coef, decay=self.decay,
                            seed=self.seed, stochastic_rounding=self.stochastic_rounding,
                            offset=self.offset)


def as_coef(value: Scalar, device) -> torch.Tensor:
    """``value`` as a 0-dim FP32 tensor on ``device`` (no host read of a tensor)."""
    return torch.as_tensor(value, dtype=torch.float32, device=device)


def is_zero(value: Scalar) -> bool:
    """True only for a Python zero (a tensor is never read on the host)."""
    return not torch.is_tensor(value) and value == 0.0


def write_rounded_(param: torch.Tensor, new: torch.Tensor, *, seed: int, offset: int = 0,
                   stochastic_rounding: bool = True) -> None:
    """Store FP32 ``new`` into ``param`` (same shape): stochastically rounded for BF16 (flat
    index ``offset + i`` for element ``i``) unless disabled, else as ``copy_`` rounds."""
    if param.dtype == torch.bfloat16 and stochastic_rounding:
        ops.stochastic_round_(param, new, seed, offset)
    else:
        param.copy_(new)


def apply_lowrank_update_(weight: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor,
                          coef: Scalar, *, decay: Scalar = 0.0, seed: int, offset: int = 0,
                          row_length: int | None = None, chunk_rows: int = 128,
                          stochastic_rounding: bool = True,
                          sq_norm_out: torch.Tensor | None = None) -> None:
    """``W <- W (1 - decay) - coef * U P^T`` in place, for one weight (one write).

    weight: d x k, or ``[E, d, k]`` (then ``factor`` is ``[E, d, r]`` and ``coef``/``decay``
    may be ``[E]``); factor: U, d x r FP32; projection: P, k x r. ``coef``/``decay``: floats or
    FP32 tensors on W's device (a float ``decay`` of 0 means no decay). Element (e, i, j) takes
    the rounding bits of flat index ``offset + (e d + i) row_length + j`` (``row_length``
    defaults to k; a column slice of a wider matrix passes the full width). ``sq_norm_out``
    (0-dim or ``[E]`` FP32) receives ``||W_new||_F^2``.
    """
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    e_count, d, k = w3.shape
    u3 = factor.reshape(e_count, d, -1)
    coefs = as_coef(coef, w3.device).expand(e_count).reshape(1, e_count)
    decays = None if is_zero(decay) else as_coef(decay, w3.device).expand(e_count).reshape(
        1, e_count)
    out = None if sq_norm_out is None else torch.empty(1, e_count, dtype=torch.float32,
                                                       device=w3.device)
    ops.lowrank_update_([w3], [u3], [projection], coefs.contiguous(),
                        None if decays is None else decays.contiguous(), [seed], [offset],
                        [k if row_length is None else row_length], stochastic_rounding,
                        chunk_rows, out)
    if sq_norm_out is not None:
        sq_norm_out.copy_(out.view(sq_norm_out.shape))


def sum_squares(tensor: torch.Tensor, *, chunk_rows: int = 128) -> torch.Tensor:
    """``||t||_F^2`` (0-dim FP32) of any tensor, rows being its first dimension (a 1-D tensor
    is one column): :func:`rgc.ops.sum_squares`'s reduction, no FP32 copy of ``t``."""
    tensor = tensor.detach()
    rows = (tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])) if tensor.dim() > 1
            else tensor.reshape(-1, 1))
    return ops.sum_squares([rows.unsqueeze(0)], chunk_rows)[0, 0]


def apply_dense_update_(param: torch.Tensor, direction: torch.Tensor, coef: Scalar, *,
                        decay: Scalar = 0.0, seed: int, stochastic_rounding: bool = True,
                        offset: int = 0) -> None:
    """``p <- p (1 - decay) - coef * direction`` in FP32, then one (rounded) write.

    ``offset`` is the flat index of ``p``'s first element for the rounding bits (a row shard).
    ``coef`` == 0 and ``decay`` == 0 leave ``p`` bit-identical even if ``direction`` is not
    finite (the old value is selected).
    """
    if is_zero(coef) and is_zero(decay):
        return
    p32 = param.to(torch.float32)
    c = as_coef(coef, param.device)
    new = p32 if is_zero(decay) else p32 * (1.0 - as_coef(decay, param.device))
    new = torch.where(c != 0, new - c * direction.to(torch.float32), new)
    write_rounded_(param, new, seed=seed, offset=offset, stochastic_rounding=stochastic_rounding)


def to_host(values: list) -> list:
    """Python numbers for a list of numbers / 0-dim tensors, with one device-to-host copy per
    device (the only host reads an optimizer makes, and none of them inside an uncontrolled
    ``step()``)."""
    out = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        host = torch.stack([values[i].reshape(()) for i in indices]).tolist()
        for i, v in zip(indices, host, strict=True):
            out[i] = v
    return out
