"""Triton twins of :mod:`rgc.reference` and :mod:`rgc.rounding`, for CUDA tensors.

Importing this package does not import Triton; the first kernel call does, and raises an
``ImportError`` saying what to install when Triton is missing. On the CPU the kernels run only
in Triton's interpreter: set ``TRITON_INTERPRET=1`` before the first kernel call of the process.

* :func:`stochastic_round` / :func:`stochastic_round_`: FP32 -> BF16, bit-identical with
  :func:`rgc.stochastic_round` for the same seed and offset.
* :func:`gaussian_matrix`: the Box-Muller ``G`` of :mod:`rgc.projection` in one launch,
  bit-identical with the CPU's for the same seed.
* :func:`lowrank_update_`: ``W <- W - coef * C P^T`` with ``C P^T`` formed tile by tile on
  chip (never written to memory) and one stochastically rounded store, using the same bits;
  the same pass can return ``||W_new||_F^2``, and ``coef`` may be a device tensor.

Bit convention: element ``(i, j)`` of a d x k weight is rounded with the bits of flat index
``offset + i*k + j``, exactly as ``rgc.stochastic_round(x.flatten(), seed=, offset=)``.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

__all__ = ["gaussian_matrix", "lowrank_update_", "stochastic_round", "stochastic_round_"]


def _backend():
    try:
        from rgc.kernels import _triton
    except ImportError as exc:
        raise ImportError(
            "rgc.kernels needs Triton (pip install 'rgc-torch[triton]'); without it use "
            "rgc.reference or let rgc.dispatch choose the PyTorch path") from exc
    return _triton


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"rgc.kernels runs on CUDA tensors, got a tensor on {device}; to run on the CPU set "
            "TRITON_INTERPRET=1 before the first kernel call, or use rgc.reference")
    if not _backend().INTERPRETED:
        raise RuntimeError(
            "the Triton kernels were compiled for CUDA in this process (TRITON_INTERPRET was not "
            "1 when rgc.kernels first ran a kernel); set TRITON_INTERPRET=1 before that first "
            "call to run them on the CPU")


def _check_seed_offset(seed, offset) -> None:
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not isinstance(offset, numbers.Integral) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, *, seed: int,
                      offset: int = 0) -> torch.Tensor:
    """Write ``rgc.stochastic_round(x, seed=seed, offset=offset)`` into ``out``; returns ``out``.

    Args:
        out: BF16, same shape as ``x``, same device.
        x: any shape, floating point (converted to FP32 first, as the reference does).
        seed, offset: element ``j`` of ``x.flatten()`` uses the bits of flat index
            ``offset + j``.
    """
    if not x.is_floating_point():
        raise TypeError(f"stochastic_round_ expects a floating-point x, got {x.dtype}")
    if out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(f"out must be BF16 of x's shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    _check_seed_offset(seed, offset)
    _check_device(out, x)
    x32 = x.to(torch.float32).contiguous()
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                         device=out.device)
    _backend().stochastic_round_triton(target, x32, seed=int(seed), offset=int(offset))
    if target is not out:
        out.copy_(target)
    return out


def stochastic_round(x: torch.Tensor, *, seed: int, offset: int = 0) -> torch.Tensor:
    """Kernel twin of :func:`rgc.stochastic_round`: a new BF16 tensor of ``x``'s shape."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return stochastic_round_(out, x, seed=seed, offset=offset)


def gaussian_matrix(k: int, r: int, *, seed: int, device) -> torch.Tensor:
    """Kernel twin of :func:`rgc.projection.gaussian_matrix`: ``G`` (k x r FP32) on ``device``.

    One launch that performs the CPU definition's float32 operations one by one (no fused
    multiply-add, IEEE division and square root), so ``G`` has the CPU's bits. ``G`` is a view
    of a k x 2 ceil(r/2) buffer (the last column dropped when r is odd).
    """
    half = (r + 1) // 2
    if 2 * k * half >= 1 << 32:
        raise ValueError(f"a {k} x {r} projection is too large (2 k ceil(r/2) >= 2**32)")
    g = torch.empty(k, 2 * half, dtype=torch.float32, device=device)
    _check_device(g)
    if g.numel():
        _backend().gaussian_triton(g, k, half, seed=int(seed))
    return g[:, :r]


def _coef_tensor(coef, device: torch.device) -> torch.Tensor:
    """``coef`` as a 0-dim FP32 tensor on ``device``, without reading a tensor on the host."""
    if isinstance(coef, torch.Tensor):
        if coef.dim() != 0 or coef.dtype != torch.float32 or coef.device != device:
            raise ValueError(f"a tensor coef must be 0-dim FP32 on the weight's device {device}, "
                             f"got {coef.dim()}-dim {coef.dtype} on {coef.device}")
        return coef
    if (not isinstance(coef, numbers.Real) or isinstance(coef, bool)
            or not math.isfinite(coef)):
        raise ValueError(f"coef must be a finite number or a 0-dim FP32 tensor, got {coef!r}")
    # A fill kernel on the device, not a host-to-device copy.
    return torch.full((), float(coef), dtype=torch.float32, device=device)


def lowrank_update_(weight: torch.Tensor, sketch: torch.Tensor, projection: torch.Tensor,
                    coef: float | torch.Tensor, *, seed: int, offset: int = 0,
                    chunk_rows: int | None = None, stochastic_rounding: bool = True,
                    sq_norm_out: torch.Tensor | None = None) -> None:
    """In place ``W <- W - coef * C P^T`` in one pass over W, never writing ``C P^T``.

    Each program owns a tile of W: it computes that tile of ``H = C P^T`` on chip (``tl.dot``
    over r), forms ``W - coef * H`` in FP32 and stores it: stochastically rounded for BF16 W
    (bits of flat index ``offset + i*k + j``, k = ``W.shape[1]``, whatever W's strides),
    rounded to nearest when ``stochastic_rounding`` is False, plainly for FP32 W. The same pass
    sums the squares of the stored values (optional ``sq_norm_out``).

    Args:
        weight: W, d x k, BF16 or FP32, any strides (e.g. a row or column slice of a larger
            matrix); updated in place.
        sketch: C, d x r, FP32.
        projection: P, k x r, BF16 or FP32 (other float dtypes are converted to FP32).
        coef: a finite Python number, or a 0-dim FP32 tensor on W's device. A tensor is read
            by the kernel only, never on the host (no synchronisation). Where its value is 0
            nothing is stored: W keeps its bits (signed zeros, NaN payloads), even when C or P
            hold inf/NaN.
        seed, offset: rounding key and flat index of ``W[0, 0]``.
        chunk_rows: accepted for signature parity with
            :func:`rgc.reference.lowrank_update_reference` and ignored.
        stochastic_rounding: False rounds BF16 W to nearest even.
        sq_norm_out: None, or a 0-dim FP32 tensor on W's device, overwritten with
            ``sum(float32(W_new)**2)`` over the values stored (W itself where coef is 0).
            Each tile's sum is written to a buffer and the buffer summed by one program in
            index order: no atomics, the same inputs give the same bits on every run.

    Two kernel launches with ``sq_norm_out``, one without (plus a fill for a float ``coef``).
    Bad input raises before W is touched.
    """
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"weight must be a 2-D BF16 or FP32 tensor, got {weight.dim()}-D "
                        f"{weight.dtype}")
    d, k = weight.shape
    if sketch.dim() != 2 or sketch.dtype != torch.float32 or sketch.shape[0] != d:
        raise ValueError(f"sketch must be FP32 of shape ({d}, r) for a weight of shape "
                         f"{(d, k)}, got {sketch.dtype} {tuple(sketch.shape)}")
    r = sketch.shape[1]
    if projection.dim() != 2 or tuple(projection.shape) != (k, r):
        raise ValueError(f"projection must have shape ({k}, {r}) (k x r) to match weight "
                         f"{(d, k)} and sketch {(d, r)}, got {tuple(projection.shape)}")
    if not projection.is_floating_point():
        raise TypeError(f"projection must be floating point, got {projection.dtype}")
    if sq_norm_out is not None and (sq_norm_out.dim() != 0
                                    or sq_norm_out.dtype != torch.float32
                                    or sq_norm_out.device != weight.device):
        raise ValueError(f"sq_norm_out must be a 0-dim FP32 tensor on {weight.device}, got "
                         f"{sq_norm_out.dim()}-dim {sq_norm_out.dtype} on {sq_norm_out.device}")
    _check_seed_offset(seed, offset)
    _check_device(weight, sketch, projection)
    coef = _coef_tensor(coef, weight.device)
    if projection.dtype not in (torch.bfloat16, torch.float32):
        projection = projection.to(torch.float32)
    _backend().lowrank_update_triton(weight, sketch, projection, coef, seed=int(seed),
                                     offset=int(offset),
                                     stochastic_rounding=bool(stochastic_rounding),
                                     sq_norm_out=sq_norm_out)
