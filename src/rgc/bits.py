"""The bit convention of rgc's counter-based random numbers (a leaf module).

Every random bit rgc uses (stochastic rounding, projections) is a hash of ``(seed, label,
flat index)``; no generator state is consumed, so every kernel and a sync receiver get the
same bits. The convention:

* ``s_lo, s_hi = seed_words(seed, label)`` are two 32-bit words derived from the 64-bit seed;
* for flat element index ``n = offset + i`` with 32-bit halves ``n_lo, n_hi``,
  ``bits = mix32(mix32(n_lo ^ s_lo) ^ ((n_hi + s_hi) mod 2**32))``, where ``mix32`` is the
  "lowbias32" integer hash (xorshift-multiply, constants 0x7FEB352D and 0x846CA68B).

:func:`random_bits` is its plain int64 statement, which the tests hold every kernel of
:mod:`rgc.ops` to; :mod:`rgc.rounding` says how rounding uses the bits.
"""

from __future__ import annotations

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
