"""The autograd Function behind :class:`rgc.CompressedLinear`.

Forward saves ``X P`` (n x r) instead of ``X`` (n x k). Backward returns the exact input
gradient ``D W`` and, instead of a weight gradient, the FP32 sketch ``D^T (X P)`` (d x r) as
the gradient of the layer's sketch slot (a zero-stride d x r leaf that holds no memory); the
layer moves it into ``layer.sketch`` (see :meth:`rgc.CompressedLinear._take_sketch`). The
d x k gradient ``D^T X`` is never formed. The Function has no side effects, so forward and
backward compile under ``torch.compile`` without graph breaks.

With ``compute_dtype`` set (e.g. FP32 for BF16 weights on a CPU without fast BF16 matmuls, see
:mod:`rgc.compute`), both matmuls of each direction run in that dtype on transient copies of the
operands; what is saved and returned keeps the stored dtypes.
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
    """``Y = X W^T + b``; the gradient of ``sketch_slot`` (d x r FP32) is ``D^T (X P)``.

    ``compute_dtype``: ``None`` or the dtype of the matmuls (see :mod:`rgc.compute`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, projection, sketch_slot, compute_dtype):
        # Under torch.autocast both matmuls run in the autocast dtype, like nn.Linear's.
        out = linear_in(x, weight, bias, compute_dtype)
        if compute_dtype is None:
            xp = torch.matmul(x, projection)
        else:
            xp = torch.matmul(x.to(compute_dtype), projection.to(compute_dtype)).to(x.dtype)
        ctx.save_for_backward(xp, weight)
        ctx.x_dtype = x.dtype
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xp, weight = ctx.saved_tensors
        grad_x = grad_bias = grad_sketch = None
        if ctx.needs_input_grad[0]:
            dtype = ctx.compute_dtype or grad_out.dtype
            grad_x = torch.matmul(grad_out.to(dtype), weight.to(dtype)).to(ctx.x_dtype)
        d2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[4]:
            grad_sketch = d2.t().to(torch.float32) @ xp.reshape(-1, xp.shape[-1]).to(
                torch.float32)
        if ctx.needs_input_grad[2]:
            grad_bias = d2.sum(0)
        return grad_x, None, grad_bias, None, grad_sketch, None
