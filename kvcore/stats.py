"""Statistics the verdicts rest on: percentiles, bootstrap intervals, Mann-Kendall trend, Sen slope interval.

Every figure is computed from raw samples (per-request records, per-window
figures), never from averaged percentiles. Bootstrap intervals are percentile
intervals, vectorised with numpy and deterministic for a given seed.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Optional, Sequence

import numpy as np

Statistic = Callable[..., np.ndarray]


def _sample(values: Sequence[float], name: str = "values") -> np.ndarray:
    """A 1-D float array of finite values; ValueError when empty or not finite."""
    array = np.asarray(values, dtype=float).ravel()
    if array.size == 0:
        raise ValueError(f"{name}: expected at least one value, found none")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name}: expected finite values, found NaN or infinity")
    return array


def _apply(statistic: Statistic, samples: np.ndarray) -> np.ndarray:
    """`statistic` over each row of a 2-D array (with `axis=1` when the callable takes it)."""
    try:
        result = np.asarray(statistic(samples, axis=1), dtype=float)
        if result.shape == (samples.shape[0],):
            return result
    except TypeError:
        pass
    return np.apply_along_axis(statistic, 1, samples).astype(float)


def _resample(rng: np.random.Generator, sample: np.ndarray, statistic: Statistic, resamples: int) -> np.ndarray:
    """The statistic of `resamples` bootstrap resamples of `sample` (indices drawn as one array)."""
    indices = rng.integers(0, sample.size, size=(resamples, sample.size))
    return _apply(statistic, sample[indices])


def _bounds(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a fraction in (0, 1), found {confidence}")
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0:
        return (math.nan, math.nan)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(finite, [100.0 * alpha, 100.0 * (1.0 - alpha)])
    return (float(lo), float(hi))


def percentile_interval(replicates: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates computed elsewhere (non-finite ones ignored; NaN: none)."""
    return _bounds(np.asarray(replicates, dtype=float), confidence)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of raw values, numpy's linear interpolation; ValueError when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q: expected a percentile in [0, 100], found {q}")
    return float(np.percentile(_sample(values), q))


def bootstrap_ci(values: Sequence[float], statistic: Statistic = np.median, confidence: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of `statistic(values)`; (value, value) for a single value."""
    sample = _sample(values)
    if sample.size < 2:
        value = float(_apply(statistic, sample[None, :])[0])
        return (value, value)
    rng = np.random.default_rng(seed)
    return _bounds(_resample(rng, sample, statistic, resamples), confidence)


def _two_sample(numerator: Sequence[float], denominator: Sequence[float], combine: Callable,
                statistic: Statistic, confidence: float, resamples: int, seed: int, paired: bool = False,
                ) -> tuple[float, tuple[float, float]]:
    """`combine(stat(num), stat(den))` and its bootstrap interval. The two samples are resampled
    independently, or, when `paired`, as pairs (num[i], den[i]): one index draw for both, so what
    the two sides of a pair share (the minute they ran in) stays together in every resample."""
    num = _sample(numerator, "numerator")
    den = _sample(denominator, "denominator")
    if paired and num.size != den.size:
        raise ValueError(f"denominator: expected one value per numerator value ({num.size}) for paired samples, "
                         f"found {den.size}")
    den_stat = float(_apply(statistic, den[None, :])[0])
    if den_stat == 0.0:
        raise ValueError("denominator: its statistic is 0, the ratio is undefined")
    point = float(combine(float(_apply(statistic, num[None, :])[0]), den_stat))
    if num.size < 2 and den.size < 2:
        return point, (point, point)
    rng = np.random.default_rng(seed)
    if paired:
        indices = rng.integers(0, num.size, size=(resamples, num.size))
        num_reps, den_reps = _apply(statistic, num[indices]), _apply(statistic, den[indices])
    else:
        num_reps = _resample(rng, num, statistic, resamples)
        den_reps = _resample(rng, den, statistic, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        replicates = combine(num_reps, den_reps)
    return point, _bounds(np.asarray(replicates, dtype=float), confidence)


def reduction_ci(baseline: Sequence[float], candidate: Sequence[float], statistic: Statistic = np.median,
                 confidence: float = 0.95, resamples: int = 2000, seed: int = 0,
                 ) -> tuple[float, tuple[float, float]]:
    """Relative reduction `1 - stat(candidate)/stat(baseline)` (0.31 = 31% lower, e.g. TTFT p50) and its interval."""
    return _two_sample(candidate, baseline, lambda c, b: 1.0 - c / b, statistic, confidence, resamples, seed)


def gain_ci(baseline: Sequence[float], candidate: Sequence[float], statistic: Statistic = np.median,
            confidence: float = 0.95, resamples: int = 2000, seed: int = 0,
            ) -> tuple[float, tuple[float, float]]:
    """Relative gain `stat(candidate)/stat(baseline) - 1` (0.35 = +35%, e.g. throughput per window) and its interval."""
    return _two_sample(candidate, baseline, lambda c, b: c / b - 1.0, statistic, confidence, resamples, seed)


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float], statistic: Statistic = np.median,
             confidence: float = 0.95, resamples: int = 2000, seed: int = 0, paired: bool = False,
             ) -> tuple[float, tuple[float, float]]:
    """Ratio `stat(numerator)/stat(denominator)` (e.g. disk-hit TTFT / recompute TTFT) and its interval;
    `paired` for rounds measured side by side (numerator[i] beside denominator[i], e.g. tier vs fio)."""
    return _two_sample(numerator, denominator, lambda n, d: n / d, statistic, confidence, resamples, seed, paired)


def _series(values: Sequence[float], positions: Optional[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """The values and their strictly increasing positions (0, 1, 2, ... when none are given)."""
    y = _sample(values)
    if positions is None:
        return y, np.arange(y.size, dtype=float)
    x = np.asarray(positions, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"positions: expected one per value ({y.size}), found {x.size}")
    if not np.all(np.isfinite(x)) or np.any(np.diff(x) <= 0):
        raise ValueError("positions: expected finite, strictly increasing positions")
    return y, x


def _pairs(y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Differences and slopes of every pair i < j: y[j] - y[i] and (y[j] - y[i]) / (x[j] - x[i])."""
    i, j = np.triu_indices(y.size, k=1)
    diffs = y[j] - y[i]
    return diffs, diffs / (x[j] - x[i])


def _s_variance(y: np.ndarray) -> float:
    """Var(S) of the Mann-Kendall statistic under no trend, corrected for ties."""
    n = y.size
    _, ties = np.unique(y, return_counts=True)
    return (n * (n - 1) * (2 * n + 5) - float(np.sum(ties * (ties - 1) * (2 * ties + 5)))) / 18.0


def mann_kendall(values: Sequence[float], alpha: float = 0.05,
                 positions: Optional[Sequence[float]] = None) -> dict:
    """Mann-Kendall trend test on an ordered series (e.g. windowed p99 TTFT, server memory).

    Returns {"s", "z", "p_value", "trend", "sen_slope"}: S = sum over i<j of sign(x_j - x_i);
    z from the normal approximation with the tie-corrected variance and continuity correction;
    a two-sided p-value; "increasing" / "decreasing" when p < alpha, else "no trend"; and the
    Theil-Sen slope (median of pairwise slopes, per step of position). `positions` place the
    values (e.g. window indices with gaps where windows were left out); S depends only on the
    order, the slope on the positions.
    """
    y, x = _series(values, positions)
    if y.size < 2:
        return {"s": 0, "z": 0.0, "p_value": 1.0, "trend": "no trend", "sen_slope": 0.0}
    diffs, slopes = _pairs(y, x)
    s = int(np.sign(diffs).sum())
    variance = _s_variance(y)
    if variance <= 0.0 or s == 0:
        z = 0.0
    else:
        z = (s - 1 if s > 0 else s + 1) / math.sqrt(variance)
    p_value = math.erfc(abs(z) / math.sqrt(2.0))
    trend = "no trend" if p_value >= alpha else ("increasing" if z > 0 else "decreasing")
    return {"s": s, "z": float(z), "p_value": float(p_value), "trend": trend, "sen_slope": float(np.median(slopes))}


def sen_slope_ci(values: Sequence[float], positions: Optional[Sequence[float]] = None,
                 confidence: float = 0.95) -> tuple[float, tuple[float, float]]:
    """The Theil-Sen slope and its distribution-free confidence interval.

    Hollander & Wolfe (1973), as in Gilbert (1987) §16.5 and R's `trend::sens.slope`: with the
    N pairwise slopes sorted and C = z_(1-a/2) * sqrt(Var S) (Var S the Mann-Kendall variance,
    tie-corrected), the interval runs from the round((N - C) / 2)-th to the
    round((N + C) / 2 + 1)-th slope (1-based, clamped to 1..N). Few values give a wide interval:
    the span of all pairwise slopes at 4 values.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a fraction in (0, 1), found {confidence}")
    y, x = _series(values, positions)
    if y.size < 2:
        return 0.0, (0.0, 0.0)
    slopes = np.sort(_pairs(y, x)[1])
    count = slopes.size
    c = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0) * math.sqrt(max(_s_variance(y), 0.0))
    lower = min(max(round((count - c) / 2.0), 1), count)
    upper = min(max(round((count + c) / 2.0 + 1.0), 1), count)
    return float(np.median(slopes)), (float(slopes[lower - 1]), float(slopes[upper - 1]))
