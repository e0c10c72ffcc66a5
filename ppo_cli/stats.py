"""Small statistics for `ppo eval` and `ppo compare`: summaries, distinct-n, win rate, bootstrap CI.

Plain lists of floats or strings in, plain numbers out; numpy only (no torch), so the maths can be
tested with hand-computed numbers.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, standard deviation (population, ddof=0), min and max of ``values``.

    Every entry is NaN for an empty list, so a table shows "nan" rather than a crash.
    """
    if not values:
        nan = float("nan")
        return {"mean": nan, "median": nan, "std": nan, "min": nan, "max": nan}
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "std": float(array.std()),
        "min": float(array.min()),
        "max": float(array.max()),
    }


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for an empty list."""
    return math.fsum(values) / len(values) if values else float("nan")


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The contiguous n-grams of a token list: ["a", "b", "c"], 2 -> [("a", "b"), ("b", "c")]."""
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n (Li et al., 2016): unique n-grams / all n-grams, pooled over every text.

    Texts are split on whitespace. 1.0 means no n-gram repeats anywhere; values near 0 mean the
    responses repeat themselves or each other (mode collapse). 0.0 when there are no n-grams at all.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [gram for text in texts for gram in ngrams(text.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def win_rate(a: Sequence[float], b: Sequence[float]) -> float:
    """Fraction of pairs where ``b`` beats ``a`` (b_i > a_i), a tie counting as half a win."""
    if len(a) != len(b):
        raise ValueError(f"win_rate needs paired values, got {len(a)} and {len(b)}")
    if not a:
        return float("nan")
    wins = sum(1.0 if y > x else 0.5 if y == x else 0.0 for x, y in zip(a, b))
    return wins / len(a)


def bootstrap_mean_diff_ci(
    a: Sequence[float], b: Sequence[float], *, seed: int = 0, n_resamples: int = 2000, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of mean(b - a) over paired samples.

    Pairs (a_i, b_i) are resampled with replacement ``n_resamples`` times from a generator seeded
    with ``seed`` (so the interval is reproducible); the interval is the (1 - confidence) / 2 and
    (1 + confidence) / 2 quantiles of the resampled means. A single pair gives a zero-width interval.
    """
    if len(a) != len(b):
        raise ValueError(f"bootstrap needs paired values, got {len(a)} and {len(b)}")
    if not a:
        return float("nan"), float("nan")
    diffs = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)  # (N,)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(diffs), size=(n_resamples, len(diffs)))  # (R, N) indexes
    means = diffs[picks].mean(axis=1)  # (R,)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)
