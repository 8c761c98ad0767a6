"""The autograd Function behind :class:`rgc.CompressedLinear`.

Forward saves ``X P`` (n x r) instead of ``X`` (n x k). Backward returns the exact input
gradient ``D W`` and, instead of a weight gradient, accumulates the FP32 sketch
``C += D^T (X P)`` (d x r) on the layer; the d x k gradient ``D^T X`` is never formed.

With ``layer.compute_dtype`` set (e.g. FP32 for BF16 weights on a CPU without fast BF16
matmuls, see :mod:`rgc.compute`), both matmuls of each direction run in that dtype on
transient copies of the operands; what is saved and returned keeps the stored dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _to(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


def linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              dtype: torch.dtype | None) -> torch.Tensor:
    """``F.linear`` computed in ``dtype`` (``None``: as stored), returned in ``x.dtype``."""
    return F.linear(_to(x, dtype), _to(weight, dtype), _to(bias, dtype)).to(x.dtype)


class SketchedLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b`` whose backward writes ``D^T (X P)`` into ``layer.sketch``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        # Under torch.autocast both matmuls run in the autocast dtype, like nn.Linear's.
        dtype = layer.compute_dtype
        out = linear_in(x, weight, bias, dtype)
        xp = torch.matmul(_to(x, dtype), _to(layer.projection, dtype)).to(x.dtype)
        ctx.save_for_backward(xp, weight)
        ctx.layer = layer
        ctx.projection_version = layer.projection_version
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xp, weight = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            dtype = ctx.layer.compute_dtype or grad_out.dtype
            grad_x = torch.matmul(grad_out.to(dtype), weight.to(dtype)).to(ctx.x_dtype)
        d2 = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.layer.accumulate_sketch(d2, xp.reshape(-1, xp.shape[-1]), ctx.projection_version)
        if ctx.needs_input_grad[2]:
            grad_bias = d2.sum(0)
        return grad_x, None, grad_bias, None
