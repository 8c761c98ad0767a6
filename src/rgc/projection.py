"""Random projections ``P`` (k x r) with ``E[P P^T] = I``.

Every kind is generated on the CPU from a seed and then moved, so the same seed gives the same
``P`` on every device; a checkpoint or a sync receiver needs the seed, not ``P``.
"""

from __future__ import annotations

import math

import torch

PROJECTION_KINDS = ("orthonormal", "rademacher", "gaussian")


def check_rank(kind: str, in_features: int, rank: int) -> None:
    """Raise ``ValueError`` for an unknown kind or a rank the kind cannot provide."""
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"unknown projection kind {kind!r}; choose one of {PROJECTION_KINDS}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if kind == "orthonormal" and rank > in_features:
        raise ValueError(
            f"an orthonormal projection needs rank <= in_features, got rank={rank} > "
            f"in_features={in_features}; lower the rank or use projection='rademacher'"
        )


def make_projection(
    kind: str,
    in_features: int,
    rank: int,
    *,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A random ``in_features x rank`` projection with ``E[P P^T] = I``.

    Kinds:
        ``orthonormal``: ``Q`` of the QR factorisation of a k x r standard Gaussian matrix,
        sign-corrected (``Q <- Q diag(sign(diag(R)))``, so ``Q`` is Haar-distributed) and
        scaled by ``sqrt(k / r)``; then ``P^T P = (k / r) I``.
        ``rademacher``: i.i.d. entries ``+-1/sqrt(r)``.
        ``gaussian``: i.i.d. entries ``N(0, 1/r)``.

    Args:
        kind: one of ``PROJECTION_KINDS``.
        in_features: ``k``, the layer's input size.
        rank: ``r``.
        seed: non-negative integer; the same seed gives the same ``P`` on every device.
        device, dtype: where and how ``P`` is returned (default CPU, float32). It is computed
            in float64 and rounded once to ``dtype``.
    """
    check_rank(kind, in_features, rank)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    k, r = in_features, rank
    if kind == "orthonormal":
        g = torch.randn(k, r, generator=gen, dtype=torch.float64)
        q, upper = torch.linalg.qr(g)
        signs = torch.sign(torch.diagonal(upper))
        signs[signs == 0] = 1.0
        p = q * signs * math.sqrt(k / r)
    elif kind == "rademacher":
        signs = torch.randint(0, 2, (k, r), generator=gen, dtype=torch.int64) * 2 - 1
        p = signs.to(torch.float64) / math.sqrt(r)
    else:
        p = torch.randn(k, r, generator=gen, dtype=torch.float64) / math.sqrt(r)
    return p.to(device=device, dtype=dtype or torch.float32)
