"""Chunked low-rank weight update and weight norm, in plain PyTorch."""

from __future__ import annotations

import torch

from rgc.rounding import stochastic_round_


def write_rows(rows: torch.Tensor, new: torch.Tensor, *, seed: int, offset: int,
               stochastic_rounding: bool = True) -> torch.Tensor:
    """Store the FP32 values ``new`` into ``rows`` (same shape); return the values stored.

    BF16 ``rows`` are stochastically rounded with the bits of flat indices ``offset + i*k + j``
    (k = row length) unless ``stochastic_rounding`` is False (then round-to-nearest-even);
    FP32 rows are written as they are. Returns ``rows``, which now holds exactly what was
    stored.
    """
    if rows.dtype == torch.bfloat16 and stochastic_rounding:
        stochastic_round_(rows, new, seed=seed, offset=offset)
    else:
        rows.copy_(new)
    return rows


def _chunk_sq_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of squares of one chunk in FP32 (0-dim); the one reduction both functions below use,
    so a recomputed norm equals the one the update produced, bit for bit."""
    v = values.to(torch.float32, copy=True)
    return v.mul_(v).sum()


@torch.no_grad()
def lowrank_update_reference(weight: torch.Tensor, sketch: torch.Tensor,
                             projection: torch.Tensor, coef: float | torch.Tensor, *, seed: int,
                             offset: int = 0, chunk_rows: int = 128,
                             stochastic_rounding: bool = True,
                             sq_norm_out: torch.Tensor | None = None) -> None:
    """In place ``W <- W - coef * C P^T``, rebuilding ``C P^T`` ``chunk_rows`` rows at a time.

    Args:
        weight: W, d x k, BF16 or FP32, rows contiguous (a row slice of a larger matrix is
            fine); updated in place.
        sketch: C, d x r, FP32.
        projection: P, k x r, any float dtype (used in FP32).
        coef: a float or a 0-dim FP32 tensor on W's device; a tensor is never read on the
            host. Where it is 0, C and P are replaced by zeros (a select), so the rebuilt
            ``C P^T`` is exactly +0, ``w - (+0)`` is ``w`` (signed zeros included) and W is
            stored back bit-identical, even when C or P hold inf/NaN.
        seed, offset: rounding bits of element (i, j) are those of flat index
            ``offset + i*k + j`` (see :mod:`rgc.rounding`).
        chunk_rows: rows rebuilt at once; the largest temporaries are chunk_rows x k FP32.
        sq_norm_out: ``None`` or a 0-dim FP32 tensor on W's device, overwritten with
            ``sum(float32(stored W)^2)``: per chunk in FP32, chunks added in row order (the
            reduction of :func:`sum_squares_reference`, so both give the same bits).
    """
    d, k = weight.shape
    c = torch.as_tensor(coef, dtype=torch.float32, device=weight.device)
    keep = c != 0
    p_t = torch.where(keep, projection.to(torch.float32), 0.0).t()
    if sq_norm_out is not None:
        sq_norm_out.zero_()
    for start in range(0, d, chunk_rows):
        rows = weight[start:start + chunk_rows]
        scaled = torch.where(keep, sketch[start:start + chunk_rows] * c, 0.0)
        h = scaled @ p_t
        new = torch.sub(rows, h, out=h)  # in FP32 (type promotion), without an FP32 copy of rows
        stored = write_rows(rows, new, seed=seed, offset=offset + start * k,
                            stochastic_rounding=stochastic_rounding)
        if sq_norm_out is not None:
            sq_norm_out += _chunk_sq_sum(stored)


@torch.no_grad()
def sum_squares_reference(weight: torch.Tensor, *, chunk_rows: int = 128) -> torch.Tensor:
    """``||W||_F^2`` accumulated in FP32 over row chunks (no full FP32 copy of W). 0-dim FP32.

    Any shape: rows are the first dimension (a 1-D tensor is one column).
    """
    w2 = weight.reshape(weight.shape[0], -1) if weight.dim() > 1 else weight.reshape(-1, 1)
    total = torch.zeros((), dtype=torch.float32, device=weight.device)
    for start in range(0, w2.shape[0], chunk_rows):
        total += _chunk_sq_sum(w2[start:start + chunk_rows])
    return total


@torch.no_grad()
def frobenius_norm_reference(weight: torch.Tensor, *, chunk_rows: int = 128) -> torch.Tensor:
    """``||W||_F`` accumulated in FP32 over row chunks (no full FP32 copy of W). 0-dim FP32."""
    return sum_squares_reference(weight, chunk_rows=chunk_rows).sqrt()
