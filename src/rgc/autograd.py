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


def linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              dtype: torch.dtype | None) -> torch.Tensor:
    """``F.linear`` computed in ``dtype`` and returned in ``x.dtype``; ``None``: plain F.linear."""
    if dtype is None:
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.to(dtype)
    return F.linear(x.to(dtype), weight.to(dtype), bias).to(x.dtype)


class SketchedLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b`` whose backward writes ``D^T (X P)`` into ``layer.sketch``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        # Under torch.autocast both matmuls run in the autocast dtype, like nn.Linear's.
        dtype = layer.compute_dtype
        out = linear_in(x, weight, bias, dtype)
        if dtype is None:
            xp = torch.matmul(x, layer.projection)
        else:
            xp = torch.matmul(x.to(dtype), layer.projection.to(dtype)).to(x.dtype)
        ctx.save_for_backward(xp, weight)
        ctx.layer = layer
        ctx.projection_version = layer.projection_version
        ctx.x_dtype = x.dtype
        ctx.compute_dtype = dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xp, weight = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            dtype = ctx.compute_dtype or grad_out.dtype
            grad_x = torch.matmul(grad_out.to(dtype), weight.to(dtype)).to(ctx.x_dtype)
        d2 = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.layer.accumulate_sketch(d2, xp.reshape(-1, xp.shape[-1]), ctx.projection_version)
        if ctx.needs_input_grad[2]:
            grad_bias = d2.sum(0)
        return grad_x, None, grad_bias, None
