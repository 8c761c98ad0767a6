"""Triton kernels and their launchers. Importing this module imports Triton.

Whether the kernels run compiled (CUDA) or in Triton's CPU interpreter is fixed when this
module is first imported, by ``TRITON_INTERPRET`` at that moment (Triton decides it when a
kernel is defined).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from rgc._native import BOX_MULLER_CONSTANTS
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


@triton.jit
def _join_words(lo, hi):
    """The int64 whose 32-bit halves are the patterns of int32 ``lo`` and ``hi``."""
    return (hi.to(tl.uint32).to(tl.int64) << 32) | lo.to(tl.uint32).to(tl.int64)


# The seed and offset arrive as 32-bit words passed as int32 patterns (see _words) and are not
# specialised: every seed and offset runs the same compiled kernel (a value Triton
# specialised to the constant 1 would also have no .to()).
@triton.jit(do_not_specialize=["off_lo", "off_hi", "s_lo", "s_hi"])
def _stochastic_round_kernel(x_ptr, out_ptr, numel, off_lo, off_hi, s_lo, s_hi,
                             BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    n = idx + _join_words(off_lo, off_hi)
    out = _round_bf16(x, n.to(tl.uint32), (n >> 32).to(tl.uint32), s_lo.to(tl.uint32),
                      s_hi.to(tl.uint32))
    tl.store(out_ptr + idx, out, mask=mask)


# The float32 constants of rgc.projection's CPU Box-Muller (exact in float32, so the kernel
# uses the same values), and the bit pattern of float32(sqrt(2)).
_BM = {name: tl.constexpr(float(np.float32(v))) for name, v in BOX_MULLER_CONSTANTS.items()}
_SQRT2_BITS = tl.constexpr(int(np.float32(BOX_MULLER_CONSTANTS["SQRT2"]).view(np.uint32)))
_L1, _L2, _L3, _L4, _LN2 = (_BM[n] for n in ("L1", "L2", "L3", "L4", "LN2"))
_S1, _S2, _S3, _S4, _S5, _S6 = (_BM[f"S{j}"] for j in range(1, 7))
_C1, _C2, _C3, _C4, _C5, _C6, _C7 = (_BM[f"C{j}"] for j in range(1, 8))
_XSTEP = _BM["XSTEP"]


@triton.jit(do_not_specialize=["s_lo", "s_hi"])
def _gaussian_kernel(g_ptr, k, h, ldg, s_lo, s_hi, BLOCK: tl.constexpr):
    """Box-Muller pairs ``m = i h + c`` of ``G`` (rows ``ldg`` apart): the operations of
    ``rgc_gaussian`` in :mod:`rgc._native`, one by one. Launched with fused multiply-adds off,
    and with IEEE division and square root, every value has the CPU's bits."""
    m = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pairs = k.to(tl.int64) * h
    mask = m < pairs
    s_lo = s_lo.to(tl.uint32)
    s_hi = s_hi.to(tl.uint32)
    m32 = m.to(tl.uint32)
    w0 = _mix32(_mix32(m32 ^ s_lo) ^ s_hi) >> 8
    w1 = _mix32(_mix32((pairs.to(tl.uint32) + m32) ^ s_lo) ^ s_hi) >> 8
    # -2 ln u, u = (w0 + 1) 2^-24 = 2^(e - 24) f, f in [sqrt(1/2), sqrt(2))
    nb = (w0 + 1).to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True)
    e = (nb >> 23).to(tl.int32) - 127
    fb = (nb & 0x007FFFFF) | 0x3F800000
    big = fb > _SQRT2_BITS
    fb = tl.where(big, fb - 0x00800000, fb)
    e = e + big.to(tl.int32)
    f = fb.to(tl.float32, bitcast=True)
    s = tl.div_rn(f - 1.0, f + 1.0)
    z = s * s
    p = _L4 * z + _L3
    p = p * z + _L2
    p = p * z + _L1
    p = p * z + 1.0
    ln_u = (e - 24).to(tl.float32) * _LN2 + (2.0 * s) * p
    rho = tl.sqrt_rn(-2.0 * ln_u)
    # angle: quadrant q and x in [0, pi/2)
    q = w1 >> 22
    x = (w1 & 0x3FFFFF).to(tl.int32).to(tl.float32) * _XSTEP
    y = x * x
    sp = _S6 * y + _S5
    sp = sp * y + _S4
    sp = sp * y + _S3
    sp = sp * y + _S2
    sp = sp * y + _S1
    sp = sp * y + 1.0
    sn = x * sp
    cs = _C7 * y + _C6
    cs = cs * y + _C5
    cs = cs * y + _C4
    cs = cs * y + _C3
    cs = cs * y + _C2
    cs = cs * y + _C1
    cs = cs * y + 1.0
    cq = tl.where(q == 0, cs, tl.where(q == 1, -sn, tl.where(q == 2, -cs, sn)))
    sq = tl.where(q == 0, sn, tl.where(q == 1, cs, tl.where(q == 2, -sn, -cs)))
    i = m // h
    row = g_ptr + i * ldg + (m - i * h)
    tl.store(row, rho * cq, mask=mask)
    tl.store(row + h, rho * sq, mask=mask)


@triton.jit
def _add(a, b):
    # tl.sum is a Triton library function (see the note on tl.cdiv below).
    return a + b


@triton.jit(do_not_specialize=["off_lo", "off_hi", "s_lo", "s_hi"])
def _lowrank_update_kernel(w_ptr, c_ptr, p_ptr, coef_ptr, partial_ptr, d, k, r,
                           stride_wm, stride_wn, stride_cm, stride_cr, stride_pk, stride_pr,
                           off_lo, off_hi, s_lo, s_hi,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           C_PARTS: tl.constexpr, P_PARTS: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of W: ``W - coef * C P^T`` stored, its sum of squares written.

    ``partial_ptr[program]`` receives the FP32 sum of squares of the tile's stored values.
    Pointer offsets inside a tile are int32 (the launcher checks that they fit); 64-bit
    pointers per element would double the registers the tile needs.
    """
    pid = tl.program_id(0)
    # Not tl.cdiv: Triton's library functions are fixed as compiled or interpreted when Triton
    # is imported, the kernels here only when this module is.
    num_n = (k + BLOCK_N - 1) // BLOCK_N
    row0 = (pid // num_n) * BLOCK_M
    col0 = (pid % num_n) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    row_ok = rows < d - row0
    col_ok = cols < k - col0
    mask = row_ok[:, None] & col_ok[None, :]

    coef = tl.load(coef_ptr)
    # Tile of H = C P^T. C (and P when FP32) is split into BF16 parts x = x0 + x1 + x2, each
    # part exactly representable, so every product is exact on BF16 tensor cores; the
    # omitted cross terms are below 2**-8 per part of the kept ones (C_PARTS=2: relative
    # error ~2**-16 of |C| |P|^T, C_PARTS=3: ~2**-24, i.e. FP32 accuracy).
    # Only the int32 offsets stay live across the loop; the 64-bit base moves with r0.
    c_off = rows[:, None] * stride_cm + rr[None, :] * stride_cr
    p_off = cols[None, :] * stride_pk + rr[:, None] * stride_pr
    c_base = c_ptr + row0.to(tl.int64) * stride_cm
    p_base = p_ptr + col0.to(tl.int64) * stride_pk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, r, BLOCK_R):
        rr_ok = rr < r - r0
        c = tl.load(c_base + r0 * stride_cr + c_off, mask=row_ok[:, None] & rr_ok[None, :],
                    other=0.0)
        p = tl.load(p_base + r0 * stride_pr + p_off, mask=col_ok[None, :] & rr_ok[:, None],
                    other=0.0)
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

    # W after the loop: its addresses and values are not live while H is formed (other
    # programs on the SM keep the memory system busy meanwhile).
    w_ptrs = (w_ptr + (row0.to(tl.int64) * stride_wm + col0.to(tl.int64) * stride_wn)
              + (rows[:, None] * stride_wm + cols[None, :] * stride_wn))
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    new = w - coef * acc
    if STOCHASTIC:
        # Flat index offset + i*k + j, split into 32-bit halves without a 2-D int64 tile.
        base = _join_words(off_lo, off_hi) + (row0 + rows).to(tl.int64) * k
        base_lo = base.to(tl.uint32)
        n_lo = base_lo[:, None] + (col0 + cols).to(tl.uint32)[None, :]
        carry = (n_lo < base_lo[:, None]).to(tl.uint32)
        n_hi = (base >> 32).to(tl.uint32)[:, None] + carry
        out = _round_bf16(new, n_lo, n_hi, s_lo.to(tl.uint32), s_hi.to(tl.uint32))
    elif w_ptr.dtype.element_ty == tl.bfloat16:
        # Round to nearest even.
        out = _bf16_from_bits(new, 0x7FFF + ((new.to(tl.uint32, bitcast=True) >> 16) & 1))
    else:
        out = new
    # coef == 0 stores nothing, so W keeps its bits even when C or P hold inf/NaN.
    skip = coef == 0
    stored = tl.where(mask, tl.where(skip, w, out.to(tl.float32)), 0.0)
    tl.store(partial_ptr + pid, tl.reduce(tl.reduce(stored * stored, 1, _add), 0, _add))
    # (A select: the interpreter cannot AND a loaded scalar into a mask.)
    tl.store(w_ptrs, out, mask=tl.where(skip, False, mask))


@triton.jit
def _sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[0] = sum(x[:n])`` in one program, in an order fixed by ``n`` and ``BLOCK``."""
    idx = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(x_ptr + start + idx, mask=idx < n - start, other=0.0)
    tl.store(out_ptr, tl.reduce(acc, 0, _add))


ROUND_BLOCK = 1024


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _words(v: int) -> tuple[int, int]:
    """``(lo, hi)`` 32-bit halves of ``0 <= v < 2**64`` as int32 patterns (always typed i32)."""
    return _int32(v), _int32(v >> 32)


def _seed_words(seed: int) -> tuple[int, int]:
    return tuple(_int32(w) for w in seed_words(seed))


def stochastic_round_launches(out: torch.Tensor, x: torch.Tensor, *, seed: int,
                              offset: int = 0) -> list[tuple]:
    """The launch of the rounding kernel as ``[(kernel, grid, args, kwargs)]``."""
    grid = (triton.cdiv(x.numel(), ROUND_BLOCK),)
    return [(_stochastic_round_kernel, grid, (x, out, x.numel(), *_words(offset),
                                              *_seed_words(seed)),
             dict(BLOCK=ROUND_BLOCK, num_warps=4, enable_fp_fusion=True))]


def stochastic_round_triton(out: torch.Tensor, x: torch.Tensor, *, seed: int,
                            offset: int = 0) -> None:
    """Launch the rounding kernel: contiguous FP32 ``x`` -> contiguous BF16 ``out``."""
    if x.numel() == 0:
        return
    for kernel, grid, args, kwargs in stochastic_round_launches(out, x, seed=seed,
                                                                offset=offset):
        kernel[grid](*args, **kwargs)


GAUSSIAN_BLOCK = 1024


def gaussian_launches(g: torch.Tensor, k: int, half: int, *, seed: int) -> list[tuple]:
    """The launch of the Gaussian kernel on ``g`` (k x >= 2 half FP32, unit column stride)."""
    grid = (triton.cdiv(k * half, GAUSSIAN_BLOCK),)
    s_lo, s_hi = (_int32(w) for w in seed_words(seed, "projection-gaussian"))
    return [(_gaussian_kernel, grid, (g, k, half, g.stride(0), s_lo, s_hi),
             dict(BLOCK=GAUSSIAN_BLOCK, num_warps=4, enable_fp_fusion=False))]


def gaussian_triton(g: torch.Tensor, k: int, half: int, *, seed: int) -> None:
    for kernel, grid, args, kwargs in gaussian_launches(g, k, half, seed=seed):
        kernel[grid](*args, **kwargs)


# The launch table of the fused update: one tile shape for every shape and rank (r is looped
# over in blocks of BLOCK_R inside the kernel), chosen so that no configuration spills
# registers on sm_80, sm_90 or sm_100; tests/test_kernels_aot.py compiles them all ahead of
# time and checks, docs/kernels.md has the register table and the reasons.
UPDATE_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, C_PARTS=3, num_warps=8, num_stages=1)
# Register caps (``maxnreg``): 128 keeps two programs of 8 warps per SM where Triton can
# vectorise every load; a misaligned layout needs more registers (per-element addresses),
# and without a cap ptxas may pick 128 and spill (sm_80), so it gets 160.
MAXNREG_ALIGNED = 128
MAXNREG_MISALIGNED = 160
SUM_BLOCK = 2048


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether Triton specialises every size, stride and pointer as 16-divisible (or 1)."""
    return all(t.data_ptr() % 16 == 0
               and all(n % 16 == 0 for n in t.shape)
               and all(s == 1 or s % 16 == 0 for s in t.stride()) for t in tensors)


def default_config(weight: torch.Tensor, sketch: torch.Tensor, projection: torch.Tensor,
                   stochastic_rounding: bool = True) -> dict:
    """Tiles, precision and kernel options of the fused update for these operands."""
    return dict(UPDATE_TILE, P_PARTS=1 if projection.dtype == torch.bfloat16 else 3,
                STOCHASTIC=bool(stochastic_rounding) and weight.dtype == torch.bfloat16,
                maxnreg=(MAXNREG_ALIGNED if _aligned(weight, sketch, projection)
                         else MAXNREG_MISALIGNED))


def _check_int32_offsets(name: str, extents: list[tuple[int, int]]) -> None:
    span = sum((n - 1) * stride for n, stride in extents)
    if span >= 2**31:
        raise ValueError(f"{name}'s strides {tuple(s for _, s in extents)} are too large for "
                         "the kernel's 32-bit offsets within a tile; pass a contiguous copy")


def update_launches(weight: torch.Tensor, sketch: torch.Tensor, projection: torch.Tensor,
                    coef: torch.Tensor, partials: torch.Tensor, sq_norm_out: torch.Tensor | None,
                    *, seed: int, offset: int, stochastic_rounding: bool,
                    config: dict | None = None) -> list[tuple]:
    """The kernel launches of one fused update, as ``(kernel, grid, args, kwargs)``.

    ``coef`` is a 0-dim FP32 tensor; ``partials`` an FP32 buffer of :func:`update_programs`
    elements. The last launch, present when ``sq_norm_out`` is given, sums ``partials`` into
    it. ``config`` overrides entries of :func:`default_config` (benchmarks).
    Used both to run the update and to compile it ahead of time (``rgc.kernels._aot``).
    """
    d, k = weight.shape
    r = sketch.shape[1]
    cfg = default_config(weight, sketch, projection, stochastic_rounding)
    cfg.update(config or {})
    _check_int32_offsets("weight", [(cfg["BLOCK_M"], weight.stride(0)),
                                    (cfg["BLOCK_N"], weight.stride(1))])
    # The r-loop adds r0 * stride in int32 too.
    r_span = max(r, cfg["BLOCK_R"])
    _check_int32_offsets("sketch", [(cfg["BLOCK_M"], sketch.stride(0)),
                                    (r_span, sketch.stride(1))])
    _check_int32_offsets("projection", [(cfg["BLOCK_N"], projection.stride(0)),
                                        (r_span, projection.stride(1))])
    grid = (update_programs(d, k, cfg),)
    launches = [(_lowrank_update_kernel, grid,
                 (weight, sketch, projection, coef, partials, d, k, r,
                  weight.stride(0), weight.stride(1), sketch.stride(0), sketch.stride(1),
                  projection.stride(0), projection.stride(1), *_words(offset),
                  *_seed_words(seed)),
                 # The interpreter's tl.dot cannot multiply BF16 operands; FP32 operands
                 # holding the same BF16-exact parts give the same products.
                 dict(DOT_DTYPE=tl.float32 if INTERPRETED else tl.bfloat16,
                      enable_fp_fusion=True, **cfg))]
    if sq_norm_out is not None:
        launches.append((_sum_kernel, (1,), (partials, sq_norm_out, grid[0]),
                         dict(BLOCK=SUM_BLOCK, num_warps=4)))
    return launches


def update_programs(d: int, k: int, config: dict | None = None) -> int:
    """Number of programs (tiles of W) of the fused update: the length of its partial sums."""
    cfg = dict(UPDATE_TILE, **(config or {}))
    return triton.cdiv(d, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_N"])


def lowrank_update_triton(weight: torch.Tensor, sketch: torch.Tensor, projection: torch.Tensor,
                          coef: torch.Tensor, *, seed: int, offset: int = 0,
                          stochastic_rounding: bool = True,
                          sq_norm_out: torch.Tensor | None = None,
                          config: dict | None = None) -> None:
    """Launch the fused update on validated inputs (see :func:`rgc.kernels.lowrank_update_`).

    ``coef`` is a 0-dim FP32 tensor on W's device (read by the kernel, never by the host).
    """
    d, k = weight.shape
    if d == 0 or k == 0:
        if sq_norm_out is not None:
            sq_norm_out.zero_()
        return
    partials = torch.empty(update_programs(d, k, config), dtype=torch.float32,
                           device=weight.device)
    for kernel, grid, args, kwargs in update_launches(
            weight, sketch, projection, coef, partials, sq_norm_out, seed=seed, offset=offset,
            stochastic_rounding=stochastic_rounding, config=config):
        kernel[grid](*args, **kwargs)
