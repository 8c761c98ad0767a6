"""The one place that chooses between the Triton kernels and the PyTorch reference.

``RGC_IMPL=torch`` or ``RGC_IMPL=triton`` forces a path; otherwise CUDA tensors use the
Triton kernels when Triton imports, and everything else uses the reference.
"""

from __future__ import annotations

import functools
import os

import torch

from rgc.reference import (
    frobenius_norm_reference,
    lowrank_update_reference,
    sum_squares_reference,
)

IMPLEMENTATIONS = ("torch", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def implementation_for(tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for an update of ``tensor``, honouring ``RGC_IMPL``."""
    return implementation_for_device(tensor.device)


def implementation_for_device(device: torch.device) -> str:
    """'triton' or 'torch' for work on ``device``, honouring ``RGC_IMPL``."""
    forced = os.environ.get("RGC_IMPL", "").strip().lower()
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"RGC_IMPL must be one of {IMPLEMENTATIONS}, got {forced!r}")
        if forced == "triton":
            if not triton_available():
                raise RuntimeError("RGC_IMPL=triton but Triton is not installed; "
                                   "pip install 'rgc-torch[triton]' or unset RGC_IMPL")
            if not _triton_can_run(device):
                raise RuntimeError(
                    f"RGC_IMPL=triton but the tensor is on {device}; Triton runs on CUDA "
                    "devices, or on the CPU only under TRITON_INTERPRET=1")
        return forced
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def lowrank_update_(weight, sketch, projection, coef, *, seed, offset=0, chunk_rows=128,
                    stochastic_rounding=True, sq_norm_out=None) -> None:
    """``W <- W - coef * C P^T`` in place, on the kernel or the reference path.

    ``coef`` is a float or a 0-dim FP32 tensor on W's device (never read on the host; 0
    leaves W bit-identical); ``sq_norm_out`` (0-dim FP32 or ``None``) receives
    ``||W_new||_F^2`` of the stored values. See :func:`rgc.reference.lowrank_update_reference`
    for the contract.
    """
    if implementation_for(weight) == "triton":
        from rgc.kernels import lowrank_update_

        extra = {} if sq_norm_out is None else {"sq_norm_out": sq_norm_out}
        lowrank_update_(weight, sketch, projection, coef, seed=seed, offset=offset,
                        stochastic_rounding=stochastic_rounding, **extra)
    else:
        lowrank_update_reference(weight, sketch, projection, coef, seed=seed, offset=offset,
                                 chunk_rows=chunk_rows, stochastic_rounding=stochastic_rounding,
                                 sq_norm_out=sq_norm_out)


def frobenius_norm(weight, *, chunk_rows=128) -> torch.Tensor:
    """``||W||_F`` in FP32 without a full FP32 copy of W. 0-dim FP32 on W's device."""
    return frobenius_norm_reference(weight, chunk_rows=chunk_rows)


def sum_squares(weight, *, chunk_rows=128) -> torch.Tensor:
    """``||W||_F^2`` in FP32 without a full FP32 copy of W. 0-dim FP32 on W's device."""
    return sum_squares_reference(weight, chunk_rows=chunk_rows)
