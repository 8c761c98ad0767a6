"""The autograd Function behind a sketched stack of experts.

One Function per expert weight (``W`` as ``[E, d, k]``) of an experts layer. Its input is the
``S`` routed rows sorted by expert (``offs``: cumulative row counts, int32 ``[E]``); its output
``Y [S, d]`` has ``Y[s] = X[s] W_e^T`` for the expert ``e`` of row ``s``. Forward saves ``X P``
instead of ``X``; backward returns the exact input gradient ``D_e W_e`` per row and, as the
gradient of the weight's zero-stride sketch slot, ``C_e = D_e^T (X_e P)`` for every expert
(``[E, d, r]`` FP32; zero for an expert that received no row). Neither ``D^T X`` nor any
``d x k`` block of it is formed, and ``W`` gets no gradient.

``X P`` comes in one of two ways:

* ``xp=None``: computed here from the rows, ``[S, r]`` (the down projection, whose input is
  different for every (token, expert) pair);
* ``xp [n, r]`` with ``xp_index [S]``: one ``X P`` per token, computed before routing, and row
  ``s`` uses ``xp[xp_index[s]]`` (the gate/up projection, whose input is the token's hidden
  state whichever expert it goes to: saving it once per token instead of once per routed row
  divides its memory by the number of experts per token). This is exact because ``P`` is shared
  by the experts of the weight.

With ``sketch_slot=None`` (a frozen expert weight) nothing is saved but the weight, and only
the input gradient is returned.
"""

from __future__ import annotations

import torch

from rgc.experts.grouped import grouped_mm, grouped_sketch


class SketchedExpertsFunction(torch.autograd.Function):
    """``Y[rows of e] = X[rows of e] W_e^T``; the sketch slot's gradient is ``D_e^T (X_e P)``."""

    @staticmethod
    def forward(ctx, x, weight, offs, projection, xp, xp_index, sketch_slot):
        # weight: [E, d, k] (possibly a transposed view of [E, k, d] storage)
        out = grouped_mm(x, weight.transpose(1, 2), offs)
        if sketch_slot is not None and xp is None:
            xp = torch.matmul(x, projection)
        ctx.sketched = sketch_slot is not None
        ctx.has_index = xp_index is not None
        saved = (weight, offs) + ((xp,) if ctx.sketched else ()) + (
            (xp_index,) if ctx.sketched and ctx.has_index else ())
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, offs, *rest = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_sketch = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_out, weight, offs)
        if ctx.sketched and ctx.needs_input_grad[6]:
            xp = rest[0] if not ctx.has_index else rest[0][rest[1]]
            grad_sketch = grouped_sketch(grad_out, xp, offs)
        return grad_x, None, None, None, None, None, grad_sketch
