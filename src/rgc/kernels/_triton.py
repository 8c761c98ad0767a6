"""Triton kernels and their launchers. Importing this module imports Triton.

Whether the kernels run compiled (CUDA) or in Triton's CPU interpreter is fixed when this
module is first imported, by ``TRITON_INTERPRET`` at that moment (Triton decides it when a
kernel is defined).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rgc.rounding import MIX32_MUL1, MIX32_MUL2, seed_words

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # Triton before 3.4 has no knobs and reads the variable directly
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MUL1 = tl.constexpr(MIX32_MUL1)
_MUL2 = tl.constexpr(MIX32_MUL2)


@triton.jit
def _mix32(x):
    # lowbias32 on uint32; each product is cast back to uint32 so that the wrap mod 2**32
    # does not depend on how Triton types the constant.
    x = x ^ (x >> 16)
    x = (x * _MUL1).to(tl.uint32)
    x = x ^ (x >> 15)
    x = (x * _MUL2).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _bf16_from_bits(x, add):
    """BF16 whose pattern is the upper half of ``bits(x) + add`` (``add`` < 2**16, uint32).

    Built bitwise, so the result does not depend on a backend's float conversion (the
    interpreter's truncates); NaN keeps its sign and top payload bits and is made quiet.
    """
    x_bits = x.to(tl.uint32, bitcast=True)
    upper = tl.where(x != x, (x_bits >> 16) | 0x40, (x_bits + add) >> 16)
    return upper.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_bf16(x, n_lo, n_hi, s_lo, s_hi):
    """FP32 ``x`` -> BF16, stochastically, with the hash bits of flat index ``n_hi:n_lo``."""
    bits = _mix32(_mix32(n_lo ^ s_lo) ^ (n_hi + s_hi))
    return _bf16_from_bits(x, bits & 0xFFFF)


# The hash words are converted with .to(), which a value specialised to a constant (Triton
# does that for 1) would not have.
@triton.jit(do_not_specialize=["s_lo", "s_hi"])
def _stochastic_round_kernel(x_ptr, out_ptr, numel, offset, s_lo, s_hi,
                             BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    n = idx + offset
    out = _round_bf16(x, n.to(tl.uint32), (n >> 32).to(tl.uint32), s_lo.to(tl.uint32),
                      s_hi.to(tl.uint32))
    tl.store(out_ptr + idx, out, mask=mask)


@triton.jit(do_not_specialize=["s_lo", "s_hi"])
def _lowrank_update_kernel(w_ptr, c_ptr, p_ptr, coef, d, k, r,
                           stride_wm, stride_wn, stride_cm, stride_cr, stride_pk, stride_pr,
                           offset, s_lo, s_hi,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           C_PARTS: tl.constexpr, P_PARTS: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    pid = tl.program_id(0)
    # Not tl.cdiv: Triton's library functions are fixed as compiled or interpreted when Triton
    # is imported, the kernels here only when this module is.
    num_n = (k + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n
    pid_n = pid % num_n
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < d
    col_ok = cols < k

    # Tile of H = C P^T. C (and P when FP32) is split into BF16 parts x = x0 + x1 + x2, each
    # part exactly representable, so every product is exact on BF16 tensor cores; the
    # omitted cross terms are below 2**-8 per part of the kept ones (C_PARTS=2: relative
    # error ~2**-16 of |C| |P|^T, C_PARTS=3: ~2**-24, i.e. FP32 accuracy).
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, r, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rr_ok = rr < r
        c = tl.load(c_ptr + rows[:, None] * stride_cm + rr[None, :] * stride_cr,
                    mask=row_ok[:, None] & rr_ok[None, :], other=0.0)
        p = tl.load(p_ptr + cols[None, :] * stride_pk + rr[:, None] * stride_pr,
                    mask=col_ok[None, :] & rr_ok[:, None], other=0.0)
        c0 = c.to(tl.bfloat16)
        p0 = p.to(tl.bfloat16)
        acc = tl.dot(c0.to(DOT_DTYPE), p0.to(DOT_DTYPE), acc)
        if C_PARTS >= 2:
            c_rest = c - c0.to(tl.float32)
            c1 = c_rest.to(tl.bfloat16)
            acc = tl.dot(c1.to(DOT_DTYPE), p0.to(DOT_DTYPE), acc)
            if P_PARTS >= 2:
                p_rest = p.to(tl.float32) - p0.to(tl.float32)
                p1 = p_rest.to(tl.bfloat16)
                acc = tl.dot(c0.to(DOT_DTYPE), p1.to(DOT_DTYPE), acc)
            if C_PARTS >= 3:
                c2 = (c_rest - c1.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(c2.to(DOT_DTYPE), p0.to(DOT_DTYPE), acc)
                if P_PARTS >= 2:
                    acc = tl.dot(c1.to(DOT_DTYPE), p1.to(DOT_DTYPE), acc)
                    p2 = (p_rest - p1.to(tl.float32)).to(tl.bfloat16)
                    acc = tl.dot(c0.to(DOT_DTYPE), p2.to(DOT_DTYPE), acc)

    w_ptrs = w_ptr + rows[:, None] * stride_wm + cols.to(tl.int64)[None, :] * stride_wn
    mask = row_ok[:, None] & col_ok[None, :]
    new = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32) - coef * acc
    if STOCHASTIC:
        # Flat index offset + i*k + j, split into 32-bit halves without a 2-D int64 tile.
        base = offset + rows * k
        base_lo = base.to(tl.uint32)
        n_lo = base_lo[:, None] + cols.to(tl.uint32)[None, :]
        carry = (n_lo < base_lo[:, None]).to(tl.uint32)
        n_hi = (base >> 32).to(tl.uint32)[:, None] + carry
        out = _round_bf16(new, n_lo, n_hi, s_lo.to(tl.uint32), s_hi.to(tl.uint32))
    elif w_ptr.dtype.element_ty == tl.bfloat16:
        # Round to nearest even.
        out = _bf16_from_bits(new, 0x7FFF + ((new.to(tl.uint32, bitcast=True) >> 16) & 1))
    else:
        out = new
    tl.store(w_ptrs, out, mask=mask)


ROUND_BLOCK = 1024


def stochastic_round_triton(out: torch.Tensor, x: torch.Tensor, *, seed: int,
                            offset: int = 0) -> None:
    """Launch the rounding kernel: contiguous FP32 ``x`` -> contiguous BF16 ``out``."""
    numel = x.numel()
    if numel == 0:
        return
    s_lo, s_hi = seed_words(seed)
    grid = (triton.cdiv(numel, ROUND_BLOCK),)
    _stochastic_round_kernel[grid](x, out, numel, offset, s_lo, s_hi, BLOCK=ROUND_BLOCK,
                                   num_warps=4, enable_fp_fusion=True)


def default_config(d: int, k: int, r: int, weight_dtype: torch.dtype,
                   projection_dtype: torch.dtype) -> dict:
    """Tile sizes and precision of the fused update (what ``lowrank_update_triton`` uses)."""
    block_r = 16 if r <= 16 else 32 if r <= 32 else 64
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=block_r, C_PARTS=3,
                P_PARTS=1 if projection_dtype == torch.bfloat16 else 3,
                num_warps=4, num_stages=2)


def lowrank_update_triton(weight: torch.Tensor, sketch: torch.Tensor, projection: torch.Tensor,
                          coef: float, *, seed: int, offset: int = 0,
                          stochastic_rounding: bool = True, config: dict | None = None) -> None:
    """Launch the fused update on validated inputs (see :func:`rgc.kernels.lowrank_update_`).

    ``config`` overrides entries of :func:`default_config` (used by the benchmarks).
    """
    d, k = weight.shape
    r = sketch.shape[1]
    if d == 0 or k == 0:
        return
    cfg = default_config(d, k, r, weight.dtype, projection.dtype)
    cfg.update(config or {})
    s_lo, s_hi = seed_words(seed)
    grid = (triton.cdiv(d, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_N"]),)
    _lowrank_update_kernel[grid](
        weight, sketch, projection, float(coef), d, k, r,
        weight.stride(0), weight.stride(1), sketch.stride(0), sketch.stride(1),
        projection.stride(0), projection.stride(1), offset, s_lo, s_hi,
        # The interpreter's tl.dot cannot multiply BF16 operands; FP32 operands holding the
        # same BF16-exact parts give the same products.
        DOT_DTYPE=tl.float32 if INTERPRETED else tl.bfloat16,
        STOCHASTIC=stochastic_rounding and weight.dtype == torch.bfloat16,
        enable_fp_fusion=True, **cfg)
