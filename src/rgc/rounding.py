"""Counter-based stochastic rounding from FP32 to BF16.

The random bits for element ``i`` are a hash of ``(seed, offset + i)``; no generator state is
consumed. The same convention is used by the Triton kernels, so both paths write bit-identical
weights, and a receiver of a sync payload can reproduce the trainer's rounding exactly.

Bit convention (public, shared by every kernel of :mod:`rgc.ops`):

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

The operator :func:`rgc.ops.stochastic_round_` implements it (its torch reference and its
Triton kernel give the same bits); :func:`random_bits` is the plain int64 statement of the
hash that the tests hold them to.
"""

from __future__ import annotations

import numbers

import torch

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


def random_words(numel: int, *, seed: int, label: str, offset: int = 0,
                 device=None) -> torch.Tensor:
    """:func:`random_bits` as an int32 tensor of the same 32-bit patterns, computed fast
    (:func:`rgc.ops.random_words`)."""
    from rgc import ops

    device = torch.device("cpu") if device is None else torch.device(device)
    return ops.random_words(numel, seed, label, offset, device)


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, *, seed: int,
                      offset: int = 0) -> torch.Tensor:
    """Round ``x`` stochastically into the BF16 tensor ``out``, in one pass; returns ``out``.

    Args:
        out: BF16, ``x``'s shape and device (any strides); overwritten.
        x: floating point (converted to FP32 exactly first).
        seed, offset: as :func:`stochastic_round`.

    Nothing here reads a tensor value on the host (no device synchronisation).
    """
    from rgc import ops

    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic_round_ writes into a bfloat16 tensor, got {out.dtype}")
    if not x.is_floating_point():
        raise TypeError(f"stochastic_round expects a floating-point tensor, got {x.dtype}")
    if out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out ({tuple(out.shape)}, {out.device}) must have the shape and "
                         f"device of x ({tuple(x.shape)}, {x.device})")
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    ops.stochastic_round_(out, x, int(seed), int(offset))
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
