"""Counter-based stochastic rounding from FP32 to BF16.

The random bits for element ``i`` are a hash of ``(seed, offset + i)``; no generator state is
consumed. The same convention is used by the Triton kernels, so both paths write bit-identical
weights, and a receiver of a sync payload can reproduce the trainer's rounding exactly.

Bit convention (public, shared by every kernel of :mod:`rgc.ops`):

* ``bits`` of flat element index ``n = offset + i`` are those of :mod:`rgc.bits`
  (``random_bits(numel, seed=seed, offset=offset)``, label ``"stochastic-round"``);
* the low 16 bits of ``bits`` are added to the FP32 bit pattern, which is then truncated to
  its upper 16 bits. A value a fraction ``f`` of the way from one BF16 neighbour to the next
  therefore rounds up with probability ``f`` (to a resolution of 2**-16): unbiased.

NaN stays NaN (stored as the quiet NaN of its sign: the upper 16 bits with bit 6 set), +-inf
and every BF16-representable value (+-0, subnormals, BF16 max) are unchanged. A finite FP32
value above the largest BF16 number may round to inf.

The operator :func:`rgc.ops.stochastic_round_` implements it (its torch reference and its
Triton kernel give the same bits); :func:`rgc.bits.random_bits` is the plain int64 statement of the
hash that the tests hold them to.
"""

from __future__ import annotations

import numbers

import torch

from rgc import ops


def random_words(numel: int, *, seed: int, label: str, offset: int = 0,
                 device=None) -> torch.Tensor:
    """:func:`rgc.bits.random_bits` as an int32 tensor of the same 32-bit patterns, computed fast
    (:func:`rgc.ops.random_words`)."""
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
