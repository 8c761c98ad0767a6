"""Pure-PyTorch implementations: the CPU path and the oracle the kernels are tested against.

Each function here has a Triton twin in :mod:`rgc.kernels` with the same signature;
:mod:`rgc.dispatch` picks one.
"""

from rgc.reference.update import (
    frobenius_norm_reference,
    lowrank_update_reference,
    sum_squares_reference,
)

__all__ = ["frobenius_norm_reference", "lowrank_update_reference", "sum_squares_reference"]
