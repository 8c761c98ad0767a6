"""Update records and the functions that apply them: shared by the optimizers and policy sync.

An optimizer step proposes, per parameter, a :class:`LowRankUpdate` (compressed weight) or a
:class:`DenseUpdate` (any other parameter), then applies it with :func:`apply_update_record`;
a sync receiver (:func:`rgc.apply_update`) rebuilds the same record from a payload and applies
it with the same functions, which is why its weights match the trainer's bit for bit.

Coefficients live on the device. ``coef`` and ``decay`` are Python floats or 0-dim FP32
tensors on the parameter's device; the apply functions never read a tensor coefficient on the
host, and a zero coefficient leaves the parameter bit-identical (a select, not arithmetic with
0), so an optimizer skips a layer with a non-finite sketch by setting its coefficients to 0 on
the device instead of testing the sketch on the host. Python floats are converted to FP32 the
same way, so a trainer's tensor coefficient and a receiver's float copy of it give the same
bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rgc import dispatch
from rgc.nn import CompressedLinear
from rgc.reference.update import write_rows
from rgc.seeding import derive_seed

Scalar = float | torch.Tensor


@dataclass
class LowRankUpdate:
    """``W <- W (1 - decay) - coef * U P^T`` for the weight of a CompressedLinear.

    ``factor`` is U (d x r FP32); P is the layer's current projection (k x r). ``coef`` and
    ``decay`` are floats or 0-dim FP32 tensors on W's device. ``active`` is ``True`` or a 0-dim
    bool tensor: ``False`` when this step has no update for W (non-finite input, or a zero
    direction), in which case ``coef`` and ``decay`` are 0 and W stays bit-identical.
    ``sq_norm_out`` (optional 0-dim FP32 tensor) receives ``||W_new||_F^2`` of the stored values.
    """

    param: torch.Tensor
    layer: CompressedLinear
    factor: torch.Tensor
    coef: Scalar
    decay: Scalar
    seed: int
    chunk_rows: int
    stochastic_rounding: bool
    active: bool | torch.Tensor = True
    sq_norm_out: torch.Tensor | None = None


@dataclass
class DenseUpdate:
    """``p <- p (1 - decay) - coef * direction`` for a parameter with an ordinary gradient.

    ``direction`` has ``p``'s shape (any float dtype; used in FP32). ``coef``, ``decay`` and
    ``active`` as in :class:`LowRankUpdate`.
    """

    param: torch.Tensor
    direction: torch.Tensor
    coef: Scalar
    decay: Scalar
    seed: int
    stochastic_rounding: bool
    active: bool | torch.Tensor = True


def as_coef(value: Scalar, device) -> torch.Tensor:
    """``value`` as a 0-dim FP32 tensor on ``device`` (no host read of a tensor)."""
    return torch.as_tensor(value, dtype=torch.float32, device=device)


def is_zero(value: Scalar) -> bool:
    """True only for a Python zero (a tensor is never read on the host)."""
    return not torch.is_tensor(value) and value == 0.0


def scale_update(update, alpha: float) -> None:
    """Multiply ``coef`` and ``decay`` of a record by the step controller's ``alpha``."""
    if alpha != 1.0:
        update.coef = update.coef * alpha
        update.decay = update.decay * alpha


def decay_weight_(weight: torch.Tensor, decay: Scalar, *, seed: int, chunk_rows: int = 128,
                  stochastic_rounding: bool = True) -> None:
    """``W <- (1 - decay) W`` in place, ``chunk_rows`` rows at a time, with the rounding
    convention of :func:`rgc.reference.lowrank_update_reference` (flat index ``i*k + j``).

    ``decay`` == 0 (a float or a tensor's value) leaves W bit-identical: ``(1 - 0) * w`` is
    ``w`` exactly and a representable value is stored unchanged by either rounding.
    """
    factor = 1.0 - as_coef(decay, weight.device)
    rows2 = weight.reshape(weight.shape[0], -1) if weight.dim() > 1 else weight.reshape(1, -1)
    k = rows2.shape[1]
    for start in range(0, rows2.shape[0], chunk_rows):
        rows = rows2[start:start + chunk_rows]
        write_rows(rows, rows.to(torch.float32) * factor, seed=seed, offset=start * k,
                   stochastic_rounding=stochastic_rounding)


def apply_lowrank_update_(weight: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor,
                          coef: Scalar, *, decay: Scalar = 0.0, seed: int, chunk_rows: int = 128,
                          stochastic_rounding: bool = True,
                          sq_norm_out: torch.Tensor | None = None) -> None:
    """``W <- W (1 - decay) - coef * U P^T`` in place (W: d x k, U: d x r FP32, P: k x r).

    The decay (unless it is the float 0) is its own rounded pass, keyed by
    ``derive_seed(seed, 'decay')``; the low-rank part goes through
    :func:`rgc.dispatch.lowrank_update_` keyed by ``seed`` (skipped only for a float 0
    ``coef`` without ``sq_norm_out``). ``sq_norm_out`` receives ``||W_new||_F^2``.
    """
    if not is_zero(decay):
        decay_weight_(weight, decay, seed=derive_seed(seed, "decay"), chunk_rows=chunk_rows,
                      stochastic_rounding=stochastic_rounding)
    if not is_zero(coef) or sq_norm_out is not None:
        dispatch.lowrank_update_(weight, factor, projection, coef, seed=seed,
                                 chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding,
                                 sq_norm_out=sq_norm_out)


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
    write_rows(param, new, seed=seed, offset=offset, stochastic_rounding=stochastic_rounding)


def apply_update_record(update: LowRankUpdate | DenseUpdate) -> None:
    """Apply one record to its parameter."""
    if isinstance(update, LowRankUpdate):
        apply_lowrank_update_(update.param, update.factor, update.layer.projection, update.coef,
                              decay=update.decay, seed=update.seed, chunk_rows=update.chunk_rows,
                              stochastic_rounding=update.stochastic_rounding,
                              sq_norm_out=update.sq_norm_out)
    else:
        apply_dense_update_(update.param, update.direction, update.coef, decay=update.decay,
                            seed=update.seed, stochastic_rounding=update.stochastic_rounding)


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
