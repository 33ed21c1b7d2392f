"""Statistics: percentiles, bootstrap intervals of one and two samples, Mann-Kendall trend."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gates.stats import bootstrap_ci, gain_ci, mann_kendall, percentile, ratio_ci, reduction_ci


def lognormal(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(seed).lognormal(mean=0.0, sigma=0.5, size=n)


# --- percentile ------------------------------------------------------------------------------

def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_raises():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_rejects_q_outside_0_to_100():
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


# --- bootstrap of one sample -----------------------------------------------------------------

def test_bootstrap_ci_contains_the_sample_median():
    sample = lognormal(200, seed=1)
    lo, hi = bootstrap_ci(sample)
    assert lo < float(np.median(sample)) < hi


def test_bootstrap_ci_narrows_with_more_data():
    small_lo, small_hi = bootstrap_ci(lognormal(30, seed=2))
    large_lo, large_hi = bootstrap_ci(lognormal(3000, seed=2))
    assert (large_hi - large_lo) < (small_hi - small_lo) / 3


def test_bootstrap_ci_is_deterministic_for_a_seed_and_varies_across_seeds():
    sample = lognormal(100, seed=3)
    assert bootstrap_ci(sample, seed=7) == bootstrap_ci(sample, seed=7)
    assert bootstrap_ci(sample, seed=7) != bootstrap_ci(sample, seed=8)


def test_bootstrap_ci_of_a_single_value_is_that_value():
    assert bootstrap_ci([4.2]) == (4.2, 4.2)


def test_bootstrap_ci_takes_other_statistics_including_ones_without_axis():
    sample = lognormal(300, seed=4)
    lo, hi = bootstrap_ci(sample, statistic=np.mean)
    assert lo < sample.mean() < hi
    p90 = lambda xs: float(np.percentile(xs, 90))  # no axis argument
    lo, hi = bootstrap_ci(sample, statistic=p90, resamples=300)
    assert lo < p90(sample) < hi


def test_wider_confidence_gives_a_wider_interval():
    sample = lognormal(200, seed=5)
    lo90, hi90 = bootstrap_ci(sample, confidence=0.90)
    lo99, hi99 = bootstrap_ci(sample, confidence=0.99)
    assert lo99 <= lo90 and hi99 >= hi90 and (hi99 - lo99) > (hi90 - lo90)


# --- two independent samples -----------------------------------------------------------------

def test_reduction_ci_of_a_candidate_at_seventy_percent_is_thirty_percent():
    baseline = lognormal(400, seed=10)
    reduction, (lo, hi) = reduction_ci(baseline, 0.7 * baseline)
    assert reduction == pytest.approx(0.30)
    assert lo < 0.30 < hi
    # independent resampling: the two samples do not move together, so the interval has width
    assert hi - lo > 0.02


def test_reduction_ci_on_independent_draws_is_near_thirty_percent():
    reduction, (lo, hi) = reduction_ci(lognormal(2000, seed=11), lognormal(2000, seed=12, scale=0.7))
    assert reduction == pytest.approx(0.30, abs=0.05)
    assert lo <= 0.30 <= hi


def test_gain_ci_of_a_candidate_at_one_thirty_five_is_plus_thirty_five_percent():
    baseline = lognormal(400, seed=20)
    gain, (lo, hi) = gain_ci(baseline, 1.35 * baseline)
    assert gain == pytest.approx(0.35)
    assert lo < 0.35 < hi


def test_gain_ci_on_per_window_throughput_figures():
    rng = np.random.default_rng(21)
    baseline = 1000 + rng.normal(0, 20, size=12)
    candidate = 1350 + rng.normal(0, 20, size=12)
    gain, (lo, hi) = gain_ci(baseline, candidate, statistic=np.mean)
    assert gain == pytest.approx(0.35, abs=0.03)
    assert lo < gain < hi


def test_ratio_ci_gives_the_ratio_of_the_statistics():
    denominator = lognormal(300, seed=30)
    ratio, (lo, hi) = ratio_ci(0.25 * denominator, denominator)
    assert ratio == pytest.approx(0.25)
    assert lo < 0.25 < hi


def test_paired_ratio_ci_keeps_what_the_two_sides_of_a_round_share():
    # the storage swings 1.3-3.5 GB/s between minutes; in each minute the tier reads at 70% of fio
    storage = np.array([1.3, 3.5, 2.0, 1.6, 3.1, 2.4, 1.4])
    tier = 0.7 * storage * np.array([1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01])
    ratio, (lo, hi) = ratio_ci(tier, storage, paired=True)
    assert ratio == pytest.approx(np.median(tier) / np.median(storage))
    assert 0.65 < lo <= ratio <= hi < 0.75
    _, (independent_lo, independent_hi) = ratio_ci(tier, storage)
    assert independent_lo < 0.5 and independent_hi > 0.9  # resampled apart, the swing swamps the ratio


def test_paired_ratio_ci_needs_one_denominator_per_numerator():
    with pytest.raises(ValueError, match="paired"):
        ratio_ci([1.0, 2.0, 3.0], [1.0, 2.0], paired=True)


def test_two_sample_ci_is_deterministic_for_a_seed():
    a, b = lognormal(100, seed=31), lognormal(100, seed=32)
    assert reduction_ci(a, b, seed=3) == reduction_ci(a, b, seed=3)


def test_two_single_values_give_a_point_interval():
    assert gain_ci([2.0], [3.0]) == (pytest.approx(0.5), (pytest.approx(0.5), pytest.approx(0.5)))


def test_zero_baseline_statistic_raises():
    with pytest.raises(ValueError, match="0"):
        reduction_ci([0.0, 0.0, 0.0], [1.0, 2.0])


def test_empty_sample_raises():
    with pytest.raises(ValueError):
        gain_ci([], [1.0])


# --- Mann-Kendall ----------------------------------------------------------------------------

def test_mann_kendall_matches_a_hand_computed_example():
    # pairs of [1, 3, 2, 4, 5]: nine rise, one falls (3 → 2): S = 9 - 1 = 8
    # Var(S) = n(n-1)(2n+5)/18 = 5*4*15/18; z = (S - 1)/sqrt(Var)
    # pairwise slopes sorted: -1, .5, .5, .667, 1, 1, 1, 1.5, 2, 2 → Sen slope 1
    result = mann_kendall([1, 3, 2, 4, 5])
    assert result["s"] == 8
    z = 7 / math.sqrt(5 * 4 * 15 / 18)
    assert result["z"] == pytest.approx(z)
    assert result["p_value"] == pytest.approx(math.erfc(z / math.sqrt(2)))
    assert result["sen_slope"] == pytest.approx(1.0)
    assert result["trend"] == "no trend"  # p ≈ 0.086: five points are not enough


def test_mann_kendall_corrects_the_variance_for_ties():
    # [1, 2, 2, 3]: five rising pairs, one tied: S = 5; one tie group of 2
    # Var = (4*3*13 - 2*1*9)/18
    result = mann_kendall([1, 2, 2, 3])
    assert result["s"] == 5
    assert result["z"] == pytest.approx(4 / math.sqrt((4 * 3 * 13 - 2 * 1 * 9) / 18))


def test_mann_kendall_sees_no_trend_in_a_flat_noisy_series():
    series = 100 + np.random.default_rng(40).normal(0, 5, size=200)
    result = mann_kendall(series)
    assert result["trend"] == "no trend"
    assert result["p_value"] > 0.05


def test_mann_kendall_sees_an_increasing_series_with_a_positive_sen_slope():
    index = np.arange(100)
    series = 50 + 0.2 * index + np.random.default_rng(41).normal(0, 2, size=100)
    result = mann_kendall(series)
    assert result["trend"] == "increasing"
    assert result["s"] > 0 and result["p_value"] < 0.05
    assert result["sen_slope"] == pytest.approx(0.2, abs=0.05)


def test_mann_kendall_sees_a_decreasing_series():
    index = np.arange(100)
    series = 50 - 0.2 * index + np.random.default_rng(42).normal(0, 2, size=100)
    result = mann_kendall(series)
    assert result["trend"] == "decreasing"
    assert result["sen_slope"] < 0


def test_mann_kendall_alpha_decides_the_trend():
    result = mann_kendall([1, 3, 2, 4, 5], alpha=0.10)
    assert result["trend"] == "increasing"


def test_mann_kendall_of_a_constant_series_has_no_trend():
    result = mann_kendall([3.0] * 10)
    assert (result["s"], result["z"], result["p_value"], result["trend"]) == (0, 0.0, 1.0, "no trend")
