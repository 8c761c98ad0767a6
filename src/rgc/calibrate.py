"""Choosing tau (the RGC learning rate) from an AdamW learning rate."""

from __future__ import annotations

import math

import torch.nn as nn

from rgc.nn import sketched_weights
from rgc.updates import sum_squares


def calibrate_lr(model: nn.Module, adamw_lr: float = 1e-6) -> float:
    """tau whose first RGC update is as large as a first AdamW step at ``adamw_lr``.

    A first AdamW step moves every element by about ``adamw_lr`` (m_hat / sqrt(v_hat) is the
    sign of the gradient), so over the compressed weights ``||dW|| = adamw_lr * sqrt(N)`` with N
    their element count. An RGC step moves each weight by ``tau * ||W_l||``, i.e. by
    ``tau * ||W||`` over all of them. Equating the two::

        tau = adamw_lr * sqrt(N) / ||W|| = adamw_lr / rms(W)

    where rms is the root mean square of all compressed weight elements of ``model`` (which
    must be wrapped with :func:`rgc.wrap`), expert stacks included. METHOD.md's recipe then
    tries tau and 3 * tau.

    For :class:`rgc.RGCOptimizer` only (a normalised step). :class:`rgc.RowAdam` (the LoGRA
    recipe) takes AdamW's rate as it is: its per-row second moments scale each step as Adam's
    do, and a step controller then bounds it (the GRPO demo gives both 1e-4).
    """
    if not (adamw_lr > 0):
        raise ValueError(f"adamw_lr must be > 0, got {adamw_lr!r}")
    weights = [owner.weight for _, owner in sketched_weights(model)]
    if not weights:
        raise ValueError("calibrate_lr needs a wrapped model; call rgc.wrap(model, rank) first")
    # an expert stack [E, a, b] is read as E*a rows of b (row chunks, not chunks of experts)
    sum_sq = sum(float(sum_squares(w.reshape(-1, w.shape[-1])).sqrt()) ** 2 for w in weights)
    numel = sum(w.numel() for w in weights)
    if sum_sq == 0.0:
        raise ValueError("the compressed weights are all zero; tau cannot be calibrated")
    return adamw_lr * math.sqrt(numel / sum_sq)
