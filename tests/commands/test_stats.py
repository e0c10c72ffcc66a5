"""ppo_cli/stats.py against hand-computed numbers."""

import math

import pytest

from ppo_cli.stats import bootstrap_mean_diff_ci, distinct_n, mean, ngrams, summarize, win_rate


def test_summarize_matches_hand_computed_four_values():
    # mean 2.5; median (2 + 3) / 2; population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    assert summarize([4.0, 1.0, 3.0, 2.0]) == pytest.approx(
        {"mean": 2.5, "median": 2.5, "std": math.sqrt(1.25), "min": 1.0, "max": 4.0}, abs=1e-12
    )


def test_summarize_of_nothing_is_nan_not_an_error():
    assert all(math.isnan(v) for v in summarize([]).values())
    assert math.isnan(mean([]))


def test_ngrams_are_contiguous_windows():
    assert ngrams(["a", "b", "c"], 2) == [("a", "b"), ("b", "c")]
    assert ngrams(["a"], 2) == []


def test_distinct_n_pools_ngrams_over_all_texts():
    texts = ["a b a", "a b"]
    # unigrams a b a a b: {a, b} -> 2 / 5
    assert distinct_n(texts, 1) == pytest.approx(2 / 5)
    # bigrams (a b) (b a) (a b): {(a b), (b a)} -> 2 / 3
    assert distinct_n(texts, 2) == pytest.approx(2 / 3)


def test_distinct_n_is_one_without_repeats_and_zero_without_ngrams():
    assert distinct_n(["the cat sat", "on a mat"], 1) == 1.0
    assert distinct_n(["one", ""], 2) == 0.0
    with pytest.raises(ValueError):
        distinct_n(["a"], 0)


def test_win_rate_counts_ties_as_half():
    # b beats a in pair 1, ties in pair 2, loses in pair 3: (1 + 0.5 + 0) / 3
    assert win_rate([1.0, 2.0, 3.0], [2.0, 2.0, 1.0]) == pytest.approx(0.5)
    assert win_rate([0.0, 0.0], [1.0, 1.0]) == 1.0


def test_win_rate_needs_paired_values():
    with pytest.raises(ValueError, match="paired"):
        win_rate([1.0], [1.0, 2.0])


def test_bootstrap_ci_of_constant_differences_has_zero_width():
    low, high = bootstrap_mean_diff_ci([1.0, 2.0, 3.0], [3.0, 4.0, 5.0], seed=0)
    assert (low, high) == pytest.approx((2.0, 2.0))


def test_bootstrap_ci_of_two_pairs_spans_the_resampled_means():
    # differences [0, 2]: a resample of two has mean 0 (p 1/4), 1 (p 1/2) or 2 (p 1/4), so the
    # 2.5% and 97.5% quantiles of 4000 resampled means are 0 and 2.
    low, high = bootstrap_mean_diff_ci([0.0, 0.0], [0.0, 2.0], seed=1, n_resamples=4000)
    assert (low, high) == (0.0, 2.0)


def test_bootstrap_ci_is_reproducible_and_contains_the_mean_difference():
    a = [0.1, -0.3, 0.8, 0.2, -1.0, 0.5, 0.0, 0.4]
    b = [1.1, 0.2, 0.9, 1.5, -0.2, 0.7, 0.6, 0.3]
    first = bootstrap_mean_diff_ci(a, b, seed=7)
    assert bootstrap_mean_diff_ci(a, b, seed=7) == first
    assert bootstrap_mean_diff_ci(a, b, seed=8) != first
    low, high = first
    assert low < mean(b) - mean(a) < high


def test_bootstrap_ci_needs_paired_values():
    with pytest.raises(ValueError, match="paired"):
        bootstrap_mean_diff_ci([1.0], [])
