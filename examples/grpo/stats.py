"""Paired comparisons of two policies on the same questions."""

from __future__ import annotations

import math

import numpy as np
import torch


def mcnemar_p(before: torch.Tensor, after: torch.Tensor) -> float:
    """Exact two-sided McNemar p-value from the discordant pairs (0/1 vectors, same questions)."""
    b = int(((before == 1) & (after == 0)).sum())
    c = int(((before == 0) & (after == 1)).sum())
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def paired_difference(before: torch.Tensor, after: torch.Tensor, *, seed: int,
                      resamples: int = 10000, level: float = 0.95) -> dict:
    """Accuracy difference ``after - before`` with a paired bootstrap interval and McNemar p.

    before, after: (n,) 0/1 correctness on the same n questions. Returns points (x100).
    """
    if before.shape != after.shape:
        raise ValueError(f"paired vectors differ in shape: {before.shape} vs {after.shape}")
    diff = (after.double() - before.double()).numpy()
    n = diff.size
    # Resampling questions with replacement only redraws how many pairs are -1, 0 and +1,
    # so the bootstrap draws those three counts from one multinomial.
    probs = [(diff < 0).mean(), (diff == 0).mean(), (diff > 0).mean()]
    counts = np.random.default_rng(seed).multinomial(n, probs, size=resamples)
    means = (counts[:, 2] - counts[:, 0]) / n
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"diff_points": 100 * float(diff.mean()), "ci_low": 100 * float(lo),
            "ci_high": 100 * float(hi), "mcnemar_p": mcnemar_p(before, after), "n": int(n)}
