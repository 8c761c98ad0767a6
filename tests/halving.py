"""The sums of rgc's bit contract written out plainly: the fixed halving order in numpy (the
independent reference of ``rgc.ops.pairwise_sums``) and the exact weight norm."""

import numpy as np
import torch

NUMPY = {torch.bfloat16: np.float32, torch.float32: np.float32, torch.float64: np.float64}


def halving_sums(x: torch.Tensor, square: bool) -> np.ndarray:
    """The order of the contract, one numpy operation per level: each row padded with zeros
    to a power of two, then ``v[j] + v[j + w/2]`` until one value is left."""
    v = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    v = v.reshape(-1, x.shape[-1]).numpy().astype(NUMPY[x.dtype])
    if square:
        v = v * v
    width = 1
    while width < v.shape[1]:
        width *= 2
    v = np.concatenate([v, np.zeros((v.shape[0], width - v.shape[1]), v.dtype)], axis=1)
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        v = v[:, :half] + v[:, half:]
    return v[:, 0].reshape(x.shape[:-1])


def exact_square_sums(stack: torch.Tensor) -> np.ndarray:
    """``||W_e||_F^2`` of each matrix of ``stack`` (``[E, d, k]``): the exact sum of the squares
    (``math.fsum`` of the float64 squares, each exact) rounded once to FP32, the value the
    weight norm of the contract promises."""
    import math

    sums = np.array([math.fsum(v * v for v in w.double().reshape(-1).tolist()) for w in stack])
    with np.errstate(over="ignore"):  # beyond FP32's range: inf, as the rounding gives
        return sums.astype(np.float32)
