"""The fixed summation order of rgc's bit contract, written out plainly in numpy (the
independent reference of ``rgc.ops.pairwise_sums``)."""

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
