"""Paired comparisons of two policies on the same questions, for one seed or pooled over seeds."""

from __future__ import annotations

import numpy as np
import torch


def mcnemar_p(before: torch.Tensor, after: torch.Tensor) -> float:
    """Exact two-sided McNemar p-value from the discordant pairs (0/1 vectors, same questions).

    ``2 P(Bin(n, 1/2) <= min(b, c))`` for b questions lost and c gained, in exact integer
    arithmetic: Python divides integers of any size with one correct rounding, so nothing
    overflows however many questions changed (a p below the smallest float, 5e-324, reads 0.0).
    """
    b = int(((before == 1) & (after == 0)).sum())
    c = int(((before == 0) & (after == 1)).sum())
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    term, tail = 1, 1  # C(n, 0); then C(n, i) from C(n, i - 1)
    for i in range(1, k + 1):
        term = term * (n - i + 1) // i
        tail += term
    return min(1.0, (2 * tail) / (1 << n))


def _interval(means: np.ndarray, estimate: float, level: float) -> dict:
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"diff_points": 100 * estimate, "ci_low": 100 * float(lo), "ci_high": 100 * float(hi)}


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
    return {**_interval(means, float(diff.mean()), level),
            "mcnemar_p": mcnemar_p(before, after), "n": int(n)}


def seeds_and_questions_bootstrap(diffs: np.ndarray, *, shared_questions: bool, seed: int,
                                  resamples: int = 10000, level: float = 0.95) -> dict:
    """Mean paired difference over seeds and questions, with an interval covering both.

    diffs: (S, n) per-question differences of S seeds (after - before; for 0/1 correctness in
    {-1, 0, 1}). Each resample draws S seeds with replacement and n questions with replacement
    and takes the mean over the drawn (seed, question) cells. With ``shared_questions`` (every
    seed scored the same n test questions, column q the same question in every row) one draw
    of questions serves every drawn seed: seeds and questions are crossed, and this two-way
    ("pigeonhole") bootstrap counts each question's own effect once, as it is (Owen 2007).
    Otherwise (each seed its own questions) every drawn seed gets its own draw of questions: a
    bootstrap over seeds, then questions. With few seeds the seed level is coarse (3 seeds give
    10 distinct draws), so the interval can understate how far another set of seeds would
    land (docs/demo.md). Returns points (x100).
    """
    diffs = np.asarray(diffs, dtype=np.float64)
    means = _resampled_means(diffs, shared_questions, np.random.default_rng(seed), resamples)
    s, n = diffs.shape  # checked by _resampled_means
    return {**_interval(means, float(diffs.mean()), level), "seeds": s, "n": n,
            "shared_questions": shared_questions}


def _resampled_means(diffs: np.ndarray, shared_questions: bool, rng: np.random.Generator,
                     resamples: int) -> np.ndarray:
    """(resamples,) means of :func:`seeds_and_questions_bootstrap`'s resamples of ``diffs``."""
    diffs = np.asarray(diffs, dtype=np.float64)
    if diffs.ndim != 2 or diffs.shape[0] < 1 or diffs.shape[1] < 1:
        raise ValueError(f"diffs must be (seeds, questions) with both >= 1, got {diffs.shape}")
    s, n = diffs.shape
    # As in paired_difference, resampling questions only redraws how often each distinct
    # value (here: each distinct column, at most 3^S of them for 0/1 correctness) comes up.
    if shared_questions:
        patterns, freq = np.unique(diffs, axis=1, return_counts=True)  # (S, u), (u,)
        seed_counts = rng.multinomial(s, [1 / s] * s, size=resamples)  # (resamples, S)
        q_counts = rng.multinomial(n, freq / n, size=resamples)  # (resamples, u)
        sums = seed_counts * (q_counts @ patterns.T)
    else:
        drawn = rng.integers(s, size=(resamples, s))  # the seed in each of the S slots
        sums = np.empty((resamples, s))
        for k in range(s):
            values, freq = np.unique(diffs[k], return_counts=True)
            here = drawn == k
            sums[here] = rng.multinomial(n, freq / n, size=int(here.sum())) @ values
    return sums.sum(1) / (s * n)


def stratified_bootstrap(strata: list[np.ndarray], *, seed: int, resamples: int = 10000,
                         level: float = 0.95) -> dict:
    """The mean over strata (each weighted equally) of the mean paired difference within each.

    strata: one (S_b, n_b) array per base policy (its seeds x its own test questions, shared
    by its seeds); each is resampled as :func:`seeds_and_questions_bootstrap` does with
    ``shared_questions``, independently of the others. Returns points (x100).
    """
    rng = np.random.default_rng(seed)
    strata = [np.asarray(d, dtype=np.float64) for d in strata]
    means = np.mean([_resampled_means(d, True, rng, resamples) for d in strata], axis=0)
    estimate = float(np.mean([d.mean() for d in strata]))
    return {**_interval(means, estimate, level), "strata": len(strata),
            "seeds": sum(d.shape[0] for d in strata)}
