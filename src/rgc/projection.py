"""Random projections ``P`` (k x r) with ``E[P P^T] = I``, generated on the device that uses them.

The random numbers are counter-based: the hash words of :mod:`rgc.bits` at fixed indices,
keyed by the seed and a stream label, so no generator state is involved and every device
computes the same words. What follows from them is floating-point work on the target device
through the operators of :mod:`rgc.ops` (nothing is computed on the CPU and copied, nothing
synchronises the host):

* ``G`` (k x r, FP32), Box-Muller Gaussians (:func:`rgc.ops.gaussian_matrices`): with
  ``h = ceil(r/2)``, row ``i`` holds ``h`` pairs; pair ``c`` (``m = i h + c``) takes the words
  of indices ``m`` and ``k h + m`` (label ``"projection-gaussian"``), ``u = ((w0 >> 8) + 1) /
  2**24``, ``theta = 2 pi (w1 >> 8) / 2**24``, ``G[i, c] = rho cos(theta)``,
  ``G[i, h + c] = rho sin(theta)``, ``rho = sqrt(-2 ln u)`` (column ``2h - 1`` dropped for odd
  r), with ``ln``, ``cos`` and ``sin`` fixed float32 polynomials evaluated one IEEE operation at
  a time: the same bits on every CPU and on CUDA. Entries are standard normal up to the 24-bit
  grid (``|G| <= 5.8``).
* ``orthonormal``: ``P = sqrt(k/r) Q``, ``Q = G R^-1`` the Q factor of the thin QR of ``G``
  whose ``R`` has a positive diagonal (Haar on the Stiefel manifold), by CholeskyQR
  (:func:`rgc.ops.orthonormalize`): for ``k >= 4 r`` one pass, the Gram in float64 (FP32 when
  ``P`` is stored in BF16, whose rounding is far coarser) and ``G R^-1`` in FP32; for
  ``k < 4 r``, where ``G`` can be ill conditioned, shifted CholeskyQR3 in float64 (stable up to
  cond(G) ~ 1e15). Matrix products and the factorisation are torch's (BLAS / cuBLAS), so the
  same seed gives the same bits on the same device type and library build; CPU and CUDA
  differ by rounding, around 1e-7 relative.
* ``gaussian``: ``G / sqrt(r)``.
* ``rademacher``: ``+-1/sqrt(r)``, negative where the word of index ``i r + j`` has its top
  bit set (label ``"projection-rademacher"``): bit-identical everywhere.

Every kind is then rounded once to the requested dtype. ``E[P P^T] = I`` holds for every kind
because the law of ``P`` is invariant under signed permutations of its rows.
"""

from __future__ import annotations

import torch

from rgc import ops

PROJECTION_KINDS = ("orthonormal", "rademacher", "gaussian")


def check_rank(kind: str, in_features: int, rank: int) -> None:
    """Raise ``ValueError`` for an unknown kind or a rank the kind cannot provide."""
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"unknown projection kind {kind!r}; choose one of {PROJECTION_KINDS}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1 (not a bool), got {rank!r}")
    if kind == "orthonormal" and rank > in_features:
        raise ValueError(
            f"an orthonormal projection needs rank <= in_features, got rank={rank} > "
            f"in_features={in_features}; lower the rank or use projection='rademacher'")


def make_projection(
    kind: str,
    in_features: int,
    rank: int,
    *,
    seed: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A random ``in_features x rank`` projection with ``E[P P^T] = I``, built on ``device``.

    Kinds (exact definitions in the module docstring):
        ``orthonormal``: ``sqrt(k / r)`` times the Q factor of a k x r Gaussian matrix
        (Haar-distributed), so ``P^T P = (k / r) I``.
        ``rademacher``: i.i.d. entries ``+-1/sqrt(r)``.
        ``gaussian``: i.i.d. entries ``N(0, 1/r)``.

    Args:
        kind: one of ``PROJECTION_KINDS``.
        in_features: ``k``, the layer's input size.
        rank: ``r``.
        seed: non-negative integer; the same seed gives the same ``P`` on every device of
            one type (see the module docstring for other device types).
        device, dtype: where ``P`` is computed and returned (default CPU) and its dtype
            (default float32); it is rounded once to ``dtype``.
        out: optional k x r floating-point tensor to write ``P`` into (then ``P`` is computed
            on ``out``'s device and rounded to its dtype; ``device``/``dtype`` must be None).

    Nothing here synchronises the host with the device.
    """
    check_rank(kind, in_features, rank)
    if out is not None:
        if device is not None or dtype is not None:
            raise ValueError("pass either out or device/dtype to make_projection, not both")
        if tuple(out.shape) != (in_features, rank) or not out.is_floating_point():
            raise ValueError(f"out must be a floating-point {in_features} x {rank} tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        device, dtype = out.device, out.dtype
    if out is None:
        out = torch.empty(in_features, rank, dtype=dtype or torch.float32, device=device)
    ops.make_projections_([out], kind, [seed])
    return out


def advance_projections(owners: list) -> None:
    """Move every owner (a :class:`rgc.sketched.SketchedWeight`) to its next projection
    version, regenerating ``P`` in its buffer: one :func:`rgc.ops.make_projections_` call per
    (kind, k, r, device). The caller renews the owners' sketch slots."""
    groups: dict[tuple, list] = {}
    for owner in owners:
        p = owner.projection
        key = (owner.projection_kind, owner.in_features, owner.rank, p.dtype, p.device)
        groups.setdefault(key, []).append(owner)
    for (kind, *_), members in groups.items():
        for owner in members:
            owner.projection_version += 1
        ops.make_projections_([o.projection for o in members], kind,
                              [o.projection_seed for o in members])
