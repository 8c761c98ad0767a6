"""Chunked low-rank weight update and weight norm, in plain PyTorch."""

from __future__ import annotations

import torch

from rgc.rounding import stochastic_round_


def write_rows(rows: torch.Tensor, new: torch.Tensor, *, seed: int, offset: int,
               stochastic_rounding: bool = True) -> None:
    """Store the FP32 values ``new`` into ``rows`` (same shape).

    BF16 ``rows`` are stochastically rounded with the bits of flat indices ``offset + i*k + j``
    (k = row length) unless ``stochastic_rounding`` is False (then round-to-nearest-even);
    FP32 rows are written as they are.
    """
    if rows.dtype == torch.bfloat16 and stochastic_rounding:
        stochastic_round_(rows, new, seed=seed, offset=offset)
    else:
        rows.copy_(new)


@torch.no_grad()
def lowrank_update_reference(weight: torch.Tensor, sketch: torch.Tensor,
                             projection: torch.Tensor, coef: float, *, seed: int,
                             offset: int = 0, chunk_rows: int = 128,
                             stochastic_rounding: bool = True) -> None:
    """In place ``W <- W - coef * C P^T``, rebuilding ``C P^T`` ``chunk_rows`` rows at a time.

    Args:
        weight: W, d x k, BF16 or FP32, rows contiguous (a row slice of a larger matrix is
            fine); updated in place.
        sketch: C, d x r, FP32.
        projection: P, k x r, any float dtype (used in FP32).
        coef: scalar step.
        seed, offset: rounding bits of element (i, j) are those of flat index
            ``offset + i*k + j`` (see :mod:`rgc.rounding`).
        chunk_rows: rows rebuilt at once; the largest temporary is chunk_rows x k FP32.
    """
    d, k = weight.shape
    p_t = projection.to(torch.float32).t()
    for start in range(0, d, chunk_rows):
        rows = weight[start:start + chunk_rows]
        new = torch.addmm(rows.to(torch.float32), sketch[start:start + chunk_rows], p_t,
                          alpha=-coef)
        write_rows(rows, new, seed=seed, offset=offset + start * k,
                   stochastic_rounding=stochastic_rounding)


@torch.no_grad()
def frobenius_norm_reference(weight: torch.Tensor, *, chunk_rows: int = 128) -> torch.Tensor:
    """``||W||_F`` accumulated in FP32 over row chunks (no full FP32 copy of W). 0-dim FP32."""
    w2 = weight.reshape(weight.shape[0], -1) if weight.dim() > 1 else weight.reshape(1, -1)
    total = torch.zeros((), dtype=torch.float32, device=weight.device)
    for start in range(0, w2.shape[0], chunk_rows):
        total += w2[start:start + chunk_rows].to(torch.float32).square().sum()
    return total.sqrt()
