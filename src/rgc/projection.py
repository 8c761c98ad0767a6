"""Random projections ``P`` (k x r) with ``E[P P^T] = I``, generated on the device that uses them.

The random numbers are counter-based: they are the hash words of :mod:`rgc.rounding` at fixed
indices, keyed by the seed and a stream label, so no generator state is involved and every
device computes the same words. What follows from them is floating-point work on the target
device (nothing is computed on the CPU and copied, nothing synchronises the host):

* ``G`` (k x r, FP32), Box-Muller Gaussians. With ``h = ceil(r/2)``, row ``i`` holds ``h``
  pairs; pair ``c`` (``m = i h + c``) takes the words ``w0, w1`` of indices ``m`` and
  ``k h + m`` (label ``"projection-gaussian"``), keeps their top 24 bits ``a = w0 >> 8``,
  ``b = w1 >> 8`` and sets ``u = (a + 1) / 2**24`` in ``(0, 1]``, ``theta = 2 pi b / 2**24``,
  ``rho = sqrt(-2 ln u)``, ``G[i, c] = rho cos(theta)``, ``G[i, h + c] = rho sin(theta)``
  (column ``2h - 1`` dropped when r is odd). On the CPU, ``ln``, ``cos`` and ``sin`` are
  fixed polynomial evaluations in float32 (theta split into its quadrant ``b >> 22`` and an
  angle in ``[0, pi/2)``; error below 1e-6, same bits with and without the compiled loop of
  :mod:`rgc._native`). On CUDA with Triton, :func:`rgc.kernels.gaussian_matrix` performs the
  same float32 operations (same bits); on other devices torch's ``log``/``cos``/``sin``.
  Rows are i.i.d.,
  each row's law is symmetric under negation, entries are standard normal up to the 24-bit
  grid (``|G| <= 5.8``).
* ``orthonormal``: ``P = sqrt(k/r) Q`` with ``Q = G R^-1`` the Q factor of the thin QR of
  ``G`` whose ``R`` has a positive diagonal (Haar on the Stiefel manifold for Gaussian ``G``).
  Computed by CholeskyQR (``R`` = upper Cholesky factor of ``G^T G``):
  for ``k >= 4 r`` one pass, the Gram in float64 (in FP32 when ``P`` is returned in BF16,
  whose rounding is far coarser) and ``G R^-1`` in FP32; ``G`` is then well conditioned
  with overwhelming probability and ``P^T P = (k/r) I`` to about 1e-7 relative (tested to
  1e-5) before the final rounding. For ``k < 4 r``, where ``G`` can be ill conditioned,
  shifted CholeskyQR3 in float64 (three passes, the first with a shift of the Gram diagonal;
  stable up to cond(G) ~ 1e15). Every ``R`` is upper triangular with a positive diagonal, so
  each variant gives the same Q in exact arithmetic.

  On the CPU, for ``k >= 4 r`` and P in BF16 or FP32, the pass is one compiled routine of
  :mod:`rgc._native` (where the build has hardware fused multiply-adds) that fixes every
  operation: each Gram entry is a chain of fused multiply-adds over the rows of ``G`` in
  order; the float64 Cholesky factorisation (right-looking) and ``sqrt(k/r) R^-1``
  (backward substitution) use fused multiply-adds in the order of their steps; ``R^-1`` is
  rounded to FP32, and each entry of ``G R^-1`` is a chain of fused multiply-adds over
  ``i = 0, 1, ...`` (FP32), rounded once to P's dtype (to nearest). Where it does not apply
  (other devices, no C compiler, a ``G`` whose Gram is not positive definite), torch's
  matrix products and ``cholesky_ex``/``solve_triangular`` compute the same formulas with
  the library's (BLAS) rounding.
* ``gaussian``: ``G / sqrt(r)``.
* ``rademacher``: ``+-1/sqrt(r)``, negative where the word of index ``i r + j`` has its top
  bit set (label ``"projection-rademacher"``).

Every kind is then rounded once to the requested dtype. ``E[P P^T] = I`` holds for every
kind because the law of ``P`` is invariant under signed permutations of its rows.
Reproducibility: ``rademacher`` is bit-identical everywhere; ``G``, and ``gaussian`` P, are
bit-identical on every CPU and on CUDA with Triton; the compiled orthonormal pass gives the
same bits on every CPU that runs it, whatever its vector width (every lane performs the same
IEEE operations); otherwise the same seed on the same device type and library build gives the
same bits, and different device types (CPU vs CUDA) or BLAS builds differ by rounding, around
1e-7 relative.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import numpy as np
import torch

from rgc import _native
from rgc.rounding import random_grid, random_words, seed_words

PROJECTION_KINDS = ("orthonormal", "rademacher", "gaussian")

# k >= _FP32_RATIO * r: one CholeskyQR pass (float64 Gram); below: float64 shifted CholeskyQR3.
_FP32_RATIO = 4


def check_rank(kind: str, in_features: int, rank: int) -> None:
    """Raise ``ValueError`` for an unknown kind or a rank the kind cannot provide."""
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"unknown projection kind {kind!r}; choose one of {PROJECTION_KINDS}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if kind == "orthonormal" and rank > in_features:
        raise ValueError(
            f"an orthonormal projection needs rank <= in_features, got rank={rank} > "
            f"in_features={in_features}; lower the rank or use projection='rademacher'")


_LABEL = "projection-gaussian"
# 2 pi rounded to float32, times 2**-24: exactly representable, so every path agrees on theta.
_THETA_STEP = float(np.float32(2 * math.pi)) * 2.0**-24
_BM = {name: np.float32(v) for name, v in _native.BOX_MULLER_CONSTANTS.items()}


def _box_muller_numpy(w0: np.ndarray, w1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CPU definition of the Gaussian pairs, as ``rgc_gaussian`` in :mod:`rgc._native`
    computes it (the same float32 operations in the same order, so the same bits).

    w0, w1: uint32 arrays of hash words already shifted right by 8 (24-bit integers).
    Returns ``(rho cos(theta), rho sin(theta))`` as float32 arrays.
    """
    one, c = np.float32(1.0), _BM
    n = (w0 + np.uint32(1)).astype(np.float32)  # exact: <= 2**24
    bits = n.view(np.uint32)
    e = (bits >> np.uint32(23)).astype(np.int32) - 127
    f = ((bits & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = f > c["SQRT2"]
    f = np.where(big, f * np.float32(0.5), f)
    e = np.where(big, e + 1, e)
    s = (f - one) / (f + one)
    z = s * s
    p = c["L4"]
    for name in ("L3", "L2", "L1"):
        p = p * z + c[name]
    p = p * z + one
    ln_u = (e - 24).astype(np.float32) * c["LN2"] + (np.float32(2.0) * s) * p
    rho = np.sqrt(np.float32(-2.0) * ln_u)
    q = w1 >> np.uint32(22)
    x = (w1 & np.uint32(0x3FFFFF)).astype(np.float32) * c["XSTEP"]
    y = x * x
    sp = c["S6"]
    for name in ("S5", "S4", "S3", "S2", "S1"):
        sp = sp * y + c[name]
    sn = x * (sp * y + one)
    cs = c["C7"]
    for name in ("C6", "C5", "C4", "C3", "C2", "C1"):
        cs = cs * y + c[name]
    cs = cs * y + one
    quadrant = [q == 0, q == 1, q == 2]
    cos_q = np.select(quadrant, [cs, -sn, -cs], sn)
    sin_q = np.select(quadrant, [sn, cs, -sn], -cs)
    return rho * cos_q, rho * sin_q


def _gaussian_torch(k: int, half: int, *, seed: int, device) -> torch.Tensor:
    """The non-CPU definition of ``G`` (k x 2 half): torch's log/cos/sin, any device."""
    n = k * half
    u = random_grid(n, seed=seed, label=_LABEL, device=device, add=1.0, mul=2.0**-24)
    theta = random_grid(n, seed=seed, label=_LABEL, offset=n, device=device, mul=_THETA_STEP)
    rho = u.log_().mul_(-2.0).sqrt_().view(k, half)
    theta = theta.view(k, half)
    g = torch.empty(k, 2 * half, dtype=torch.float32, device=rho.device)
    torch.mul(rho, torch.cos(theta), out=g[:, :half])
    torch.mul(rho, theta.sin_(), out=g[:, half:])
    return g


def _gaussian_accelerator(k: int, r: int, *, seed: int, device: torch.device) -> torch.Tensor:
    """``G`` on a non-CPU device: the Triton kernel where :mod:`rgc.dispatch` picks Triton
    (CUDA with Triton installed; the CPU's bits), else torch's log/cos/sin."""
    from rgc import dispatch, kernels

    if dispatch.implementation_for_device(device) == "triton":
        return kernels.gaussian_matrix(k, r, seed=seed, device=device)
    return _gaussian_torch(k, (r + 1) // 2, seed=seed, device=device)[:, :r]


def gaussian_matrix(k: int, r: int, *, seed: int, device=None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``G`` (k x r, FP32, on ``device``): the Box-Muller Gaussians described above.

    out: optional FP32 k x m tensor, ``m >= 2 ceil(r/2)``, with unit column stride (its device
    is used): ``G`` is written into its first columns (the others are zeroed) and ``out[:, :r]``
    is returned.
    """
    half = (r + 1) // 2
    n = k * half
    if 2 * n >= 1 << 32:
        raise ValueError(f"a {k} x {r} projection is too large (2 k ceil(r/2) >= 2**32)")
    if out is None:
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type != "cpu":
            return _gaussian_accelerator(k, r, seed=seed, device=device)
        out = torch.empty(k, 2 * half, dtype=torch.float32)
    if out.device.type != "cpu":
        out[:, :r] = _gaussian_accelerator(k, r, seed=seed, device=out.device)
        out[:, r:] = 0
        return out[:, :r]
    lib = _native.library()
    if lib is not None:
        lib.rgc_gaussian(out.data_ptr(), k, half, out.stride(0), *seed_words(seed, _LABEL))
    else:
        words = random_words(2 * n, seed=seed, label=_LABEL).numpy().view(np.uint32) >> 8
        cos, sin = _box_muller_numpy(words[:n], words[n:])
        g = out.numpy()
        g[:, :half] = cos.reshape(k, half)
        g[:, half:2 * half] = sin.reshape(k, half)
        g[:, 2 * half:] = 0
    return out[:, :r]


class _CpuWorkspace(NamedTuple):
    g_rows: torch.Tensor  # k x ldg FP32: G in its first 2 ceil(r/2) columns, zeros after
    g_ptr: int
    ldg: int  # a multiple of 16: every row starts on a 64-byte line
    work_ptr: int  # the work space of rgc_cholesky_qr


_scratch = threading.local()


def _cpu_workspace(k: int, r: int) -> _CpuWorkspace:
    """Where a k x r projection is built on the CPU: one FP32 buffer per thread, reused.

    Why: a fresh CPU tensor of a few hundred KB is mapped from the system at each allocation,
    and its page faults made a refresh inside an optimizer step markedly slower. Held: the
    largest ``G`` and work space requested so far (k x round_up(r, 16) FP32 plus five r x r
    FP32 blocks: 1.7 MB for k=6144, r=64).
    """
    views = getattr(_scratch, "views", None)
    if views is None or (k, r) not in views:
        ldg = _round_up16(2 * ((r + 1) // 2))
        numel = k * ldg + _native.cholesky_qr_work_floats(r)
        buffer = getattr(_scratch, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            _scratch.buffer = buffer = torch.empty(numel, dtype=torch.float32)
            _scratch.views = views = {}  # views of the previous buffer would keep it alive
        g_rows = buffer[:k * ldg].view(k, ldg)
        views[(k, r)] = _CpuWorkspace(g_rows, g_rows.data_ptr(), ldg,
                                      buffer[k * ldg:].data_ptr())
    return views[(k, r)]


def _round_up16(n: int) -> int:
    return -(-n // 16) * 16


@functools.lru_cache(maxsize=64)
def _scaled_eye(r: int, scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Read only; cached because each small op costs more than its arithmetic here.
    return torch.eye(r, dtype=dtype, device=device).mul_(scale)


def _inverse_cholesky_factor(gram: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * R^-1`` (r x r) for the upper Cholesky factor ``R`` of ``gram = R^T R``.

    ``cholesky_ex`` does not check its result, so nothing synchronises with the device. An
    explicit inverse and a matrix product, not a triangular solve with the k x r matrix:
    for k in the thousands the solve was 10x slower than the product on the CPU."""
    upper, _ = torch.linalg.cholesky_ex(gram, upper=True)
    eye = _scaled_eye(gram.shape[0], scale, gram.dtype, gram.device)
    return torch.linalg.solve_triangular(upper, eye, upper=True)


def orthonormalize(g: torch.Tensor, scale: float = 1.0, *, gram_dtype=torch.float64
                   ) -> torch.Tensor:
    """``scale * Q`` for the thin QR ``g = Q R`` whose ``R`` has a positive diagonal.

    g: k x r FP32, k >= r, full column rank. For ``k >= 4 r`` one CholeskyQR pass: ``R`` from
    the Gram matrix in ``gram_dtype``, then ``g R^-1`` in FP32 (returns FP32). Otherwise
    shifted CholeskyQR3 in float64 (returns float64). See the module docstring. This is the
    path of every device but the CPU with the compiled loops (:func:`make_projection`).
    """
    k, r = g.shape
    if k >= _FP32_RATIO * r:
        gw = g if gram_dtype == g.dtype else g.to(gram_dtype)
        inverse = _inverse_cholesky_factor(torch.mm(gw.t(), gw), scale)
        return torch.mm(g, inverse if inverse.dtype == g.dtype else inverse.to(g.dtype))
    q = g.double()
    for i in range(3):
        gram = q.t() @ q
        if i == 0:
            # Fukaya et al. (2020): shift 11 (k r + r (r + 1)) u ||G||_2^2 (||G||_F^2 here,
            # larger), which keeps the Cholesky factorisation of a nearly singular Gram defined.
            unit = torch.finfo(torch.float64).eps / 2
            gram.diagonal().add_(gram.diagonal().sum() * (11 * (k * r + r * (r + 1)) * unit))
        q = q @ _inverse_cholesky_factor(gram, scale if i == 2 else 1.0)
    return q


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
    k, r = in_features, rank
    if out is not None:
        if device is not None or dtype is not None:
            raise ValueError("pass either out or device/dtype to make_projection, not both")
        if tuple(out.shape) != (k, r) or not out.is_floating_point():
            raise ValueError(f"out must be a floating-point {k} x {r} tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        device, dtype = out.device, out.dtype
    dtype = dtype or torch.float32
    if out is None:
        out = torch.empty(k, r, dtype=dtype, device=device)
    if kind == "rademacher":
        words = random_words(k * r, seed=seed, label="projection-rademacher", device=out.device)
        magnitude = torch.tensor(1.0 / math.sqrt(r), dtype=dtype, device=out.device)
        return torch.where(words.view(k, r) < 0, -magnitude, magnitude, out=out)
    scale = math.sqrt(k / r)
    # Rounding to BF16 (relative 2**-9) swamps the ~1e-5 error of an FP32 Gram.
    wide = dtype != torch.bfloat16
    on_cpu = out.device.type == "cpu"
    lib = _native.library() if on_cpu else None
    workspace = _cpu_workspace(k, r) if on_cpu else None
    if (kind == "orthonormal" and lib is not None and lib.fast_fma and k >= _FP32_RATIO * r
            and dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()):
        lib.rgc_gaussian(workspace.g_ptr, k, (r + 1) // 2, workspace.ldg,
                         *seed_words(seed, _LABEL))
        if lib.rgc_cholesky_qr(workspace.g_ptr, k, r, workspace.ldg, int(wide), scale,
                               out.data_ptr(), int(not wide), workspace.work_ptr) == 0:
            return out
        # The Gram was not positive definite (a degenerate G, not met in practice): torch's path.
    g = gaussian_matrix(k, r, seed=seed, device=out.device,
                        out=None if workspace is None else workspace.g_rows)
    if kind == "gaussian":
        return torch.div(g, math.sqrt(r), out=out)
    return out.copy_(orthonormalize(g, scale, gram_dtype=torch.float64 if wide else torch.float32))
