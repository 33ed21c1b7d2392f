"""The intervals G2's pairs and G3's blocks are judged with (repeated confidence intervals over a schedule fixed in
advance, Lai's confidence sequence without one), and the sampling loop that stops when it decides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcore.rules import Band, Threshold
from kvcore.sequential import (
    METHOD,
    TAU2,
    Looks,
    boundary_of,
    decides,
    lai_factor,
    log_ratio_sequence,
    method,
    sample_until_decided,
    t_confidence_sequence,
)


def _martingale(values, mu, tau2=TAU2):
    """Lai's mixture martingale at a candidate mean, computed from its definition (not the closed form)."""
    y = np.asarray(values, dtype=float) - mu
    n, t, q = y.size, y.sum() ** 2, np.sum(y ** 2)
    return (1 + n * tau2) ** -0.5 * (1 - tau2 * t / ((1 + n * tau2) * q)) ** (-n / 2)


def test_the_interval_ends_are_where_the_martingale_reaches_one_over_alpha():
    values = [0.3, 0.1, 0.25, 0.4, 0.2, 0.35]
    _, (lo, hi) = t_confidence_sequence(values)
    assert math.isclose(_martingale(values, lo), 20.0, rel_tol=1e-6)
    assert math.isclose(_martingale(values, hi), 20.0, rel_tol=1e-6)
    assert _martingale(values, (lo + hi) / 2) < 20.0


def test_one_or_two_values_bound_nothing_and_three_do():
    assert t_confidence_sequence([1.0])[1] == (-math.inf, math.inf)
    assert t_confidence_sequence([1.0, 1.2])[1] == (-math.inf, math.inf)
    lo, hi = t_confidence_sequence([1.0, 1.1, 1.2])[1]
    assert math.isfinite(lo) and math.isfinite(hi) and lo < 1.1 < hi


def test_looking_after_every_value_misses_the_mean_at_most_alpha_of_the_time():
    """Ville's inequality: over 1,000 null sequences of 40 values, each looked at after every value from the
    third on, the share that ever excluded the true mean stays within 5% (a fixed-n t interval looked at
    this way misses far more often)."""
    rng = np.random.default_rng(7)
    data = rng.normal(2.0, 3.0, size=(1000, 40))
    ever_missed, fixed_missed = 0, 0
    from scipy import stats
    for row in data:
        missed = fixed = False
        for n in range(3, 41):
            lo, hi = t_confidence_sequence(row[:n])[1]
            missed |= not lo <= 2.0 <= hi
            half = stats.t.ppf(0.975, n - 1) * row[:n].std(ddof=1) / math.sqrt(n)
            fixed |= abs(row[:n].mean() - 2.0) > half
        ever_missed += missed
        fixed_missed += fixed
    assert ever_missed / 1000 <= 0.05
    assert fixed_missed / 1000 > 0.15      # why the fixed-n interval is not used when sampling stops on a decision


def test_a_ratio_sequence_is_the_geometric_mean_with_exp_ends():
    ratio, (lo, hi) = log_ratio_sequence([2.0, 2.2, 1.8, 2.1], [1.0, 1.0, 1.0, 1.0])
    assert math.isclose(ratio, math.exp(np.mean(np.log([2.0, 2.2, 1.8, 2.1]))))
    assert lo < ratio < hi
    with pytest.raises(ValueError, match="positive"):
        log_ratio_sequence([1.0, -1.0, 1.0], [1.0, 1.0, 1.0])


def _ever_missed(rows, mu: float, looks: Looks) -> tuple[float, float]:
    """The share of `rows` whose interval over `looks` ever excluded `mu` when looked at after every value from the
    3rd to the last, and the same share for a fixed-n 95% t interval looked at the same way."""
    from scipy import stats
    quantile = {n: stats.t.ppf(0.975, n - 1) for n in looks.counts}
    ever, fixed = 0, 0
    for row in rows:
        missed = fixed_missed = False
        for n in looks.counts:
            lo, hi = t_confidence_sequence(row[:n], looks=looks)[1]
            missed |= not lo <= mu <= hi
            fixed_missed |= abs(row[:n].mean() - mu) > quantile[n] * row[:n].std(ddof=1) / math.sqrt(n)
        ever += missed
        fixed += fixed_missed
    return ever / len(rows), fixed / len(rows)


@pytest.mark.parametrize("last", [5, 8, 16])
def test_repeated_intervals_looked_at_every_look_miss_the_mean_at_most_alpha_of_the_time(last):
    """Over 4,000 Gaussian null sequences (a seed other than the calibration's), each looked at after every n from
    3 to `last`, the share that ever excluded the true mean is within 5% + 3 standard errors; a fixed-n t interval
    looked at the same way misses far more often."""
    rows = np.random.default_rng(2024 + last).normal(2.0, 3.0, size=(4000, last))
    ever, fixed = _ever_missed(rows, 2.0, Looks(last))
    assert ever <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(rows)), ever
    assert fixed > 0.08 and fixed > 1.6 * ever, (fixed, ever)        # 3 looks: ~10%; 14 looks: ~20%


def test_heavy_tailed_log_ratios_stay_near_alpha():
    """A robustness check, not a guarantee: the calibration assumes Gaussian log ratios; with t-distributed ones
    (5 degrees of freedom) over 3..8 looks the share of sequences that ever excluded the mean stays <= 6%."""
    rows = 0.5 + 0.2 * np.random.default_rng(5).standard_t(5, size=(4000, 8))
    ever, _ = _ever_missed(rows, 0.5, Looks(8))
    assert ever <= 0.06, ever


@pytest.mark.parametrize("last, shape", [(5, "constant"), (8, "constant"), (16, "lai"), (40, "lai")])
def test_each_schedule_takes_the_shape_whose_half_widths_sum_the_least(last, shape):
    chosen = boundary_of(Looks(last))
    assert chosen.shape == shape
    other = boundary_of(Looks(last), shape="lai" if shape == "constant" else "constant")
    assert sum(chosen.factors) <= sum(other.factors)
    assert all(chosen.factor(n) < lai_factor(n) for n in range(3, 6))    # narrower than Lai's where G3 decides
    described = method(Looks(last))
    assert f"3..{last} pairs fixed in advance" in described and ("Pocock" in described) == (shape == "constant")


def test_three_pairs_of_five_are_at_least_twice_narrower_than_lais():
    values = [0.3, 0.1, 0.25]
    _, (lo, hi) = t_confidence_sequence(values, looks=Looks(5))
    _, (lai_lo, lai_hi) = t_confidence_sequence(values)
    assert 2 * (hi - lo) <= lai_hi - lai_lo
    assert math.isclose((hi - lo) / 2, boundary_of(Looks(5)).factor(3) * np.std(values, ddof=1))
    assert t_confidence_sequence([1.0, 1.2], looks=Looks(5))[1] == (-math.inf, math.inf)
    assert method(None) == METHOD and "Lai" in METHOD


def test_values_beyond_the_schedule_are_refused():
    with pytest.raises(ValueError, match=r"beyond the schedule's last look \(5 pairs"):
        t_confidence_sequence([0.1, 0.2, 0.3, 0.2, 0.1, 0.3], looks=Looks(5))
    with pytest.raises(ValueError, match="last"):
        Looks(2)


def test_a_ratio_sequence_over_a_schedule_has_exp_ends():
    ratios = [2.0, 2.2, 1.8, 2.1]
    ratio, (lo, hi) = log_ratio_sequence(ratios, [1.0] * 4, looks=Looks(8))
    mean, (log_lo, log_hi) = t_confidence_sequence(np.log(ratios), looks=Looks(8))
    assert math.isclose(ratio, math.exp(mean))
    assert math.isclose(lo, math.exp(log_lo)) and math.isclose(hi, math.exp(log_hi))
    assert lo < ratio < hi and (hi - lo) < np.subtract(*log_ratio_sequence(ratios, [1.0] * 4)[1][::-1])


def test_an_interval_decides_a_threshold_only_wholly_on_one_side_and_a_band_by_its_minimum():
    rule = Threshold("ttft_p50_reduction", ">=", 0.25)
    assert decides(rule, (0.3, 0.5)) and decides(rule, (0.0, 0.2))
    assert not decides(rule, (0.2, 0.3)) and not decides(rule, None)
    band = Band("throughput_gain", 0.29, 0.40)
    assert decides(band, (0.5, 3.0)) and decides(band, (0.0, 0.1)) and decides(band, (0.3, 0.45))
    assert not decides(band, (0.2, 0.35))


def test_sampling_stops_when_decided_at_the_most_allowed_or_when_the_budget_is_spent():
    rule = Threshold("x", ">=", 0.8)
    values = []
    now = [0.0]

    def take(i):
        values.append(0.5 + 0.01 * (i % 2))
        now[0] += 10.0

    def interval():
        ratio, bounds = log_ratio_sequence(values, [1.0] * len(values)) if len(values) >= 2 else (None, None)
        return bounds

    stop = sample_until_decided(take, interval, [rule], minimum=3, maximum=20, budget_s=1e9, clock=lambda: now[0])
    assert stop.decided and stop.pairs == 3 and stop.why == "decided after 3 pairs"
    values.clear()
    def straddling():
        return 0.7, 0.9

    stop = sample_until_decided(take, straddling, [rule], minimum=3, maximum=5, budget_s=1e9, clock=lambda: now[0])
    assert not stop.decided and stop.pairs == 5 and "most allowed" in stop.why
    stop = sample_until_decided(take, straddling, [rule], minimum=3, maximum=50, budget_s=35, clock=lambda: now[0])
    assert not stop.decided and stop.pairs == 4 and "time budget" in stop.why
    stop = sample_until_decided(take, straddling, [], minimum=3, maximum=50, budget_s=35)
    assert stop.pairs == 3 and not stop.decided
