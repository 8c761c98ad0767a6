"""Counter-based stochastic rounding from FP32 to BF16.

The random bits for element ``i`` are a hash of ``(seed, offset + i)``; no generator state is
consumed. The same convention is used by the Triton kernels, so both paths write bit-identical
weights, and a receiver of a sync payload can reproduce the trainer's rounding exactly.

Bit convention (public, shared with :mod:`rgc.kernels`):

* ``s_lo, s_hi = seed_words(seed)`` are two 32-bit words derived from the 64-bit seed;
* for flat element index ``n = offset + i`` with 32-bit halves ``n_lo, n_hi``,
  ``bits = mix32(mix32(n_lo ^ s_lo) ^ ((n_hi + s_hi) mod 2**32))``, where ``mix32`` is the
  "lowbias32" integer hash (xorshift-multiply, constants 0x7FEB352D and 0x846CA68B);
* the low 16 bits of ``bits`` are added to the FP32 bit pattern, which is then truncated to
  its upper 16 bits. A value a fraction ``f`` of the way from one BF16 neighbour to the next
  therefore rounds up with probability ``f`` (to a resolution of 2**-16): unbiased.

NaN stays NaN (stored as the quiet NaN of its sign: the upper 16 bits with bit 6 set), +-inf
and every BF16-representable value (+-0, subnormals, BF16 max) are unchanged. A finite FP32
value above the largest BF16 number may round to inf.

Paths, all with the same bits: on the CPU one compiled pass per call (:mod:`rgc._native`) or,
without a C compiler, numpy uint32 ufuncs block by block; on other devices torch int32 ops.
:func:`random_bits` is the plain int64 statement of the hash that the tests hold them to.
"""

from __future__ import annotations

import numpy as np
import torch

from rgc import _native
from rgc.seeding import derive_seed

_M32 = 0xFFFFFFFF
MIX32_MUL1 = 0x7FEB352D
MIX32_MUL2 = 0x846CA68B


def seed_words(seed: int, label: str = "stochastic-round") -> tuple[int, int]:
    """The two 32-bit words ``(s_lo, s_hi)`` that key the hash for ``seed``.

    ``label`` separates independent streams of one seed: ``"stochastic-round"`` (the default)
    keys the rounding bits; :mod:`rgc.projection` uses its own labels.
    """
    h = derive_seed(seed, label)
    return h & _M32, (h >> 31) & _M32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 hash of int64 tensor values in ``[0, 2**32)``; returns the same range."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX32_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX32_MUL2)
    return x ^ (x >> 16)


def random_bits(numel: int, *, seed: int, offset: int = 0, device=None,
                label: str = "stochastic-round") -> torch.Tensor:
    """The 32 hash bits (int64 in ``[0, 2**32)``) for flat indices ``offset .. offset+numel-1``.

    The plain statement of the convention (int64 arithmetic); the fast paths below give the
    same bits.
    """
    s_lo, s_hi = seed_words(seed, label)
    n = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    return mix32(mix32((n & _M32) ^ s_lo) ^ (((n >> 32) + s_hi) & _M32))


def _as_int32(v: int) -> int:
    """The int32 whose two's-complement pattern is ``v mod 2**32``."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    # mix32 in place on int32 tensors holding uint32 patterns: the products wrap mod 2**32
    # and the masks turn the arithmetic shifts into logical ones.
    x ^= (x >> 16) & 0xFFFF
    x *= _as_int32(MIX32_MUL1)
    x ^= (x >> 15) & 0x1FFFF
    x *= _as_int32(MIX32_MUL2)
    x ^= (x >> 16) & 0xFFFF
    return x


def _index_words(numel: int, offset: int) -> tuple[int, int, int, int]:
    """``(n_lo of element 0, n_hi before the wrap, n_hi after it, wrap)``.

    ``n_hi`` is ``offset >> 32`` up to element ``wrap``, where ``offset + i`` reaches the next
    multiple of 2**32, and one more from there (``numel < 2**32``).
    """
    off_lo, off_hi = offset & _M32, offset >> 32
    return off_lo, off_hi, off_hi + 1, min(numel, (1 << 32) - off_lo)


# The native loops and the torch int32 path take at most this many elements per call, so
# the low index word wraps at most once per call; a multiple of native.LANES.
_SEGMENT = 1 << 30


def _segments(numel: int, offset: int):
    """``(start, length, n_lo, high key before the wrap, high key after it, wrap)`` per segment;
    the high keys already include ``s_hi``, the caller adds nothing."""
    for start in range(0, numel, _SEGMENT):
        m = min(_SEGMENT, numel - start)
        off_lo, hi0, hi1, wrap = _index_words(m, offset + start)
        yield start, m, off_lo, hi0, hi1, wrap


def _torch_words(numel: int, words: tuple[int, int], offset: int, device) -> torch.Tensor:
    """The hash bits as int32 patterns, in torch int32 ops (any device; ``numel <= 2**30``)."""
    s_lo, s_hi = words
    off_lo, hi0, hi1, wrap = _index_words(numel, offset)
    x = torch.arange(numel, dtype=torch.int32, device=device)
    x += _as_int32(off_lo)
    x ^= _as_int32(s_lo)
    _mix32_int32_(x)
    x[:wrap] ^= _as_int32(hi0 + s_hi)
    x[wrap:] ^= _as_int32(hi1 + s_hi)
    return _mix32_int32_(x)


def _mix32_numpy_(x: np.ndarray, tmp: np.ndarray) -> None:
    # uint32 arrays: products wrap mod 2**32 and shifts are logical, so mix32 takes 8
    # in-place passes instead of 11 on int32 tensors.
    np.right_shift(x, 16, out=tmp)
    x ^= tmp
    x *= np.uint32(MIX32_MUL1)
    np.right_shift(x, 15, out=tmp)
    x ^= tmp
    x *= np.uint32(MIX32_MUL2)
    np.right_shift(x, 16, out=tmp)
    x ^= tmp


# Elements hashed at once by the numpy path: the uint32 work arrays (128 KiB each) stay in L2;
# measured ~3x faster than whole 128-row chunks of a 1536-wide weight.
_CPU_BLOCK = 1 << 15


def _numpy_blocks(numel: int, words: tuple[int, int], offset: int):
    """``(start, bits)`` per block of at most ``_CPU_BLOCK`` elements: the hash bits as a
    uint32 work array, valid until the next block."""
    s_lo, s_hi = words
    block = max(1, min(_CPU_BLOCK, numel))
    counter = np.arange(block, dtype=np.uint32)
    h, tmp = np.empty(block, dtype=np.uint32), np.empty(block, dtype=np.uint32)
    for start in range(0, numel, block):
        m = min(block, numel - start)
        hb, tb = h[:m], tmp[:m]
        off_lo, hi0, hi1, wrap = _index_words(m, offset + start)
        np.add(counter[:m], np.uint32(off_lo), out=hb)
        hb ^= np.uint32(s_lo)
        _mix32_numpy_(hb, tb)
        hb[:wrap] ^= np.uint32((hi0 + s_hi) & _M32)
        hb[wrap:] ^= np.uint32((hi1 + s_hi) & _M32)
        _mix32_numpy_(hb, tb)
        yield start, hb


def random_words(numel: int, *, seed: int, label: str, offset: int = 0,
                 device=None) -> torch.Tensor:
    """:func:`random_bits` as an int32 tensor of the same 32-bit patterns, computed fast.

    On the CPU: one compiled pass (:mod:`rgc._native`), else numpy; elsewhere torch int32 ops.
    Every path gives the same bits.
    """
    return _hash_fill(numel, seed=seed, label=label, offset=offset, device=device, grid=None)


def random_grid(numel: int, *, seed: int, label: str, offset: int = 0, device=None,
                add: float = 0.0, mul: float = 1.0) -> torch.Tensor:
    """FP32 ``((bits >> 8) + add) * mul`` of the hash bits (``>>`` logical), two float32
    operations in this order, so every path and device gives the same values. ``add`` and
    ``mul`` must be exactly representable in float32."""
    return _hash_fill(numel, seed=seed, label=label, offset=offset, device=device,
                      grid=(add, mul))


def _hash_fill(numel, *, seed, label, offset, device, grid) -> torch.Tensor:
    device = torch.device("cpu") if device is None else torch.device(device)
    words = seed_words(seed, label)
    dtype = torch.int32 if grid is None else torch.float32
    if device.type != "cpu":
        parts = [_torch_words(m, words, offset + start, device)
                 for start, m, *_ in _segments(numel, offset)]
        out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32, device=device)
        if grid is not None:
            out = ((out >> 8) & 0xFFFFFF).to(torch.float32).add_(grid[0]).mul_(grid[1])
        return out
    out = torch.empty(numel, dtype=dtype)
    lib = _native.library()
    if lib is not None:
        for start, m, off_lo, hi0, hi1, wrap in _segments(numel, offset):
            keys = (off_lo, words[0], (hi0 + words[1]) & _M32, (hi1 + words[1]) & _M32, wrap)
            if grid is None:
                lib.rgc_hash_words(out.data_ptr() + 4 * start, m, *keys)
            else:
                lib.rgc_hash_grid(out.data_ptr() + 4 * start, m, *keys, *grid)
        return out
    flat = out.numpy()
    for start, bits in _numpy_blocks(numel, words, offset):
        if grid is None:
            flat.view(np.uint32)[start:start + bits.size] = bits
        else:
            bits >>= np.uint32(8)
            part = flat[start:start + bits.size]
            part[:] = bits  # < 2**24: exact
            part += np.float32(grid[0])
            part *= np.float32(grid[1])
    return out


def _round_native(lib, x32: torch.Tensor, out: torch.Tensor, words, offset: int,
                  lanes: np.ndarray | None) -> None:
    lanes_ptr = None if lanes is None else lanes.ctypes.data
    for start, m, off_lo, hi0, hi1, wrap in _segments(x32.numel(), offset):
        lib.rgc_round_bf16(x32.data_ptr() + 4 * start, out.data_ptr() + 2 * start, m, off_lo,
                           words[0], (hi0 + words[1]) & _M32, (hi1 + words[1]) & _M32, wrap,
                           lanes_ptr)


def _round_numpy(x32: torch.Tensor, out: torch.Tensor, words, offset: int,
                 lanes: np.ndarray | None) -> None:
    """The native loop in numpy uint32 ufuncs, block by block (same bits, same lane sums)."""
    x_bits = x32.detach().numpy().reshape(-1).view(np.uint32)
    out_bits = out.detach().view(torch.int16).numpy().reshape(-1).view(np.uint16)
    tmp = np.empty(min(_CPU_BLOCK, x_bits.size), dtype=np.uint32)
    if lanes is not None:  # row 0: the running lane sums, rows 1..: this block's squares
        squares = np.empty((-(-tmp.size // _native.LANES) + 1, _native.LANES))
    for start, hb in _numpy_blocks(x_bits.size, words, offset):
        m = hb.size
        xb, tb = x_bits[start:start + m], tmp[:m]
        hb &= np.uint32(0xFFFF)
        hb += xb  # wraps only for NaN patterns, which are replaced below
        hb >>= np.uint32(16)
        np.bitwise_and(xb, np.uint32(0x7FFFFFFF), out=tb)
        nan = tb > np.uint32(0x7F800000)
        if nan.any():
            hb[nan] = (xb[nan] >> np.uint32(16)) | np.uint32(0x40)
        out_bits[start:start + m] = hb
        if lanes is not None:
            rows = -(-m // _native.LANES)
            block = squares[:rows + 1]
            block[0] = lanes
            flat = block[1:].reshape(-1)
            flat[m:] = 0.0  # adding +0.0 to a lane leaves it unchanged
            np.left_shift(hb, np.uint32(16), out=tb)
            flat[:m] = tb.view(np.float32)
            np.multiply(flat[:m], flat[:m], out=flat[:m])  # exact in float64
            np.add.reduce(block, axis=0, out=lanes)  # row after row: a sequential sum per lane


def _round_torch(x32: torch.Tensor, out: torch.Tensor, words, offset: int) -> None:
    """Torch int32 ops on any device, ``_SEGMENT`` elements at a time."""
    flat_x, flat_out = x32.view(-1), out.view(-1).view(torch.int16)
    for start, m, *_ in _segments(x32.numel(), offset):
        x_bits = flat_x[start:start + m].view(torch.int32)
        pattern = _torch_words(m, words, offset + start, x32.device)
        # int32 addition on the raw pattern: for negative values the sign bit is set and the
        # magnitude bits still receive the carry, so the rounding is symmetric about zero.
        pattern &= 0xFFFF
        pattern += x_bits
        quiet_nan = (x_bits >> 16) | 0x40
        nan = (x_bits & 0x7FFFFFFF) > 0x7F800000
        # the shift is arithmetic; the cast to int16 keeps the low 16 bits: the upper half
        flat_out[start:start + m] = torch.where(nan, quiet_nan, pattern >> 16).to(torch.int16)


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, *, seed: int, offset: int = 0,
                      sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Round ``x`` stochastically into the BF16 tensor ``out``, in one pass; returns ``out``.

    Args:
        out: BF16, ``x``'s shape and device; overwritten.
        x: floating point (converted to FP32 exactly first).
        seed, offset: as :func:`stochastic_round`.
        sq_norm: optional 0-dim floating tensor on ``out``'s device; the sum of squares of
            the stored BF16 values is **added** to it (so per-chunk calls accumulate a norm).
            On the CPU the sum is taken in float64 in a fixed order (element ``i`` of the call
            into partial sum ``i % 16``, sequentially; the 16 partial sums in order), the same
            with and without the compiled loop; elsewhere it is a torch float64 sum.

    Nothing here reads a tensor value on the host (no device synchronisation).
    """
    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic_round_ writes into a bfloat16 tensor, got {out.dtype}")
    if not x.is_floating_point():
        raise TypeError(f"stochastic_round expects a floating-point tensor, got {x.dtype}")
    if out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out ({tuple(out.shape)}, {out.device}) must have the shape and "
                         f"device of x ({tuple(x.shape)}, {x.device})")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if sq_norm is not None and (sq_norm.dim() != 0 or not sq_norm.is_floating_point()
                                or sq_norm.device != out.device):
        raise ValueError("sq_norm must be a 0-dim floating-point tensor on out's device")
    if not out.is_contiguous():
        out.copy_(stochastic_round_(torch.empty_like(out, memory_format=torch.contiguous_format),
                                    x, seed=seed, offset=offset, sq_norm=sq_norm))
        return out
    x32 = x.detach().to(torch.float32).contiguous()
    words = seed_words(seed)
    if x32.device.type != "cpu":
        _round_torch(x32, out, words, offset)
        if sq_norm is not None:
            sq_norm += out.to(torch.float64).square().sum()
        return out
    lanes = None if sq_norm is None else np.zeros(_native.LANES)
    lib = _native.library()
    if lib is not None:
        _round_native(lib, x32, out, words, offset, lanes)
    else:
        _round_numpy(x32, out, words, offset, lanes)
    if lanes is not None:
        total = 0.0
        for lane in lanes.tolist():
            total += lane
        sq_norm += total
    return out


def stochastic_round(x: torch.Tensor, *, seed: int, offset: int = 0) -> torch.Tensor:
    """Round ``x`` to BF16 stochastically and without bias.

    Args:
        x: any shape; FP32 (other float dtypes are first converted to FP32 exactly).
        seed: integer key of the random bits.
        offset: flat index of ``x``'s first element in the larger tensor it belongs to; element
            ``j`` of ``x.flatten()`` uses the bits of index ``offset + j``.

    Returns:
        A new BF16 tensor of ``x``'s shape. :func:`stochastic_round_` writes into a given one.
    """
    if not x.is_floating_point():
        raise TypeError(f"stochastic_round expects a floating-point tensor, got {x.dtype}")
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return stochastic_round_(out, x, seed=seed, offset=offset)
