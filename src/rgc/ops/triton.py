"""Triton kernels of the :mod:`rgc.ops` primitives, and their launchers.

One launcher per operator, with the positional signature of its function in
:mod:`rgc.ops.reference`; :mod:`rgc.ops` calls them for CUDA tensors (and on the CPU under
``RGC_IMPL=triton TRITON_INTERPRET=1``). Importing this module imports Triton.

Whether the kernels run compiled (CUDA) or in Triton's CPU interpreter is fixed when this
module is first imported, by ``TRITON_INTERPRET`` at that moment (Triton decides it when a
kernel is defined): :data:`INTERPRETED`.

Grouping. The batched launchers take lists of stacks ``[E, d, k]`` and launch once per
*group*: the stacks that share shapes, dtypes and strides (in a model, every layer of one
projection shape). A group's per-stack data (base pointers, seed words, offsets, row lengths,
its index ``m`` in the list) travel in an int64 table built on the host and copied to the
device once; the grid runs over (tile, expert, stack), so a group is one launch whatever the
number of layers. Strides are kernel arguments, equal within a group, so Triton specialises
them (unit strides, multiples of 16) as it would for a single tensor; base pointers come from
the table, so their 16-byte alignment is passed as the ``PTR_ALIGNED`` constexpr and stated
to the compiler with ``tl.multiple_of``.

Reductions are deterministic: a kernel writes one FP32 partial per tile (or row block) and a
second kernel adds each matrix's partials in index order; no atomics.
"""

from __future__ import annotations

import math
import numbers
import os
import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rgc.bits import MIX32_MUL1, MIX32_MUL2, seed_words
from rgc.ops import reference, triton_buffers
from rgc.ops.reference import BM, GAUSSIAN_LABEL, SQRT2_BITS, one_pass

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # Triton before 3.4 has no knobs and reads the variable directly
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["INTERPRETED", "gaussian_matrices", "lowrank_update_", "make_projections_",
           "orthonormalize", "random_words", "row_adam_", "sketch_stats", "stochastic_round_",
           "sum_squares"]

_MUL1 = tl.constexpr(MIX32_MUL1)
_MUL2 = tl.constexpr(MIX32_MUL2)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)

# Columns of the per-stack int64 table of the update and norm kernels: base pointers of W, U
# and P, the stack's index m in the list, seed words, offset words, row length.
TABLE_COLUMNS = ("w", "u", "p", "m", "s_lo", "s_hi", "off_lo", "off_hi", "row_length")
_W, _U, _P, _M, _SLO, _SHI, _OLO, _OHI, _ROWLEN = (tl.constexpr(i)
                                                   for i in range(len(TABLE_COLUMNS)))
_TABLE = tl.constexpr(len(TABLE_COLUMNS))
# Columns of RowAdam's table: base pointers of S, m and v, the stack's index m in the list.
ADAM_TABLE_COLUMNS = ("s", "exp_avg", "exp_avg_sq", "m")
_ADAM_S, _ADAM_EXP_AVG, _ADAM_EXP_AVG_SQ, _ADAM_M = (tl.constexpr(i) for i in range(4))
_ADAM_TABLE = tl.constexpr(len(ADAM_TABLE_COLUMNS))


# ------------------------------------------------------------------------ device functions

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
def _hash(n_lo, n_hi, s_lo, s_hi):
    """The 32 hash bits of flat index ``n_hi:n_lo`` for seed words ``s_lo, s_hi`` (uint32)."""
    return _mix32(_mix32(n_lo ^ s_lo) ^ (n_hi + s_hi))


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
def _join_words(lo, hi):
    """The int64 whose 32-bit halves are the patterns of ``lo`` and ``hi``."""
    return (hi.to(tl.uint32).to(tl.int64) << 32) | lo.to(tl.uint32).to(tl.int64)


@triton.jit
def _pointer(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 ``address`` read from a table as a pointer to DTYPE (16-byte aligned if
    ALIGNED: the launcher checked it, the compiler cannot see it)."""
    ptr = address.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


# Triton's own sum combiner, passed to tl.reduce: the interpreter recognises it and sums with
# numpy (any other combiner runs element by element in Python, ~100x slower). (tl.sum itself is
# a library function, fixed as compiled or interpreted when Triton is imported, whereas the
# kernels here are fixed when this module is; only builtins and plain references are used.)
_sum = tl.standard._sum_combine


@triton.jit
def _tile_sum(x):
    """Sum of a 2-D tile: rows first, then the row sums."""
    return tl.reduce(tl.reduce(x, 1, _sum), 0, _sum)


@triton.jit
def _tile_square_sum(x):
    """Float64 sum of the squares of an FP32 tile: each square exact, so the weight norm does
    not depend on the tile order beyond float64 rounding (see reference.square_sum)."""
    x64 = x.to(tl.float64)
    return _tile_sum(x64 * x64)


@triton.jit
def _split_dot(a, b, acc, A_PARTS: tl.constexpr, B_PARTS: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """``acc + a @ b`` with FP32 ``a`` (and ``b``) split into BF16 parts ``x = x0 + x1 + x2``.

    Each part is exactly representable, so every part product is exact on BF16 tensor cores;
    the omitted cross terms are below 2**-8 per part of the kept ones (2 parts: relative error
    ~2**-16 of |a| |b|, 3 parts: ~2**-24, i.e. FP32 accuracy). ``B_PARTS`` is 1 for a BF16
    ``b`` (exact in one part) or 3.
    """
    a0 = a.to(tl.bfloat16)
    b0 = b.to(tl.bfloat16)
    acc = tl.dot(a0.to(DOT_DTYPE), b0.to(DOT_DTYPE), acc)
    if A_PARTS >= 2:
        a_rest = a - a0.to(tl.float32)
        a1 = a_rest.to(tl.bfloat16)
        acc = tl.dot(a1.to(DOT_DTYPE), b0.to(DOT_DTYPE), acc)
        if B_PARTS >= 2:
            b_rest = b.to(tl.float32) - b0.to(tl.float32)
            b1 = b_rest.to(tl.bfloat16)
            acc = tl.dot(a0.to(DOT_DTYPE), b1.to(DOT_DTYPE), acc)
        if A_PARTS >= 3:
            a2 = (a_rest - a1.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(a2.to(DOT_DTYPE), b0.to(DOT_DTYPE), acc)
            if B_PARTS >= 2:
                acc = tl.dot(a1.to(DOT_DTYPE), b1.to(DOT_DTYPE), acc)
                b2 = (b_rest - b1.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(a0.to(DOT_DTYPE), b2.to(DOT_DTYPE), acc)
    return acc


# --------------------------------------------------------------------------------- kernels

# Seeds and offsets arrive as 32-bit words passed as int32 patterns (see _words) and are not
# specialised: every seed and offset runs the same compiled kernel (a value Triton
# specialised to the constant 1 would also have no .to()).
@triton.jit(do_not_specialize=["off_lo", "off_hi", "s_lo", "s_hi"])
def _stochastic_round_kernel(x_ptr, out_ptr, numel, off_lo, off_hi, s_lo, s_hi,
                             BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    n = idx + _join_words(off_lo, off_hi)
    bits = _hash(n.to(tl.uint32), (n >> 32).to(tl.uint32), s_lo.to(tl.uint32),
                 s_hi.to(tl.uint32))
    tl.store(out_ptr + idx, _bf16_from_bits(x, bits & 0xFFFF), mask=mask)


@triton.jit(do_not_specialize=["off_lo", "off_hi", "s_lo", "s_hi"])
def _random_words_kernel(out_ptr, numel, off_lo, off_hi, s_lo, s_hi, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n = idx + _join_words(off_lo, off_hi)
    bits = _hash(n.to(tl.uint32), (n >> 32).to(tl.uint32), s_lo.to(tl.uint32),
                 s_hi.to(tl.uint32))
    tl.store(out_ptr + idx, bits.to(tl.int32, bitcast=True), mask=idx < numel)


# The float32 constants of the reference Box-Muller (rgc.ops.reference.BM, already float32
# values) and the bit pattern of float32(sqrt(2)).
_SQRT2_BITS = tl.constexpr(SQRT2_BITS)
_L1, _L2, _L3, _L4, _LN2 = (tl.constexpr(BM[n]) for n in ("L1", "L2", "L3", "L4", "LN2"))
_S1, _S2, _S3, _S4, _S5, _S6 = (tl.constexpr(BM[f"S{j}"]) for j in range(1, 7))
_C1, _C2, _C3, _C4, _C5, _C6, _C7 = (tl.constexpr(BM[f"C{j}"]) for j in range(1, 8))
_XSTEP = tl.constexpr(BM["XSTEP"])


@triton.jit
def _rounded(x, OUT_DTYPE: tl.constexpr):
    """FP32 or float64 ``x`` in OUT_DTYPE, rounded to nearest even (BF16 bitwise: the
    interpreter's conversion truncates); float64 reaches BF16 and FP16 through FP32."""
    if OUT_DTYPE == tl.float64:
        return x.to(tl.float64)
    x32 = x.to(tl.float32)
    if OUT_DTYPE == tl.bfloat16:
        return _bf16_from_bits(x32, 0x7FFF + ((x32.to(tl.uint32, bitcast=True) >> 16) & 1))
    return x32.to(OUT_DTYPE)


# Sizes and the row stride are not specialised: one binary per output dtype.
@triton.jit(do_not_specialize=["k", "h", "n_cols", "stride_ok", "divisor"])
def _gaussian_kernel(table_ptr, k, h, n_cols, stride_ok, stride_or, divisor,
                     OUT_DTYPE: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """Box-Muller pairs ``m = i h + c`` of the ``G`` of table row ``s`` (target pointer, seed
    words): the float32 operations of :func:`rgc.ops.reference.gaussian_matrices`, one by one.
    ``G[i, c]`` and ``G[i, h + c]`` (if ``h + c < n_cols``) go to the target, divided by
    ``divisor`` if SCALED (the ``gaussian`` projection) and rounded to OUT_DTYPE. Launched with
    fused multiply-adds off, and with IEEE division and square root, every value has the
    reference's bits."""
    s = tl.program_id(1)
    m = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pairs = k.to(tl.int64) * h
    mask = m < pairs
    entry = table_ptr + 3 * s
    s_lo = tl.load(entry + 1).to(tl.uint32)
    s_hi = tl.load(entry + 2).to(tl.uint32)
    m32 = m.to(tl.uint32)
    zero = tl.full((BLOCK,), 0, tl.uint32)  # (tl.zeros_like is a library function)
    w0 = _hash(m32, zero, s_lo, s_hi) >> 8
    w1 = _hash(pairs.to(tl.uint32) + m32, zero, s_lo, s_hi) >> 8
    # -2 ln u, u = (w0 + 1) 2^-24 = 2^(e - 24) f, f in [sqrt(1/2), sqrt(2))
    nb = (w0 + 1).to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True)
    e = (nb >> 23).to(tl.int32) - 127
    fb = (nb & 0x007FFFFF) | 0x3F800000
    big = fb > _SQRT2_BITS
    fb = tl.where(big, fb - 0x00800000, fb)
    e = e + big.to(tl.int32)
    f = fb.to(tl.float32, bitcast=True)
    sr = tl.div_rn(f - 1.0, f + 1.0)
    z = sr * sr
    p = _L4 * z + _L3
    p = p * z + _L2
    p = p * z + _L1
    p = p * z + 1.0
    ln_u = (e - 24).to(tl.float32) * _LN2 + (2.0 * sr) * p
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
    g_cos = rho * cq
    g_sin = rho * sq
    if SCALED:
        g_cos = tl.div_rn(g_cos, divisor)
        g_sin = tl.div_rn(g_sin, divisor)
    i = m // h
    c = m - i * h
    row = tl.load(entry).to(tl.pointer_type(OUT_DTYPE)) + i * stride_ok
    tl.store(row + c * stride_or, _rounded(g_cos, OUT_DTYPE), mask=mask)
    tl.store(row + (h + c) * stride_or, _rounded(g_sin, OUT_DTYPE), mask=mask & (h + c < n_cols))


@triton.jit(do_not_specialize=["k", "r", "stride_ok", "mag_lo", "mag_hi"])
def _rademacher_kernel(table_ptr, k, r, stride_ok, stride_or, mag_lo, mag_hi,
                       OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Entries ``n = i r + j`` of the Rademacher projection of table row ``s`` (target
    pointer, seed words): ``+-magnitude`` (its bit pattern ``mag_hi:mag_lo`` in OUT_DTYPE),
    negative where the hash word of ``n`` has its top bit set. Integer operations only."""
    s = tl.program_id(1)
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = n < k.to(tl.int64) * r
    entry = table_ptr + 3 * s
    bits = _hash(n.to(tl.uint32), (n >> 32).to(tl.uint32), tl.load(entry + 1).to(tl.uint32),
                 tl.load(entry + 2).to(tl.uint32))
    magnitude = _join_words(mag_lo, mag_hi)
    if OUT_DTYPE == tl.float64:
        value = (magnitude.to(tl.uint64) | ((bits >> 31).to(tl.uint64) << 63)).to(
            tl.float64, bitcast=True)
    elif OUT_DTYPE == tl.float32:
        value = (magnitude.to(tl.uint32) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    else:
        value = (magnitude.to(tl.uint32) | ((bits >> 16) & 0x8000)).to(tl.uint16).to(
            OUT_DTYPE, bitcast=True)
    i = n // r
    out = tl.load(entry).to(tl.pointer_type(OUT_DTYPE)) + i * stride_ok + (n - i * r) * stride_or
    tl.store(out, value, mask=mask)


@triton.jit
def _tile_cholesky(a, n, BLOCK: tl.constexpr):
    """``(L, L^-1)`` of the leading n x n block of a symmetric positive definite BLOCK x BLOCK
    float64 tile (its lower triangle is read; zeros elsewhere): column by column in registers,
    then forward substitution row by row; lower triangular, exact zeros above the diagonal
    and outside the n x n block. A column or row is taken out of the tile as a sum of it and
    zeros, which is exact."""
    idx = tl.arange(0, BLOCK)
    rows = idx[:, None]
    cols = idx[None, :]
    low = tl.full((BLOCK, BLOCK), 0.0, tl.float64)
    for j in range(n):
        col = tl.reduce(tl.where(cols == j, a, 0.0), 1, _sum)
        root = tl.sqrt(tl.reduce(tl.where(idx == j, col, 0.0), 0, _sum))
        col = tl.where(idx > j, col / root, tl.where(idx == j, root, 0.0))
        low = tl.where(cols == j, col[:, None], low)
        a = a - col[:, None] * col[None, :]
    inv = tl.full((BLOCK, BLOCK), 0.0, tl.float64)
    for i in range(n):
        row = tl.reduce(tl.where(rows == i, low, 0.0), 0, _sum)
        diagonal = tl.reduce(tl.where(idx == i, row, 0.0), 0, _sum)
        done = tl.reduce(row[:, None] * inv, 0, _sum)  # sum over k < i of L[i, k] inv[k, :]
        inv = tl.where(rows == i, ((tl.where(idx == i, 1.0, 0.0) - done) / diagonal)[None, :],
                       inv)
    return low, inv


@triton.jit
def _block(base, ib, jb, r, BLOCK: tl.constexpr):
    """Pointers and mask of block (ib, jb) of a contiguous r x r matrix."""
    idx = tl.arange(0, BLOCK)
    rows = ib * BLOCK + idx
    cols = jb * BLOCK + idx
    return (base + rows[:, None] * r + cols[None, :],
            (rows < r)[:, None] & (cols < r)[None, :])


@triton.jit(do_not_specialize=["r", "scale_lo", "scale_hi", "shift_lo", "shift_hi"])
def _cholesky_inverse_kernel(gram_ptr, work_ptr, x_ptr, r, scale_lo, scale_hi, shift_lo,
                             shift_hi, X_DTYPE: tl.constexpr, SHIFT: tl.constexpr,
                             BLOCK: tl.constexpr):
    """``X = scale L^-1`` (lower triangular, X_DTYPE) for the Cholesky factor ``L L^T`` of
    Gram ``g`` (r x r, contiguous, FP32 or FP64), all in float64 by one program: a blocked
    right-looking factorisation (diagonal tiles by :func:`_tile_cholesky`, panels and trailing
    updates as tile products), then the blocked inverse, in a fixed order whatever the grid.
    SHIFT first adds ``shift * trace`` to the diagonal (shifted CholeskyQR). ``work`` holds
    L and the unscaled inverse (2 r^2 float64 per matrix). Only blocks on or below the
    diagonal of X are written. Barriers order the program's own stores and loads."""
    g = tl.program_id(0).to(tl.int64)
    gram = gram_ptr + g * r * r
    low = work_ptr + g * 2 * r * r
    inv = low + r * r
    x = x_ptr + g * r * r
    idx = tl.arange(0, BLOCK)
    eye = idx[:, None] == idx[None, :]
    nb = (r + BLOCK - 1) // BLOCK
    shift = 0.0
    if SHIFT:
        trace = tl.full((BLOCK,), 0.0, tl.float64)
        for ib in range(nb):
            rows = ib * BLOCK + idx
            trace += tl.load(gram + rows * (r + 1), mask=rows < r, other=0.0).to(tl.float64)
        shift = tl.reduce(trace, 0, _sum) * _float64(shift_lo, shift_hi)
    for ib in range(nb):
        for jb in range(ib + 1):
            ptrs, mask = _block(gram, ib, jb, r, BLOCK)
            tile = tl.load(ptrs, mask=mask, other=0.0).to(tl.float64)
            if SHIFT:
                tile = tl.where(eye & (ib == jb), tile + shift, tile)
            ptrs, mask = _block(low, ib, jb, r, BLOCK)
            tl.store(ptrs, tile, mask=mask)
    tl.debug_barrier()
    for kb in range(nb):
        ptrs, mask = _block(low, kb, kb, r, BLOCK)
        l_kk, inv_kk = _tile_cholesky(tl.load(ptrs, mask=mask, other=0.0),
                                      tl.minimum(r - kb * BLOCK, BLOCK), BLOCK)
        tl.store(ptrs, l_kk, mask=mask)
        inv_ptrs, _ = _block(inv, kb, kb, r, BLOCK)
        tl.store(inv_ptrs, inv_kk, mask=mask)
        for ib in range(kb + 1, nb):  # the panel: L_ik = A_ik L_kk^-T
            ptrs, mask = _block(low, ib, kb, r, BLOCK)
            panel = tl.dot(tl.load(ptrs, mask=mask, other=0.0), tl.trans(inv_kk))
            tl.debug_barrier()  # every thread has read the block it overwrites
            tl.store(ptrs, panel, mask=mask)
        tl.debug_barrier()
        for ib in range(kb + 1, nb):  # the trailing update: A_ij -= L_ik L_jk^T, j <= i
            ptrs, mask = _block(low, ib, kb, r, BLOCK)
            l_ik = tl.load(ptrs, mask=mask, other=0.0)
            for jb in range(kb + 1, ib + 1):
                ptrs, mask = _block(low, jb, kb, r, BLOCK)
                l_jk = tl.load(ptrs, mask=mask, other=0.0)
                ptrs, mask = _block(low, ib, jb, r, BLOCK)
                tile = tl.load(ptrs, mask=mask, other=0.0) - tl.dot(l_ik, tl.trans(l_jk))
                tl.debug_barrier()
                tl.store(ptrs, tile, mask=mask)
        tl.debug_barrier()
    # inv_ij = -inv_ii sum_{j <= k < i} L_ik inv_kj, block column by block column, down
    for jb in range(nb):
        for ib in range(jb + 1, nb):
            acc = tl.full((BLOCK, BLOCK), 0.0, tl.float64)
            for kb in range(jb, ib):
                ptrs, mask = _block(low, ib, kb, r, BLOCK)
                l_ik = tl.load(ptrs, mask=mask, other=0.0)
                ptrs, mask = _block(inv, kb, jb, r, BLOCK)
                acc = tl.dot(l_ik, tl.load(ptrs, mask=mask, other=0.0), acc)
            ptrs, mask = _block(inv, ib, ib, r, BLOCK)
            inv_ii = tl.load(ptrs, mask=mask, other=0.0)
            ptrs, mask = _block(inv, ib, jb, r, BLOCK)
            tl.store(ptrs, -tl.dot(inv_ii, acc), mask=mask)
            tl.debug_barrier()
    scale = _float64(scale_lo, scale_hi)
    for ib in range(nb):
        for jb in range(ib + 1):
            ptrs, mask = _block(inv, ib, jb, r, BLOCK)
            tile = tl.load(ptrs, mask=mask, other=0.0) * scale
            ptrs, mask = _block(x, ib, jb, r, BLOCK)
            tl.store(ptrs, tile.to(X_DTYPE), mask=mask)


@triton.jit(do_not_specialize=["k", "r", "stride_gm", "stride_gk", "stride_ok"])
def _projection_product_kernel(g_ptr, x_ptr, table_ptr, k, r, stride_gm, stride_gk, stride_gr,
                               stride_ok, stride_or, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               FP64: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               DOT_DTYPE: tl.constexpr):
    """Tile of ``G_s X_s^T`` (k x r; X lower triangular r x r, contiguous, read only on and
    below its diagonal) into the target of table row ``s``, rounded to OUT_DTYPE: in float64
    (FP64), or in FP32 from three BF16 parts of G and X (see :func:`_split_dot`). The sum over
    the r columns of G runs in one order, whatever the grid."""
    s = tl.program_id(2)
    row0 = tl.program_id(0) * BLOCK_M
    col0 = tl.program_id(1) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    g_base = g_ptr + s.to(tl.int64) * stride_gm + rows[:, None].to(tl.int64) * stride_gk
    x_base = x_ptr + s.to(tl.int64) * r * r + cols[None, :] * r
    if FP64:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float64)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for c0 in range(0, tl.minimum(r, col0 + BLOCK_N), BLOCK_K):  # X^T is upper triangular
        c = c0 + kk
        a = tl.load(g_base + c[None, :] * stride_gr, mask=(rows < k)[:, None] & (c < r)[None, :],
                    other=0.0)
        b = tl.load(x_base + c[:, None], mask=(c[:, None] <= cols[None, :]) & (cols < r)[None, :],
                    other=0.0)
        if FP64:
            acc = tl.dot(a.to(tl.float64), b.to(tl.float64), acc)
        else:
            acc = _split_dot(a, b, acc, 3, 3, DOT_DTYPE)
    out = (tl.load(table_ptr + s).to(tl.pointer_type(OUT_DTYPE)) + rows[:, None] * stride_ok
           + cols[None, :] * stride_or)
    tl.store(out, _rounded(acc, OUT_DTYPE), mask=(rows < k)[:, None] & (cols < r)[None, :])


# coefs / decays strides are values, not layouts: never specialised, so a norm pass and an
# update of the same W run binaries that differ only where NORM_ONLY says.
@triton.jit(do_not_specialize=["stride_cm", "stride_ce", "stride_dm", "stride_de"])
def _lowrank_update_kernel(table_ptr, coef_ptr, decay_ptr, partial_ptr, d, k, r,
                           stride_we, stride_wm, stride_wn, stride_ue, stride_um, stride_ur,
                           stride_pk, stride_pr, stride_cm, stride_ce, stride_dm, stride_de,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           C_PARTS: tl.constexpr, P_PARTS: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
                           P_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr,
                           HAS_DECAY: tl.constexpr, NORM_ONLY: tl.constexpr,
                           PTR_ALIGNED: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of matrix ``e`` of stack ``g`` of the group.

    Update: ``W (1 - decay) - coef U P^T`` stored once, the tile's FP32 sum of squares of the
    stored values written to ``partial_ptr``. NORM_ONLY: only the sum of squares of W (the
    same loads and the same reduction, so the same bits). Pointer offsets inside a tile are
    int32 (the launcher checks that they fit); 64-bit pointers per element would double the
    registers the tile needs.
    """
    tile = tl.program_id(0)
    e = tl.program_id(1)
    g = tl.program_id(2)
    entry = table_ptr + g * _TABLE
    # Not tl.cdiv: see _sum.
    num_n = (k + BLOCK_N - 1) // BLOCK_N
    row0 = (tile // num_n) * BLOCK_M
    col0 = (tile % num_n) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < d - row0
    col_ok = cols < k - col0
    mask = row_ok[:, None] & col_ok[None, :]
    w_base = (_pointer(tl.load(entry + _W), W_DTYPE, PTR_ALIGNED) + e.to(tl.int64) * stride_we
              + (row0.to(tl.int64) * stride_wm + col0.to(tl.int64) * stride_wn))
    partial = partial_ptr + (g * tl.num_programs(1) + e) * tl.num_programs(0) + tile
    if NORM_ONLY:
        w = tl.load(w_base + (rows[:, None] * stride_wm + cols[None, :] * stride_wn),
                    mask=mask, other=0.0).to(tl.float32)
        tl.store(partial, _tile_square_sum(w))
    else:
        m = tl.load(entry + _M)
        coef = tl.load(coef_ptr + m * stride_cm + e * stride_ce)
        # Tile of H = U P^T (see _split_dot). Only the int32 offsets stay live across the
        # loop; the 64-bit bases move with r0.
        rr = tl.arange(0, BLOCK_R)
        u_off = rows[:, None] * stride_um + rr[None, :] * stride_ur
        p_off = cols[None, :] * stride_pk + rr[:, None] * stride_pr
        u_base = (_pointer(tl.load(entry + _U), tl.float32, PTR_ALIGNED)
                  + e.to(tl.int64) * stride_ue + row0.to(tl.int64) * stride_um)
        p_base = (_pointer(tl.load(entry + _P), P_DTYPE, PTR_ALIGNED)
                  + col0.to(tl.int64) * stride_pk)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r0 in range(0, r, BLOCK_R):
            rr_ok = rr < r - r0
            u = tl.load(u_base + r0 * stride_ur + u_off, mask=row_ok[:, None] & rr_ok[None, :],
                        other=0.0)
            p = tl.load(p_base + r0 * stride_pr + p_off, mask=col_ok[None, :] & rr_ok[:, None],
                        other=0.0)
            acc = _split_dot(u, p, acc, C_PARTS, P_PARTS, DOT_DTYPE)

        # W after the loop: its addresses and values are not live while H is formed (other
        # programs on the SM keep the memory system busy meanwhile).
        w_ptrs = w_base + (rows[:, None] * stride_wm + cols[None, :] * stride_wn)
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        # coef == 0 selects an exact +0 for coef U P^T (inf/NaN in U or P never reach W).
        h = tl.where(coef != 0, coef * acc, 0.0)
        if HAS_DECAY:
            decay = tl.load(decay_ptr + m * stride_dm + e * stride_de)
            new = w * (1.0 - decay) - h
            skip = tl.where(coef == 0, decay == 0, False)
        else:
            new = w - h
            skip = coef == 0
        if STOCHASTIC:
            # Flat index offset + (e d + i) row_length + j, split into 32-bit halves without
            # a 2-D int64 tile.
            row_length = tl.load(entry + _ROWLEN)
            base = (_join_words(tl.load(entry + _OLO), tl.load(entry + _OHI))
                    + (e.to(tl.int64) * d + row0 + rows) * row_length)
            base_lo = base.to(tl.uint32)
            n_lo = base_lo[:, None] + (col0 + cols).to(tl.uint32)[None, :]
            carry = (n_lo < base_lo[:, None]).to(tl.uint32)
            n_hi = (base >> 32).to(tl.uint32)[:, None] + carry
            bits = _hash(n_lo, n_hi, tl.load(entry + _SLO).to(tl.uint32),
                         tl.load(entry + _SHI).to(tl.uint32))
            out = _bf16_from_bits(new, bits & 0xFFFF)
        elif W_DTYPE == tl.bfloat16:
            # Round to nearest even.
            out = _bf16_from_bits(new, 0x7FFF + ((new.to(tl.uint32, bitcast=True) >> 16) & 1))
        else:
            out = new
        # coef == 0 (and decay == 0) stores nothing, so W keeps its bits.
        stored = tl.where(mask, tl.where(skip, w, out.to(tl.float32)), 0.0)
        tl.store(partial, _tile_square_sum(stored))
        # (A select: the interpreter cannot AND a loaded scalar into a mask.)
        tl.store(w_ptrs, out, mask=tl.where(skip, False, mask))


@triton.jit(do_not_specialize=["n", "stride_om", "stride_oe"])
def _finish_kernel(partial_ptr, flag_ptr, table_ptr, out_ptr, flag_out_ptr, n,
                   stride_om, stride_oe, TABLE: tl.constexpr, M_COL: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_FLAGS: tl.constexpr, CLAMP: tl.constexpr,
                   ACC_DTYPE: tl.constexpr):
    """``out[m, e] = sum`` of the ``n`` partials of matrix ``e`` of stack ``g`` in an order
    fixed by ``n`` and BLOCK (``m`` from column M_COL of the table), added in ACC_DTYPE (the
    partials') and rounded once to ``out``'s FP32; HAS_FLAGS: also ``flag_out[m, e] = (sum
    of its flag partials == 0)``; CLAMP: negative sums become 0."""
    e = tl.program_id(0)
    g = tl.program_id(1)
    start_of = (g * tl.num_programs(0) + e).to(tl.int64) * n
    idx = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), 0.0, ACC_DTYPE)
    bad = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(0, n, BLOCK):
        ok = idx < n - start
        acc += tl.load(partial_ptr + start_of + start + idx, mask=ok, other=0.0)
        if HAS_FLAGS:
            bad += tl.load(flag_ptr + start_of + start + idx, mask=ok, other=0.0)
    total = tl.reduce(acc, 0, _sum).to(tl.float32)
    if CLAMP:
        total = tl.where(total < 0, 0.0, total)  # NaN stays NaN
    m = tl.load(table_ptr + g * TABLE + M_COL)
    tl.store(out_ptr + m * stride_om + e * stride_oe, total)
    if HAS_FLAGS:
        tl.store(flag_out_ptr + m * stride_om + e * stride_oe, tl.reduce(bad, 0, _sum) == 0)


@triton.jit
def _gram_kernel(table_ptr, out_ptr, k, r, stride_pk, stride_pr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, FP64: tl.constexpr,
                 PTR_ALIGNED: tl.constexpr):
    """Tile (i, j) of ``P_g^T P_g`` (see :func:`_gram_tile`), sizes and strides specialised
    (the sketch norms' Grams)."""
    _gram_tile(table_ptr, out_ptr, k, r, stride_pk, stride_pr, BLOCK_R, BLOCK_K, PARTS,
               DOT_DTYPE, P_DTYPE, FP64, PTR_ALIGNED)


# The refresh's Grams: one binary per dtype whatever k, r and G's row stride.
@triton.jit(do_not_specialize=["k", "r", "stride_pk"])
def _refresh_gram_kernel(table_ptr, out_ptr, k, r, stride_pk, stride_pr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, FP64: tl.constexpr,
                         PTR_ALIGNED: tl.constexpr):
    """Tile (i, j) of ``G_g^T G_g`` for the P refresh (see :func:`_gram_tile`)."""
    _gram_tile(table_ptr, out_ptr, k, r, stride_pk, stride_pr, BLOCK_R, BLOCK_K, PARTS,
               DOT_DTYPE, P_DTYPE, FP64, PTR_ALIGNED)


@triton.jit
def _gram_tile(table_ptr, out_ptr, k, r, stride_pk, stride_pr,
               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
               DOT_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, FP64: tl.constexpr,
               PTR_ALIGNED: tl.constexpr):
    """Tile (i, j) of ``P_g^T P_g`` (r x r, reduced over the k rows in order) into
    ``out[g]`` (contiguous). FP32 from BF16 parts (exact for a BF16 P), or FP64 (products of
    FP32 values are exact in FP64)."""
    g = tl.program_id(2)
    i0 = tl.program_id(0) * BLOCK_R
    j0 = tl.program_id(1) * BLOCK_R
    p_ptr = _pointer(tl.load(table_ptr + g), P_DTYPE, PTR_ALIGNED)
    kk = tl.arange(0, BLOCK_K)
    ii = tl.arange(0, BLOCK_R)
    i_ok = ii < r - i0
    j_ok = ii < r - j0
    a_off = kk[None, :] * stride_pk + (i0 + ii)[:, None] * stride_pr
    b_off = kk[:, None] * stride_pk + (j0 + ii)[None, :] * stride_pr
    if FP64:
        acc = tl.full((BLOCK_R, BLOCK_R), 0.0, tl.float64)
    else:
        acc = tl.full((BLOCK_R, BLOCK_R), 0.0, tl.float32)
    base = p_ptr
    for k0 in range(0, k, BLOCK_K):
        k_ok = kk < k - k0
        a = tl.load(base + a_off, mask=i_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(base + b_off, mask=k_ok[:, None] & j_ok[None, :], other=0.0)
        base += BLOCK_K * stride_pk
        if FP64:
            acc = tl.dot(a.to(tl.float64), b.to(tl.float64), acc)
        else:
            acc = _split_dot(a.to(tl.float32), b.to(tl.float32), acc, PARTS, PARTS, DOT_DTYPE)
    out = out_ptr + g.to(tl.int64) * r * r + (i0 + ii)[:, None] * r + (j0 + ii)[None, :]
    tl.store(out, acc, mask=i_ok[:, None] & j_ok[None, :])


@triton.jit
def _sketch_stats_kernel(table_ptr, gram_ptr, partial_ptr, flag_ptr, d, r,
                         stride_ce, stride_cm, stride_cr, BLOCK_M: tl.constexpr,
                         BLOCK_R: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         PTR_ALIGNED: tl.constexpr):
    """Row block of matrix ``e`` of sketch stack ``g``: the FP32 partial of
    ``sum((C G) * C)`` (``G = gram[g]``, r x r contiguous) and the count of non-finite C."""
    blk = tl.program_id(0)
    e = tl.program_id(1)
    g = tl.program_id(2)
    row0 = blk * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    row_ok = rows < d - row0
    c_base = (_pointer(tl.load(table_ptr + 2 * g), tl.float32, PTR_ALIGNED)
              + e.to(tl.int64) * stride_ce + row0.to(tl.int64) * stride_cm)
    c_off = rows[:, None] * stride_cm + rr[None, :] * stride_cr
    g_base = gram_ptr + g.to(tl.int64) * r * r
    g_off = rr[:, None] * r + rr[None, :]
    h2 = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    bad = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j_ok = rr < r - j0
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for k0 in range(0, r, BLOCK_R):
            k_ok = rr < r - k0
            c = tl.load(c_base + k0 * stride_cr + c_off, mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            gb = tl.load(g_base + k0 * r + j0 + g_off, mask=k_ok[:, None] & j_ok[None, :],
                         other=0.0)
            acc = _split_dot(c, gb, acc, 3, 3, DOT_DTYPE)
        cj = tl.load(c_base + j0 * stride_cr + c_off, mask=row_ok[:, None] & j_ok[None, :],
                     other=0.0)
        h2 += acc * cj
        bad += tl.where(tl.abs(cj) <= _FLT_MAX, 0.0, 1.0)
    out = (g * tl.num_programs(1) + e) * tl.num_programs(0) + blk
    tl.store(partial_ptr + out, _tile_sum(h2))
    tl.store(flag_ptr + out, _tile_sum(bad))


@triton.jit
def _float64(lo, hi):
    """The float64 whose bit pattern has the 32-bit halves ``lo``, ``hi`` (a Python float
    argument would arrive as FP32)."""
    return _join_words(lo, hi).to(tl.float64, bitcast=True)


@triton.jit
def _one_minus_power(beta, t):
    """FP32 ``1 - beta^t`` for float64 ``beta`` and int64 ``t >= 0``: the power by binary
    exponentiation in float64 (< 2 log2(t) + 1 roundings), then one rounding to FP32."""
    power = beta * 0.0 + 1.0
    base = beta
    n = t
    while n > 0:
        power = tl.where((n & 1) == 1, power * base, power)
        base = base * base
        n = n >> 1
    return (1.0 - power).to(tl.float32)


# Strides of the [M, E] tables and the beta words are values, not layouts: never specialised
# (nor r, which is also a divisor).
@triton.jit(do_not_specialize=["r", "active_ptr", "steps_ptr", "stride_am", "stride_ae",
                               "stride_tm", "stride_te", "b1_lo", "b1_hi", "b2_lo", "b2_hi"])
def _row_adam_kernel(table_ptr, active_ptr, steps_ptr, d, r,
                     stride_se, stride_sd, stride_sr, stride_me, stride_md, stride_mr,
                     stride_ve, stride_vd, stride_am, stride_ae, stride_tm, stride_te,
                     sign, beta1, rest1, beta2, rest2, eps, b1_lo, b1_hi, b2_lo, b2_hi,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PTR_ALIGNED: tl.constexpr):
    """BLOCK_D rows of matrix ``e`` of stack ``g``: RowAdam's moments and ``U`` into S
    (:func:`rgc.ops.reference.row_adam_`), with ``g = sign S`` (-1 for ``maximize``: exact).
    Two passes over the rows' r columns: the sum of squares of S (for v), then m and U, each
    element of S read and written by one program; m and v are stored only where the matrix
    is active."""
    blk = tl.program_id(0)
    e = tl.program_id(1)
    g = tl.program_id(2)
    entry = table_ptr + g * _ADAM_TABLE
    m = tl.load(entry + _ADAM_M)
    ok = tl.load(active_ptr + m * stride_am + e * stride_ae) != 0
    t = tl.load(steps_ptr + m * stride_tm + e * stride_te)
    correction1 = _one_minus_power(_float64(b1_lo, b1_hi), t)
    correction2 = _one_minus_power(_float64(b2_lo, b2_hi), t)
    row0 = blk * BLOCK_D
    rows = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_R)
    row_ok = rows < d - row0
    s_base = (_pointer(tl.load(entry + _ADAM_S), tl.float32, PTR_ALIGNED)
              + e.to(tl.int64) * stride_se + row0.to(tl.int64) * stride_sd)
    m_base = (_pointer(tl.load(entry + _ADAM_EXP_AVG), tl.float32, PTR_ALIGNED)
              + e.to(tl.int64) * stride_me + row0.to(tl.int64) * stride_md)
    v_ptrs = (_pointer(tl.load(entry + _ADAM_EXP_AVG_SQ), tl.float32, PTR_ALIGNED)
              + e.to(tl.int64) * stride_ve + row0.to(tl.int64) * stride_vd + rows * stride_vd)
    s_off = rows[:, None] * stride_sd + cols[None, :] * stride_sr
    m_off = rows[:, None] * stride_md + cols[None, :] * stride_mr
    squares = tl.full((BLOCK_D,), 0.0, tl.float32)
    for r0 in range(0, r, BLOCK_R):
        mask = row_ok[:, None] & (cols < r - r0)[None, :]
        s = tl.load(s_base + r0 * stride_sr + s_off, mask=mask, other=0.0)
        squares += tl.reduce(s * s, 1, _sum)
    v = tl.load(v_ptrs, mask=row_ok, other=0.0)
    # b v + (1 - b) x, three roundings as the reference's (fp fusion is off for this kernel)
    v = tl.where(ok, beta2 * v + tl.div_rn(squares, r.to(tl.float32)) * rest2, v)
    tl.store(v_ptrs, v, mask=tl.where(ok, row_ok, False))
    denom = tl.sqrt_rn(tl.div_rn(v, correction2)) + eps
    for r0 in range(0, r, BLOCK_R):
        mask = row_ok[:, None] & (cols < r - r0)[None, :]
        s_ptrs = s_base + r0 * stride_sr + s_off
        m_ptrs = m_base + r0 * stride_mr + m_off
        s = tl.load(s_ptrs, mask=mask, other=0.0) * sign
        mo = tl.load(m_ptrs, mask=mask, other=0.0)
        mo = tl.where(ok, beta1 * mo + s * rest1, mo)
        tl.store(m_ptrs, mo, mask=tl.where(ok, mask, False))
        tl.store(s_ptrs, tl.div_rn(tl.div_rn(mo, correction1), denom[:, None]), mask=mask)


# ------------------------------------------------------------------------ launch tables

ROUND_BLOCK = 1024
WORDS_BLOCK = 1024
GAUSSIAN_BLOCK = 1024
SUM_BLOCK = 2048
# The launch table of the fused update: one tile shape for every shape and rank (r is looped
# over in blocks of BLOCK_R inside the kernel), chosen so that no configuration spills
# registers on sm_80, sm_90 or sm_100; tests/test_ops_aot.py compiles them all ahead of time
# and checks, docs/kernels.md has the register table and the reasons.
UPDATE_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, C_PARTS=3, num_warps=8, num_stages=1)
# Register caps (``maxnreg``): 128 keeps two programs of 8 warps per SM where Triton can
# vectorise every load; a misaligned layout needs more registers (per-element addresses),
# and without a cap ptxas may pick 128 and spill (sm_80), so it gets 160.
MAXNREG_ALIGNED = 128
MAXNREG_MISALIGNED = 160
GRAM_TILE = dict(BLOCK_R=64, BLOCK_K=32, num_warps=4, num_stages=1)
STATS_TILE = dict(BLOCK_M=triton_buffers.STATS_BLOCK_M, BLOCK_R=16, num_warps=4, num_stages=1)
# The r x r Cholesky factor and inverse: one program per matrix, tiles of 32 x 32 float64.
CHOLESKY_TILE = dict(BLOCK=32, num_warps=8, num_stages=1, maxnreg=192)
# The projection G X^T: tiles of 64 x 64 of the k x r result, X^T's rows 16 at a time.
PRODUCT_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=1)
# RowAdam's moments: 64 rows x 32 columns per step of the r-loop (memory-bound, d x r).
ADAM_TILE = dict(BLOCK_D=64, BLOCK_R=32, num_warps=8, num_stages=1)
# One launch's grid axes 1 and 2 (experts, stacks) are limited to 65535 by CUDA, axis 0 to
# 2**31 - 1.
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _words(v: int) -> tuple[int, int]:
    """``(lo, hi)`` 32-bit halves of ``0 <= v < 2**64`` as int32 patterns (always typed i32)."""
    return _int32(v), _int32(v >> 32)


def _dot_dtype():
    # The interpreter's tl.dot cannot multiply BF16 operands; FP32 operands holding the same
    # BF16-exact parts give the same products.
    return tl.float32 if INTERPRETED else tl.bfloat16


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float64: tl.float64}


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device``: built on the host, one host-to-device copy (pinned, so
    the copy is queued like a kernel and the host does not wait)."""
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _aligned_ptrs(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every pointer is 16-byte aligned and Triton specialises every size and stride
    as 16-divisible (or 1): the layout that vectorises every load."""
    return _aligned_ptrs(*tensors) and all(
        all(n % 16 == 0 for n in t.shape[-2:]) and all(s == 1 or s % 16 == 0 for s in t.stride())
        for t in tensors)


def _check_int32_offsets(name: str, extents: list[tuple[int, int]]) -> None:
    span = sum((n - 1) * abs(stride) for n, stride in extents)
    if span >= 2**31:
        raise ValueError(f"{name}'s strides {tuple(s for _, s in extents)} are too large for "
                         "the kernel's 32-bit offsets within a tile; pass a contiguous copy")


def _groups(keys: Sequence) -> list[list[int]]:
    """Indices with equal keys, in order of first appearance, at most _MAX_GRID_YZ each."""
    by_key: dict = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    return [idx[s:s + _MAX_GRID_YZ] for idx in by_key.values()
            for s in range(0, len(idx), _MAX_GRID_YZ)]


def _layout_key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride()


def _launch(launches: list[tuple]) -> None:
    """Run checked launches (the launch builders only build them: ahead-of-time compilation
    builds launches for CPU tensors)."""
    for _kernel, _grid, args, _kwargs in launches:
        _check_runs_on(next(a for a in args if isinstance(a, torch.Tensor)).device)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)


# ------------------------------------------------------------------------------ checks

def _check_device(*tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    return device


def _check_runs_on(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if not INTERPRETED:
        raise RuntimeError(
            f"rgc's Triton kernels run on CUDA tensors, got {device}; on the CPU they run only "
            "in Triton's interpreter: set TRITON_INTERPRET=1 before rgc.ops.triton is first "
            "imported, or use the reference kernels (RGC_IMPL=torch)")


def _check_int(name: str, v, minimum: int | None = None) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _check_offset(name: str, v) -> int:
    v = _check_int(name, v, 0)
    if v >= 1 << 64:
        raise ValueError(f"{name} must be below 2**64, got {v}")
    return v


def _check_matrix_table(name: str, t: torch.Tensor | None, m: int, e: int,
                        device: torch.device, dtype=torch.float32) -> None:
    if t is None:
        return
    if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != m or t.shape[1] < e
            or t.dtype != dtype or t.device != device):
        got = (f"{t.dim()}-D {t.dtype} {tuple(t.shape)} on {t.device}"
               if isinstance(t, torch.Tensor) else repr(t))
        raise ValueError(f"{name} must be a [{m}, {e}] {dtype} tensor on {device} (one entry "
                         f"per stack and matrix), got {got}")


# ------------------------------------------------------------------- rounding, random words

def stochastic_round_(out: torch.Tensor, x: torch.Tensor, seed: int, offset: int) -> None:
    """``out <- BF16(x)`` stochastically, element ``i`` of ``x.flatten()`` with the bits of
    flat index ``offset + i`` (one launch; see :func:`rgc.ops.reference.stochastic_round_`)."""
    launches = stochastic_round_launches(out, x, seed, offset)
    _launch(launches)
    if launches and launches[0][2][1] is not out:
        out.copy_(launches[0][2][1])


def stochastic_round_launches(out: torch.Tensor, x: torch.Tensor, seed: int,
                              offset: int) -> list[tuple]:
    """The launch of the rounding kernel as ``[(kernel, grid, args, kwargs)]`` (args[0]: the
    contiguous FP32 input, args[1]: the contiguous BF16 target, ``out`` itself if it is
    contiguous)."""
    if not x.is_floating_point():
        raise TypeError(f"stochastic_round_ expects a floating-point x, got {x.dtype}")
    if out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(f"out must be BF16 of x's shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    _check_int("seed", seed)
    offset = _check_offset("offset", offset)
    _check_device(out, x)
    if x.numel() == 0:
        return []
    x32 = x.detach().to(torch.float32).contiguous()
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                         device=out.device)
    s_lo, s_hi = (_int32(w) for w in seed_words(seed))
    grid = (triton.cdiv(x.numel(), ROUND_BLOCK),)
    return [(_stochastic_round_kernel, grid, (x32, target, x.numel(), *_words(offset), s_lo,
                                              s_hi),
             dict(BLOCK=ROUND_BLOCK, num_warps=4, enable_fp_fusion=True))]


def random_words(numel: int, seed: int, label: str, offset: int,
                 device: torch.device) -> torch.Tensor:
    """The int32 hash words of flat indices ``offset .. offset + numel - 1`` for
    ``(seed, label)``, ``[numel]`` (one launch)."""
    out = torch.empty(_check_int("numel", numel, 0), dtype=torch.int32,
                      device=torch.device(device))
    _launch(random_words_launches(out, seed, label, offset))
    return out


def random_words_launches(out: torch.Tensor, seed: int, label: str,
                          offset: int) -> list[tuple]:
    _check_int("seed", seed)
    offset = _check_offset("offset", offset)
    _check_device(out)
    if out.numel() == 0:
        return []
    s_lo, s_hi = (_int32(w) for w in seed_words(seed, label))
    grid = (triton.cdiv(out.numel(), WORDS_BLOCK),)
    return [(_random_words_kernel, grid, (out, out.numel(), *_words(offset), s_lo, s_hi),
             dict(BLOCK=WORDS_BLOCK, num_warps=4, enable_fp_fusion=True))]


# ------------------------------------------------------------------------------ Gaussians

def gaussian_matrices(k: int, r: int, seeds: list[int], device: torch.device) -> torch.Tensor:
    """Box-Muller ``G`` for each seed, ``[M, k, r]`` FP32 (a view of ``[M, k, 2 ceil(r/2)]``),
    bit-identical with :func:`rgc.ops.reference.gaussian_matrices`; one launch for all
    seeds (their words in a table)."""
    k, r = _check_int("k", k, 0), _check_int("r", r, 0)
    seeds = [_check_int("seed", s) for s in seeds]
    _check_projection_size(k, r)
    device = torch.device(device)
    g = torch.empty(len(seeds), k, 2 * ((r + 1) // 2), dtype=torch.float32, device=device)
    _check_device(g)
    _launch(gaussian_launches(g, k, (r + 1) // 2, seeds))
    return g[:, :, :r]


def _check_projection_size(k: int, r: int) -> None:
    if 2 * k * ((r + 1) // 2) >= 1 << 32:
        raise ValueError(f"a {k} x {r} projection is too large (2 k ceil(r/2) >= 2**32)")


def _seed_table(targets: list[torch.Tensor], seeds: list[int], label: str) -> torch.Tensor:
    """Rows ``(target pointer, seed words)`` of the projection kernels, on the targets' device."""
    if len(seeds) > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} seeds per call, got {len(seeds)}")
    return _table([[t.data_ptr(), *seed_words(seed, label)]
                   for t, seed in zip(targets, seeds, strict=True)], targets[0].device)


def gaussian_launches(g: torch.Tensor, k: int, h: int, seeds: list[int]) -> list[tuple]:
    """The launch of the Gaussian kernel on ``g`` (``[M, k, >= 2 h]`` FP32, unit column
    stride), one grid row per seed."""
    if not seeds or k * h == 0:
        return []
    grid = (triton.cdiv(k * h, GAUSSIAN_BLOCK), len(seeds))
    return [(_gaussian_kernel, grid,
             (_seed_table(list(g.unbind(0)), seeds, GAUSSIAN_LABEL), k, h, 2 * h, g.stride(1),
              g.stride(2), 1.0),
             dict(OUT_DTYPE=tl.float32, SCALED=False, BLOCK=GAUSSIAN_BLOCK, num_warps=4,
                  enable_fp_fusion=False))]


# ----------------------------------------------------------------- the update and the norms

def update_programs(d: int, k: int, config: dict | None = None) -> int:
    """Tiles of W per matrix of the fused update (the length of its partial sums)."""
    cfg = dict(UPDATE_TILE, **(config or {}))
    return triton.cdiv(d, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_N"])


def _check_stacks(weights, factors=None, projections=None) -> torch.device | None:
    """Shapes, dtypes and devices of the update's (or the norm's) lists; the device."""
    if not weights:
        return None
    for m, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in (
                torch.bfloat16, torch.float32):
            got = f"{w.dim()}-D {w.dtype}" if isinstance(w, torch.Tensor) else repr(w)
            raise TypeError(f"weights[{m}] must be a 3-D [E, d, k] BF16 or FP32 tensor, "
                            f"got {got}")
    device = _check_device(*weights)
    if factors is None:
        return device
    if not len(weights) == len(factors) == len(projections):
        raise ValueError(f"weights, factors and projections must have one entry per stack, "
                         f"got {len(weights)}, {len(factors)}, {len(projections)}")
    for m, (w, u, p) in enumerate(zip(weights, factors, projections)):
        e, d, k = w.shape
        if u.dim() != 3 or u.dtype != torch.float32 or tuple(u.shape[:2]) != (e, d):
            raise ValueError(f"factors[{m}] must be FP32 of shape ({e}, {d}, r) for weights "
                             f"[{m}] of shape {tuple(w.shape)}, got {u.dtype} "
                             f"{tuple(u.shape)}")
        r = u.shape[2]
        if p.dim() != 2 or tuple(p.shape) != (k, r) or not p.is_floating_point():
            raise ValueError(f"projections[{m}] must be a floating-point ({k}, {r}) (k x r) "
                             f"tensor to match weights[{m}] {tuple(w.shape)} and factors[{m}] "
                             f"{tuple(u.shape)}, got {p.dtype} {tuple(p.shape)}")
        _check_device(w, u, p)
    return device


def _norm_partials(device: torch.device, count: int, e: int, tiles: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One partial per program of each matrix (FP32; the weight norms' in float64)."""
    return torch.empty(count * e * tiles, dtype=dtype, device=device)


def _finish_launch(partials: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                   count: int, e: int, n: int, *, m_col: int, table_width: int,
                   flags: torch.Tensor | None = None, flag_out: torch.Tensor | None = None,
                   clamp: bool = False) -> tuple:
    """The launch that adds each matrix's ``n`` partials in order into ``out[m, e]``."""
    return (_finish_kernel, (e, count),
            (partials, partials if flags is None else flags, table, out,
             out if flag_out is None else flag_out, n, out.stride(0), out.stride(1)),
            dict(TABLE=table_width, M_COL=m_col, BLOCK=SUM_BLOCK, HAS_FLAGS=flags is not None,
                 CLAMP=clamp, ACC_DTYPE=_TL_DTYPES[partials.dtype], num_warps=4,
                 enable_fp_fusion=True))


def update_config(w: torch.Tensor, u: torch.Tensor, p: torch.Tensor, stochastic: bool,
                   config: dict | None, norm_only: bool = False) -> dict:
    """Tiles, precision and kernel options of the fused update for one group."""
    cfg = dict(UPDATE_TILE, P_PARTS=1 if p.dtype == torch.bfloat16 else 3,
               STOCHASTIC=bool(stochastic) and w.dtype == torch.bfloat16,
               maxnreg=MAXNREG_ALIGNED if _aligned(w, u, p) else MAXNREG_MISALIGNED)
    cfg.update(config or {})
    if norm_only:  # the tile and warps decide the reduction order: never overridden
        cfg.update({key: UPDATE_TILE[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps")})
    return cfg


def update_launches(weights: list[torch.Tensor], factors: list[torch.Tensor],
                    projections: list[torch.Tensor], coefs: torch.Tensor,
                    decays: torch.Tensor | None, seeds: list[int], offsets: list[int],
                    row_lengths: list[int], stochastic_rounding: bool,
                    sq_norms: torch.Tensor | None, config: dict | None = None) -> list[tuple]:
    """Every launch of :func:`lowrank_update_` as ``(kernel, grid, args, kwargs)``, checked:
    per group of stacks with equal layouts, the update kernel, then (with ``sq_norms``) the
    ordered sum of its partials. ``config`` overrides tile entries (benchmarks). Used both to
    run the update and to compile it ahead of time (``tools/aot.py`` in a checkout)."""
    device = _check_stacks(weights, factors, projections)
    if device is None:
        return []
    count = len(weights)
    e_max = max(w.shape[0] for w in weights)
    _check_matrix_table("coefs", coefs, count, e_max, device)
    _check_matrix_table("decays", decays, count, e_max, device)
    _check_matrix_table("sq_norms", sq_norms, count, e_max, device)
    if not len(seeds) == len(offsets) == len(row_lengths) == count:
        raise ValueError(f"seeds, offsets and row_lengths must have one entry per stack "
                         f"({count}), got {len(seeds)}, {len(offsets)}, {len(row_lengths)}")
    for m, w in enumerate(weights):
        _check_int(f"seeds[{m}]", seeds[m])
        _check_offset(f"offsets[{m}]", offsets[m])
        _check_int(f"row_lengths[{m}]", row_lengths[m], max(w.shape[2], 1))
    projections = [p if p.dtype in (torch.bfloat16, torch.float32) else p.float()
                   for p in projections]
    keys = [(_layout_key(w), _layout_key(u), _layout_key(p))
            for w, u, p in zip(weights, factors, projections)]
    launches = []
    for group in _groups(keys):
        w, u, p = weights[group[0]], factors[group[0]], projections[group[0]]
        e, d, k = w.shape
        r = u.shape[2]
        cfg = update_config(w, u, p, stochastic_rounding, config)
        _check_int32_offsets("weights", [(cfg["BLOCK_M"], w.stride(1)),
                                         (cfg["BLOCK_N"], w.stride(2))])
        r_span = max(r, cfg["BLOCK_R"])  # the r-loop adds r0 * stride in int32 too
        _check_int32_offsets("factors", [(cfg["BLOCK_M"], u.stride(1)), (r_span, u.stride(2))])
        _check_int32_offsets("projections", [(cfg["BLOCK_N"], p.stride(0)),
                                             (r_span, p.stride(1))])
        rows = []
        for m in group:
            rows.append([weights[m].data_ptr(), factors[m].data_ptr(), projections[m].data_ptr(),
                         m, *seed_words(seeds[m]), *_words(offsets[m]), int(row_lengths[m])])
        if e == 0:
            continue
        table = _table(rows, device)
        tiles = update_programs(d, k, cfg)
        partials = _norm_partials(device, len(group), e, tiles, torch.float64)
        if tiles:
            ptr_aligned = _aligned_ptrs(*(t for m in group for t in
                                          (weights[m], factors[m], projections[m])))
            launches.append((
                _lowrank_update_kernel, (tiles, e, len(group)),
                (table, coefs, coefs if decays is None else decays, partials, d, k, r,
                 *w.stride(), *u.stride(), *p.stride(), *coefs.stride(),
                 *(coefs if decays is None else decays).stride()),
                dict(DOT_DTYPE=_dot_dtype(), W_DTYPE=_TL_DTYPES[w.dtype],
                     P_DTYPE=_TL_DTYPES[p.dtype], HAS_DECAY=decays is not None,
                     NORM_ONLY=False, PTR_ALIGNED=ptr_aligned, enable_fp_fusion=True, **cfg)))
        if sq_norms is not None:
            launches.append(_finish_launch(partials, table, sq_norms, len(group), e, tiles,
                                           m_col=TABLE_COLUMNS.index("m"),
                                           table_width=len(TABLE_COLUMNS)))
    return launches


def lowrank_update_(weights: list[torch.Tensor], factors: list[torch.Tensor],
                    projections: list[torch.Tensor], coefs: torch.Tensor,
                    decays: torch.Tensor | None, seeds: list[int], offsets: list[int],
                    row_lengths: list[int], stochastic_rounding: bool, chunk_rows: int,
                    sq_norms: torch.Tensor | None) -> None:
    """In place, per matrix ``(m, e)``: ``W <- W (1 - decay) - coef U P^T`` in FP32 and one
    write, ``U P^T`` formed tile by tile on chip and never written to memory; one launch per
    group of equal layouts (plus one for ``sq_norms``). ``chunk_rows`` (the reference's row
    chunk) is not used: the kernel works in 64 x 64 tiles. Contract:
    :func:`rgc.ops.reference.lowrank_update_`; bad input raises before any weight changes."""
    _check_int("chunk_rows", chunk_rows, 1)
    _launch(update_launches(weights, factors, projections, coefs, decays, seeds, offsets,
                            row_lengths, stochastic_rounding, sq_norms))


def sum_squares_launches(weights: list[torch.Tensor], out: torch.Tensor) -> list[tuple]:
    """The norm launches: the update kernel in NORM_ONLY mode per group of equal layouts
    (same tile, same warps, same reduction), then the update's ordered sum."""
    device = _check_stacks(weights)
    if device is None:
        return []
    launches = []
    for group in _groups([_layout_key(w) for w in weights]):
        w = weights[group[0]]
        e, d, k = w.shape
        cfg = update_config(w, w, w, False, None, norm_only=True)
        _check_int32_offsets("weights", [(cfg["BLOCK_M"], w.stride(1)),
                                         (cfg["BLOCK_N"], w.stride(2))])
        if e == 0:
            continue
        table = _table([[weights[m].data_ptr(), 0, 0, m, 0, 0, 0, 0, 0] for m in group], device)
        tiles = update_programs(d, k)
        partials = _norm_partials(device, len(group), e, tiles, torch.float64)
        if tiles:
            ptr_aligned = _aligned_ptrs(*(weights[m] for m in group))
            launches.append((
                _lowrank_update_kernel, (tiles, e, len(group)),
                (table, out, out, partials, d, k, 0, *w.stride(), 0, 0, 0, 0, 0,
                 *out.stride(), *out.stride()),
                dict(DOT_DTYPE=_dot_dtype(), W_DTYPE=_TL_DTYPES[w.dtype], P_DTYPE=tl.float32,
                     HAS_DECAY=False, NORM_ONLY=True, PTR_ALIGNED=ptr_aligned,
                     enable_fp_fusion=True, **{**cfg, "STOCHASTIC": False, "P_PARTS": 1})))
        launches.append(_finish_launch(partials, table, out, len(group), e, tiles,
                                       m_col=TABLE_COLUMNS.index("m"),
                                       table_width=len(TABLE_COLUMNS)))
    return launches


def sum_squares(weights: list[torch.Tensor], chunk_rows: int) -> torch.Tensor:
    """``||W_e||_F^2`` per matrix, ``[M, E]`` FP32, bit for bit the ``sq_norms`` that
    :func:`lowrank_update_` writes for the same W (same tiles, same reduction order).
    ``chunk_rows`` is not used (the reference's row chunk)."""
    _check_int("chunk_rows", chunk_rows, 1)
    if not weights:
        return torch.zeros(0, 0, dtype=torch.float32)
    e = weights[0].shape[0] if weights[0].dim() == 3 else 0
    if any(w.dim() == 3 and w.shape[0] != e for w in weights):
        raise ValueError(f"every stack must have the same number of matrices, got "
                         f"{[w.shape[0] for w in weights]}")
    # Every entry is written by the ordered sum (0 for an empty matrix).
    out = torch.empty(len(weights), e, dtype=torch.float32, device=weights[0].device)
    _launch(sum_squares_launches(weights, out))
    return out


# ------------------------------------------------------------------- Grams and the sketch

def _gram_config(p: torch.Tensor, fp64: bool) -> dict:
    return dict(GRAM_TILE, PARTS=1 if p.dtype == torch.bfloat16 else 3, FP64=fp64,
                enable_fp_fusion=True,
                DOT_DTYPE=_dot_dtype(), P_DTYPE=_TL_DTYPES[p.dtype])


def gram_launches(matrices: list[torch.Tensor], out: torch.Tensor,
                  fp64: bool = False, refresh: bool = False) -> list[tuple]:
    """Launches writing ``out[i] = matrices[i]^T matrices[i]`` (each ``[k, r]``, one layout;
    ``out`` ``[M, r, r]`` contiguous, FP32 or FP64 with ``fp64``): one launch, of the
    specialised :func:`_gram_kernel`, or for the P refresh of :func:`_refresh_gram_kernel`
    (one binary per dtype: no size, stride or alignment specialised)."""
    if not matrices:
        return []
    p = matrices[0]
    k, r = p.shape
    if r == 0:
        return []
    cfg = _gram_config(p, fp64)
    _check_int32_offsets("projection", [(cfg["BLOCK_K"], p.stride(0)),
                                        (max(r, cfg["BLOCK_R"]), p.stride(1))])
    table = _table([[t.data_ptr()] for t in matrices], out.device)
    tiles = triton.cdiv(r, cfg["BLOCK_R"])
    return [(_refresh_gram_kernel if refresh else _gram_kernel, (tiles, tiles, len(matrices)),
             (table, out, k, r, *p.stride()),
             dict(cfg, PTR_ALIGNED=not refresh and _aligned_ptrs(*matrices)))]


def sketch_stats_launches(sketches: list[torch.Tensor], projections: list[torch.Tensor],
                          h2: torch.Tensor, finite: torch.Tensor) -> list[tuple]:
    """Per group of equal layouts: the Grams ``P^T P``, the row-block partials of
    ``sum((C G) * C)`` and of the non-finite count, and their ordered sums (three launches);
    buffers of :func:`rgc.ops.triton_buffers.sketch_stats_bytes` per stack."""
    if not sketches:
        return []
    device = _check_device(*sketches, *projections)
    if len(sketches) != len(projections):
        raise ValueError(f"sketches and projections must have one entry per stack, got "
                         f"{len(sketches)} and {len(projections)}")
    for m, (c, p) in enumerate(zip(sketches, projections)):
        if c.dim() != 3 or c.dtype != torch.float32:
            raise ValueError(f"sketches[{m}] must be a 3-D [E, d, r] FP32 tensor, got "
                             f"{c.dim()}-D {c.dtype}")
        if p.dim() != 2 or p.shape[1] != c.shape[2] or not p.is_floating_point():
            raise ValueError(f"projections[{m}] must be a floating-point (k, {c.shape[2]}) "
                             f"tensor to match sketches[{m}] {tuple(c.shape)}, got {p.dtype} "
                             f"{tuple(p.shape)}")
    projections = [p if p.dtype in (torch.bfloat16, torch.float32) else p.float()
                   for p in projections]
    launches = []
    keys = [(_layout_key(c), _layout_key(p)) for c, p in zip(sketches, projections)]
    for group in _groups(keys):
        c, p = sketches[group[0]], projections[group[0]]
        e, d, r = c.shape
        if e == 0:
            continue
        _check_int32_offsets("sketches", [(STATS_TILE["BLOCK_M"], c.stride(1)),
                                          (max(r, STATS_TILE["BLOCK_R"]), c.stride(2))])
        gram = torch.empty(len(group), r, r, dtype=torch.float32, device=device)
        launches += gram_launches([projections[m] for m in group], gram)
        table = _table([[sketches[m].data_ptr(), m] for m in group], device)
        blocks = triton.cdiv(d, STATS_TILE["BLOCK_M"])
        partials = _norm_partials(device, len(group), e, blocks)
        flags = _norm_partials(device, len(group), e, blocks)
        if blocks and r:
            launches.append((_sketch_stats_kernel, (blocks, e, len(group)),
                             (table, gram, partials, flags, d, r, *c.stride()),
                             dict(STATS_TILE, DOT_DTYPE=_dot_dtype(), enable_fp_fusion=True,
                                  PTR_ALIGNED=_aligned_ptrs(*(sketches[m] for m in group)))))
        else:
            blocks = 0  # empty matrices: sum 0, finite
        launches.append(_finish_launch(partials, table, h2, len(group), e, blocks, m_col=1,
                                       table_width=2, flags=flags, flag_out=finite, clamp=True))
    return launches


def sketch_stats(sketches: list[torch.Tensor], projections: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||C_e P^T||_F^2 [M, E] FP32, all(isfinite(C_e)) [M, E] bool)`` per matrix, from
    ``trace(C_e G C_e^T)`` with the r x r Gram ``G = P^T P`` (no k-sized temporary), clamped
    at 0; three launches per group of equal layouts."""
    if not sketches:
        empty = torch.zeros(0, 0)
        return empty, empty.bool()
    e = sketches[0].shape[0] if sketches[0].dim() == 3 else 0
    device = sketches[0].device
    # Every entry is written by the ordered sums (0 and True for an empty matrix).
    h2 = torch.empty(len(sketches), e, dtype=torch.float32, device=device)
    finite = torch.empty(len(sketches), e, dtype=torch.bool, device=device)
    if any(c.dim() == 3 and c.shape[0] != e for c in sketches):
        raise ValueError(f"every sketch stack must have the same number of matrices, got "
                         f"{[c.shape[0] for c in sketches]}")
    _launch(sketch_stats_launches(sketches, projections, h2, finite))
    return h2, finite


# ------------------------------------------------------------------------ orthonormalize

def orthonormalize(g: torch.Tensor, scale: float, gram_fp64: bool) -> torch.Tensor:
    """``scale Q`` of the thin QR of each ``g[m]`` (``[M, k, r]`` FP32), as
    :func:`rgc.ops.reference.orthonormalize` (FP32, or float64 for ``k < 4 r``), each matrix
    by its own programs (its bits do not depend on M): see :func:`orthonormal_launches`."""
    if g.dim() != 3 or g.dtype != torch.float32:
        raise ValueError(f"g must be a 3-D [M, k, r] FP32 tensor, got {g.dim()}-D {g.dtype}")
    _check_device(g)
    m, k, r = g.shape
    out = torch.empty(m, k, r, dtype=torch.float32 if one_pass(k, r) else torch.float64,
                      device=g.device)
    if m and k and r:
        _launch(orthonormal_launches(g, list(out.unbind(0)), scale, gram_fp64))
    return out


def orthonormal_launches(g: torch.Tensor, outs: list[torch.Tensor], scale: float,
                         gram_fp64: bool) -> list[tuple]:
    """``outs[m] <- scale Q_m`` for the thin QR ``g[m] = Q_m R_m`` (``R`` with a positive
    diagonal), rounded to the outputs' dtype (one layout); g: ``[M, k, r]`` FP32 (any
    strides), full column rank, ``k >= r``.

    ``k >= 4 r``: one CholeskyQR pass. The Gram ``g^T g`` (FP32 from BF16 parts, or FP64 with
    ``gram_fp64``), then ``X = scale L^-1`` of its Cholesky factor in float64 by one program
    per matrix (rounded to FP32), then ``g X^T`` in FP32 from BF16 parts: three launches.
    ``k < 4 r``: shifted CholeskyQR3 in float64 (the shift of
    :func:`rgc.ops.reference.orthonormalize` on the first Gram): nine launches, through two
    float64 ``[M, k, r]`` buffers. Every launch runs one or more programs per matrix, whose
    work does not depend on the others: a matrix has the same bits in any batch. The buffers
    are allocated here (``4 or 8 r^2`` bytes per matrix of Gram, ``16 r^2`` of work, ``4 or 8
    r^2`` of X, plus ``16 k r`` for ``k < 4 r``: with G, at most
    :func:`rgc.ops.triton_buffers.projection_bytes`)."""
    m, k, r = g.shape
    device = g.device
    single = one_pass(k, r)
    gram = torch.empty(m, r, r, dtype=torch.float32 if (single and not gram_fp64)
                       else torch.float64, device=device)
    work = torch.empty(m, 2, r, r, dtype=torch.float64, device=device)
    x = torch.empty(m, r, r, dtype=torch.float32 if single else torch.float64, device=device)
    if single:
        return [*gram_launches(list(g.unbind(0)), gram, gram_fp64, refresh=True),
                _cholesky_inverse_launch(gram, work, x, scale), _product_launch(g, x, outs)]
    buffers = torch.empty(2, m, k, r, dtype=torch.float64, device=device)
    unit = torch.finfo(torch.float64).eps / 2
    shift = 11 * (k * r + r * (r + 1)) * unit
    launches, q = [], g
    for i in range(3):
        target = outs if i == 2 else list(buffers[i % 2].unbind(0))
        launches += [*gram_launches(list(q.unbind(0)), gram, True, refresh=True),
                     _cholesky_inverse_launch(gram, work, x, scale if i == 2 else 1.0,
                                              shift if i == 0 else None),
                     _product_launch(q, x, target)]
        q = buffers[i % 2]
    return launches


def _cholesky_inverse_launch(gram: torch.Tensor, work: torch.Tensor, x: torch.Tensor,
                             scale: float, shift: float | None = None) -> tuple:
    if gram.shape[0] > _MAX_GRID_X:
        raise ValueError(f"at most {_MAX_GRID_X} matrices per launch, got {gram.shape[0]}")
    return (_cholesky_inverse_kernel, (gram.shape[0],),
            (gram, work, x, gram.shape[1], *_float64_words(scale), *_float64_words(shift or 0.0)),
            dict(CHOLESKY_TILE, X_DTYPE=_TL_DTYPES[x.dtype], SHIFT=shift is not None,
                 enable_fp_fusion=True))


def _product_launch(g: torch.Tensor, x: torch.Tensor, outs: list[torch.Tensor]) -> tuple:
    m, k, r = g.shape
    out = outs[0]
    cfg = PRODUCT_TILE
    _check_int32_offsets("projection", [(k, out.stride(0)), (r, out.stride(1))])
    grid = (triton.cdiv(k, cfg["BLOCK_M"]), triton.cdiv(r, cfg["BLOCK_N"]), m)
    return (_projection_product_kernel, grid,
            (g, x, _table([[o.data_ptr()] for o in outs], g.device), k, r, *g.stride(),
             *out.stride()),
            dict(cfg, FP64=x.dtype == torch.float64, OUT_DTYPE=_OUT_DTYPES[out.dtype],
                 DOT_DTYPE=_dot_dtype(), enable_fp_fusion=True))


# --------------------------------------------------------------------- projection refresh

PROJECTION_KINDS = ("orthonormal", "gaussian", "rademacher")


def make_projections_(outs: list[torch.Tensor], kind: str, seeds: list[int]) -> None:
    """:func:`rgc.ops.reference.make_projections_` on CUDA, batch-invariant: each projection
    has the bits it would have alone. Per group of outputs of one layout, ``rademacher`` and
    ``gaussian`` are one launch for all seeds (a seed table; bit-identical with the
    reference); ``orthonormal`` works in chunks of
    :func:`rgc.ops.triton_buffers.projection_chunk` seeds (their buffers within
    ``PROJECTION_CHUNK_BYTES``), one Gaussian launch and :func:`orthonormal_launches` per chunk
    (close to the reference, not equal)."""
    if not outs:
        return
    _check_projections(outs, kind, seeds)
    k, r = outs[0].shape
    for group in _groups([_layout_key(o) for o in outs]):
        step = triton_buffers.projection_chunk(k, r) if kind == "orthonormal" else len(group)
        for start in range(0, len(group), step):
            chunk = group[start:start + step]  # one chunk's buffers at a time
            _launch(projection_launches([outs[i] for i in chunk], kind, [seeds[i] for i in chunk]))


def _check_projections(outs: list[torch.Tensor], kind: str, seeds: list[int]) -> None:
    _check_device(*outs)
    k, r = outs[0].shape[-2:]
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"unknown projection kind {kind!r}; choose one of {PROJECTION_KINDS}")
    if len(seeds) != len(outs):
        raise ValueError(f"one seed per projection buffer: {len(outs)} buffers, "
                         f"{len(seeds)} seeds")
    for o in outs:
        if o.dim() != 2 or tuple(o.shape) != (k, r) or o.dtype not in _OUT_DTYPES:
            raise ValueError(f"every projection buffer must be a {k} x {r} BF16, FP16, FP32 or "
                             f"float64 tensor, got {o.dtype} {tuple(o.shape)}")
    for s in seeds:
        _check_int("seed", s)
    _check_projection_size(k, r)
    if kind == "orthonormal" and r > k:
        raise ValueError(f"an orthonormal projection needs r <= k, got {k} x {r}")


def projection_launches(outs: list[torch.Tensor], kind: str, seeds: list[int]) -> list[tuple]:
    """The launches of :func:`make_projections_` for outputs of one layout (one chunk), their
    buffers allocated."""
    _check_projections(outs, kind, seeds)
    out = outs[0]
    k, r = out.shape
    h = (r + 1) // 2
    dtype = _OUT_DTYPES[out.dtype]
    if k * r == 0:
        return []
    if kind == "rademacher":
        # the reference's magnitude, rounded to the dtype on the host (a host tensor's bits)
        pattern = torch.tensor([1.0 / math.sqrt(r)], dtype=out.dtype).view(
            _INT_OF[out.dtype]).tolist()[0]
        return [(_rademacher_kernel, (triton.cdiv(k * r, WORDS_BLOCK), len(outs)),
                 (_seed_table(outs, seeds, reference.RADEMACHER_LABEL), k, r, *out.stride(),
                  *_words(pattern & (2**64 - 1))),
                 dict(OUT_DTYPE=dtype, BLOCK=WORDS_BLOCK, num_warps=4, enable_fp_fusion=True))]
    if kind == "gaussian":
        return [(_gaussian_kernel, (triton.cdiv(k * h, GAUSSIAN_BLOCK), len(outs)),
                 (_seed_table(outs, seeds, GAUSSIAN_LABEL), k, h, r, *out.stride(),
                  math.sqrt(r)),
                 dict(OUT_DTYPE=dtype, SCALED=True, BLOCK=GAUSSIAN_BLOCK, num_warps=4,
                      enable_fp_fusion=False))]
    g = torch.empty(len(seeds), k, 2 * h, dtype=torch.float32, device=out.device)
    return [*gaussian_launches(g, k, h, seeds),
            *orthonormal_launches(g[:, :, :r], outs, math.sqrt(k / r),
                                  out.dtype != torch.bfloat16)]


_OUT_DTYPES = {**_TL_DTYPES, torch.float16: tl.float16}
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
           torch.float64: torch.int64}


# ------------------------------------------------------------------------------- RowAdam

def _float64_words(x: float) -> tuple[int, int]:
    """The float64 bit pattern of ``x`` as two int32 words (see the kernels' _float64)."""
    return _words(struct.unpack("<q", struct.pack("<d", float(x)))[0] & (2**64 - 1))


def row_adam_launches(sketches: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], active: torch.Tensor,
                      steps: torch.Tensor, beta1: float, beta2: float, eps: float,
                      maximize: bool) -> list[tuple]:
    """The launches of :func:`row_adam_`, checked: one per group of stacks whose S, m and v
    have equal layouts, over (row block, expert, stack)."""
    if not sketches:
        return []
    count = len(sketches)
    if not len(exp_avgs) == len(exp_avg_sqs) == count:
        raise ValueError(f"sketches, exp_avgs and exp_avg_sqs must have one entry per stack, "
                         f"got {count}, {len(exp_avgs)}, {len(exp_avg_sqs)}")
    for m, (s, mo, v) in enumerate(zip(sketches, exp_avgs, exp_avg_sqs)):
        if s.dim() != 3 or s.dtype != torch.float32:
            raise ValueError(f"sketches[{m}] must be a 3-D [E, d, r] FP32 tensor, got "
                             f"{s.dim()}-D {s.dtype}")
        if mo.dtype != torch.float32 or mo.shape != s.shape:
            raise ValueError(f"exp_avgs[{m}] must be FP32 of the sketch's shape "
                             f"{tuple(s.shape)}, got {mo.dtype} {tuple(mo.shape)}")
        if v.dtype != torch.float32 or v.shape != s.shape[:2]:
            raise ValueError(f"exp_avg_sqs[{m}] must be FP32 of shape {tuple(s.shape[:2])} "
                             f"(one value per row), got {v.dtype} {tuple(v.shape)}")
    device = _check_device(*sketches, *exp_avgs, *exp_avg_sqs)
    e_max = max(s.shape[0] for s in sketches)
    _check_matrix_table("active", active, count, e_max, device, torch.bool)
    _check_matrix_table("steps", steps, count, e_max, device, torch.int64)
    for name, b in (("beta1", beta1), ("beta2", beta2), ("eps", eps)):
        if not isinstance(b, numbers.Real) or not math.isfinite(b):
            raise ValueError(f"{name} must be a finite number, got {b!r}")
    active = active.view(torch.uint8)
    launches = []
    keys = [(_layout_key(s), _layout_key(mo), _layout_key(v))
            for s, mo, v in zip(sketches, exp_avgs, exp_avg_sqs)]
    for group in _groups(keys):
        s, mo, v = sketches[group[0]], exp_avgs[group[0]], exp_avg_sqs[group[0]]
        e, d, r = s.shape
        if e * d * r == 0:
            continue
        r_span = max(r, ADAM_TILE["BLOCK_R"])
        _check_int32_offsets("sketches", [(ADAM_TILE["BLOCK_D"], s.stride(1)),
                                          (r_span, s.stride(2))])
        _check_int32_offsets("exp_avgs", [(ADAM_TILE["BLOCK_D"], mo.stride(1)),
                                          (r_span, mo.stride(2))])
        tensors = [t for m in group for t in (sketches[m], exp_avgs[m], exp_avg_sqs[m])]
        table = _table([[sketches[m].data_ptr(), exp_avgs[m].data_ptr(),
                         exp_avg_sqs[m].data_ptr(), m] for m in group], device)
        launches.append((
            _row_adam_kernel, (triton.cdiv(d, ADAM_TILE["BLOCK_D"]), e, len(group)),
            (table, active, steps, d, r, *s.stride(), *mo.stride(), *v.stride(),
             *active.stride(), *steps.stride(), -1.0 if maximize else 1.0, float(beta1),
             1.0 - beta1, float(beta2), 1.0 - beta2, float(eps), *_float64_words(beta1),
             *_float64_words(beta2)),
            dict(ADAM_TILE, PTR_ALIGNED=_aligned_ptrs(*tensors), enable_fp_fusion=False)))
    return launches


def row_adam_(sketches: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], active: torch.Tensor, steps: torch.Tensor,
              beta1: float, beta2: float, eps: float, maximize: bool) -> None:
    """RowAdam's moments and direction per matrix, in place (contract:
    :func:`rgc.ops.reference.row_adam_`): one launch per group of equal layouts, nothing read
    on the host. Every operation is the reference's, rounded once (no fused multiply-add,
    IEEE division and square root, bias corrections in float64); only the order in which
    ``mean_j S^2`` adds a row differs."""
    _launch(row_adam_launches(sketches, exp_avgs, exp_avg_sqs, active, steps, beta1, beta2,
                              eps, maximize))
