"""Statistics: percentiles, bootstrap intervals of one and two samples, Mann-Kendall trend, Sen slope interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcore.stats import bootstrap_ci, gain_ci, mann_kendall, percentile, ratio_ci, reduction_ci, sen_slope_ci


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
    def p90(xs):  # no axis argument
        return float(np.percentile(xs, 90))

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


def test_mann_kendall_slope_follows_the_positions_and_s_only_the_order():
    # windows 2 and 3 left out: the same values at positions 0, 1, 4, 5 rise half as fast per step
    values = [10.0, 11.0, 14.0, 15.0]
    spaced = mann_kendall(values, positions=[0, 1, 4, 5])
    assert spaced["s"] == mann_kendall(values)["s"] == 6
    assert spaced["sen_slope"] == pytest.approx(1.0)   # pairwise slopes 1, 1, 1, 1, 1, 1
    # at 0, 1, 2, 3 the slopes are 1, 1, 5/3, 2, 2, 3: median 11/6
    assert mann_kendall(values)["sen_slope"] == pytest.approx(11 / 6)


def test_positions_must_match_the_values_and_increase():
    with pytest.raises(ValueError, match="one per value"):
        mann_kendall([1, 2, 3], positions=[0, 1])
    with pytest.raises(ValueError, match="increasing"):
        sen_slope_ci([1, 2, 3], positions=[0, 2, 2])


# --- Sen slope interval ----------------------------------------------------------------------

def test_sen_slope_ci_matches_a_hand_computed_example():
    # [1, 3, 2, 4, 5]: N = 10 slopes sorted -1, .5, .5, .667, 1, 1, 1, 1.5, 2, 2; sqrt(Var S) = sqrt(50/3)
    # 95%: C = 1.96 * 4.08 = 8.0 → ranks round(1.0) = 1 and round(10.0) = 10 → [-1, 2]
    # 90%: C = 1.645 * 4.08 = 6.72 → ranks round(1.64) = 2 and round(9.36) = 9 → [0.5, 2]
    assert sen_slope_ci([1, 3, 2, 4, 5]) == (pytest.approx(1.0), (pytest.approx(-1.0), pytest.approx(2.0)))
    assert sen_slope_ci([1, 3, 2, 4, 5], confidence=0.90)[1] == (pytest.approx(0.5), pytest.approx(2.0))


def test_sen_slope_ci_agrees_with_the_mann_kendall_test_on_a_short_series():
    # the interval excludes 0 when the test at alpha = 1 - confidence sees a trend, and only then
    series = [1, 3, 2, 4, 5]
    assert mann_kendall(series, alpha=0.10)["trend"] == "increasing" and sen_slope_ci(series, confidence=0.90)[1][0] > 0
    assert mann_kendall(series, alpha=0.05)["trend"] == "no trend" and sen_slope_ci(series, confidence=0.95)[1][0] < 0


def test_sen_slope_ci_matches_scipy_theilslopes():
    # reference figures from scipy.stats.theilslopes(y, x, 0.95) (scipy 1.x), with and without gaps
    y = [12.1, 11.4, 12.9, 12.2, 13.5, 12.8, 13.9, 13.1, 14.6, 13.7]
    slope, (lo, hi) = sen_slope_ci(y)
    assert (slope, lo, hi) == (pytest.approx(0.283333333), pytest.approx(0.114285714), pytest.approx(0.4))
    slope, (lo, hi) = sen_slope_ci(y, positions=[0, 1, 2, 4, 5, 6, 8, 9, 10, 11])
    assert (slope, lo, hi) == (pytest.approx(0.2125), pytest.approx(0.088888889), pytest.approx(0.35))


def test_sen_slope_ci_narrows_with_more_windows_and_covers_the_true_slope():
    rng = np.random.default_rng(43)
    short = 100 + 0.01 * np.arange(20) + rng.normal(0, 1, size=20)
    long = 100 + 0.01 * np.arange(2000) + rng.normal(0, 1, size=2000)
    _, (s_lo, s_hi) = sen_slope_ci(short)
    slope, (l_lo, l_hi) = sen_slope_ci(long)
    assert l_lo < 0.01 < l_hi and slope == pytest.approx(0.01, abs=0.002)
    assert (l_hi - l_lo) < (s_hi - s_lo) / 50


def test_sen_slope_ci_of_four_values_spans_every_pairwise_slope():
    # n = 4: slopes -2, -.5, .5, .667, 1, 3; C = 1.96 * sqrt(26/3) = 5.8 → ranks round(0.1) and round(6.9)
    # clamp to 1 and 6, the ends
    assert sen_slope_ci([0, 3, 1, 2]) == (pytest.approx(7 / 12), (pytest.approx(-2.0), pytest.approx(3.0)))


def test_sen_slope_ci_rejects_a_confidence_outside_0_to_1():
    with pytest.raises(ValueError, match="confidence"):
        sen_slope_ci([1, 2, 3], confidence=1.0)
