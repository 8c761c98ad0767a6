"""Deterministic seed derivation.

Every random choice in rgc (projection matrices, rounding bits) is a pure function of a
user seed and a few integers or names, so runs are reproducible and a receiver of a policy
sync payload can regenerate exactly what the trainer used.
"""

from __future__ import annotations

import zlib

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *parts: int | str) -> int:
    """Mix ``seed`` with ``parts`` (ints or strings) into a seed in ``[0, 2**63)``.

    Strings are hashed with CRC-32, so the result does not depend on Python's hash
    randomisation and is the same in every process.
    """
    h = _splitmix64(int(seed) & _MASK64)
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else int(part) & _MASK64
        h = _splitmix64(h ^ value)
    return h >> 1
