"""The autograd Function behind :class:`rgc.CompressedLinear`.

Forward saves ``X P`` (n x r) instead of ``X`` (n x k). Backward returns the exact input
gradient ``D W`` and, instead of a weight gradient, the FP32 sketch ``D^T (X P)`` (d x r) as
the gradient of the layer's sketch slot (a zero-stride d x r leaf that holds no memory); the
layer moves it into ``layer.sketch`` (see :meth:`rgc.CompressedLinear._take_sketch`). The
d x k gradient ``D^T X`` is never formed. The Function has no side effects, so forward and
backward compile under ``torch.compile`` without graph breaks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SketchedLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b``; the gradient of ``sketch_slot`` (d x r FP32) is ``D^T (X P)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, projection, sketch_slot):
        # Under torch.autocast both matmuls run in the autocast dtype, like nn.Linear's.
        out = F.linear(x, weight, bias)
        xp = torch.matmul(x, projection)
        ctx.save_for_backward(xp, weight)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xp, weight = ctx.saved_tensors
        grad_x = grad_bias = grad_sketch = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad_out, weight.to(grad_out.dtype)).to(ctx.x_dtype)
        d2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[4]:
            grad_sketch = d2.t().to(torch.float32) @ xp.reshape(-1, xp.shape[-1]).to(
                torch.float32)
        if ctx.needs_input_grad[2]:
            grad_bias = d2.sum(0)
        return grad_x, None, grad_bias, None, grad_sketch
