"""Paired comparisons of two policies on the same questions."""

from __future__ import annotations

import math

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
    diff = (after.double() - before.double())
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(diff.numel(), (resamples, diff.numel()), generator=gen)
    means = diff[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                dtype=torch.float64)).tolist()
    return {"diff_points": 100 * float(diff.mean()), "ci_low": 100 * lo, "ci_high": 100 * hi,
            "mcnemar_p": mcnemar_p(before, after), "n": int(diff.numel())}
