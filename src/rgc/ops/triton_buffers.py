"""Bytes of the temporary buffers of the Triton launchers (:mod:`rgc.ops.triton`).

Importable without Triton: the launchers size their buffers by these, and the memory
estimator (:mod:`rgc.memory.estimate`) reads them to predict a GPU step on any machine. The
reference's counterparts live beside its loops (:func:`rgc.ops.reference.sketch_stats_bytes`,
:func:`rgc.ops.reference.make_projections_bytes`).
"""

from rgc.ops.reference import one_pass

#: Rows of C per program of the sketch-norm kernel (``BLOCK_M`` of ``STATS_TILE``).
STATS_BLOCK_M = 64

#: Bytes of the refresh's buffers at once (G and the r x r work; the float64 CholeskyQR3
#: buffers for k < 4 r): :func:`rgc.ops.triton.make_projections_` works in chunks of
#: :func:`projection_chunk` seeds within it.
PROJECTION_CHUNK_BYTES = 64 << 20


def sketch_stats_bytes(e: int, d: int, r: int) -> int:
    """Temporary bytes of :func:`rgc.ops.triton.sketch_stats` per stack of ``e`` sketches
    d x r: the r x r FP32 Gram of its projection (a BF16 or FP32 P is read in place), the
    FP32 row-block partials of the sums and of the non-finite counts (``e ceil(d /
    STATS_BLOCK_M)`` each) and its table row (two int64)."""
    blocks = -(-d // STATS_BLOCK_M)
    return 4 * r * r + 2 * 4 * e * blocks + 16


def projection_bytes(k: int, r: int) -> int:
    """Bytes of the buffers of one orthonormal k x r projection in
    :func:`rgc.ops.triton.make_projections_`: G (``8 k ceil(r/2)``), then the Gram, the
    float64 r x r work and the scaled inverse (``28 r^2`` at most for one CholeskyQR pass,
    ``32 r^2`` for CholeskyQR3, ``k < 4 r``, which adds two float64 k x r buffers: ``16 k r``)."""
    g = 8 * k * ((r + 1) // 2)
    return g + (28 * r * r if one_pass(k, r) else 32 * r * r + 16 * k * r)


def projection_chunk(k: int, r: int) -> int:
    """Orthonormal k x r projections that :func:`rgc.ops.triton.make_projections_` refreshes
    together (at least one)."""
    return max(1, PROJECTION_CHUNK_BYTES // projection_bytes(k, r))


def make_projections_bytes(k: int, r: int, count: int = 1) -> int:
    """Peak temporary bytes of :func:`rgc.ops.triton.make_projections_` refreshing ``count``
    orthonormal k x r projections of one layout: one chunk's buffers."""
    return min(max(1, count), projection_chunk(k, r)) * projection_bytes(k, r)
