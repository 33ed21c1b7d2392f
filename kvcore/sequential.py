"""Intervals over paired rounds or blocks that stay valid while sampling stops on a decision.

How it works: docs/methods/confidence-sequence.md (kvcore/sequential.py).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from kvcore.rules import Rule

TAU2 = 10.0  # Lai's mixture's prior variance of the standardized effect (docs/methods/confidence-sequence.md)
MIN_PAIRS_FOR_AN_INTERVAL = 3
SHAPES = ("constant", "lai")  # the boundary shapes a schedule chooses between (see `boundary`)
CALIBRATION_PATHS = 200_000   # simulated null paths per schedule: lam's Monte Carlo error is ~0.5%
CALIBRATION_SEED = 1989


@dataclass(frozen=True)
class Looks:
    """A schedule fixed before any data: a look after every pair from MIN_PAIRS_FOR_AN_INTERVAL (always, so a pair
    left out as invalid cannot put a look outside the schedule) to `last`, the most pairs the measurement may take."""

    last: int

    def __post_init__(self) -> None:
        if isinstance(self.last, bool) or not isinstance(self.last, int) or self.last < MIN_PAIRS_FOR_AN_INTERVAL:
            raise ValueError(f"last: expected an integer >= {MIN_PAIRS_FOR_AN_INTERVAL} (the first look), "
                             f"found {self.last!r}")

    @property
    def first(self) -> int:
        return MIN_PAIRS_FOR_AN_INTERVAL

    @property
    def counts(self) -> range:
        """The numbers of pairs looked at."""
        return range(self.first, self.last + 1)


def lai_factor(n: int, confidence: float = 0.95, tau2: float = TAU2) -> float:
    """Lai's t confidence sequence's half-width at n values, over their sample SD (infinite: no bound yet)."""
    alpha = 1.0 - confidence
    r = (1.0 + n * tau2) / tau2 * (1.0 - (alpha * alpha / (1.0 + n * tau2)) ** (1.0 / n))
    return math.inf if r >= n else math.sqrt(r * (n - 1) / (n * (n - r)))


def _shape(name: str, counts: range, confidence: float) -> np.ndarray:
    """shape(n) over the looks: the boundary on |t_n| is lam * shape(n)."""
    if name == "constant":
        return np.ones(len(counts))
    if name == "lai":
        return np.array([math.sqrt(n) * lai_factor(n, confidence) for n in counts])
    raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, found {name!r}")


@functools.lru_cache(maxsize=64)
def calibrated(last: int, confidence: float, shape: str) -> float:
    """lam: the `confidence` quantile of max over the looks 3..`last` of |T_n| / shape(n), T_n the t statistic of a
    Gaussian null path, by simulation (CALIBRATION_PATHS paths, a fixed seed, in chunks)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a fraction in (0, 1), found {confidence}")
    counts = Looks(last).counts
    scale = _shape(shape, counts, confidence)
    n = np.arange(1, last + 1, dtype=float)[counts.start - 1:]
    rng = np.random.default_rng(CALIBRATION_SEED)
    chunk = max(1, 2_000_000 // last)
    maxima = []
    for done in range(0, CALIBRATION_PATHS, chunk):
        x = rng.standard_normal((min(chunk, CALIBRATION_PATHS - done), last))
        total, squares = np.cumsum(x, axis=1)[:, counts.start - 1:], np.cumsum(x * x, axis=1)[:, counts.start - 1:]
        mean = total / n
        sd = np.sqrt((squares - n * mean * mean) / (n - 1))
        maxima.append(np.max(np.abs(mean) * np.sqrt(n) / sd / scale, axis=1))
    return float(np.quantile(np.concatenate(maxima), confidence))


@dataclass(frozen=True)
class Boundary:
    """A schedule's boundary: |t_n| <= lam * shape(n) at each look; the interval's half-width at n is factor(n) * s."""

    looks: Looks
    confidence: float
    shape: str
    lam: float
    factors: tuple[float, ...]       # lam * shape(n) / sqrt(n) at n = 3 .. last

    def factor(self, n: int) -> float:
        if not self.looks.first <= n <= self.looks.last:
            raise ValueError(f"n: expected a look of {self.looks.first}..{self.looks.last}, found {n}")
        return self.factors[n - self.looks.first]


def boundary_of(looks: Looks, confidence: float = 0.95, shape: Optional[str] = None) -> Boundary:
    """The boundary of `shape`, or (None) of the shape whose half-width factors sum the least over the looks (a
    choice made from the schedule alone, before any data; Pocock's constant on a tie)."""
    candidates = []
    for name in ((shape,) if shape else SHAPES):
        lam = calibrated(looks.last, confidence, name)
        factors = lam * _shape(name, looks.counts, confidence) / np.sqrt(np.array(looks.counts, dtype=float))
        candidates.append(Boundary(looks, confidence, name, lam, tuple(float(f) for f in factors)))
    return min(candidates, key=lambda b: sum(b.factors))


def method(looks: Optional[Looks], confidence: float = 0.95) -> str:
    """The one line recorded with each interval: how it was computed and why it holds where sampling stopped."""
    level = f"{confidence:.0%}"
    if looks is None:
        return (f"Lai's t confidence sequence (anytime-valid, {level}) over the pairs' log ratios: "
                "the interval holds at every number of pairs, so sampling stopped when it decided")
    chosen = boundary_of(looks, confidence)
    how = (f"Pocock's constant t boundary {chosen.lam:.2f}" if chosen.shape == "constant" else
           f"Lai's t boundary shape scaled by {chosen.lam:.2f} to these looks")
    return (f"repeated {level} confidence intervals of a group-sequential design, looks at "
            f"{looks.first}..{looks.last} pairs fixed in advance, {how} (calibrated by simulation; Jennison & "
            "Turnbull 1989): valid at every look, so sampling stopped when it decided")


METHOD = method(None)


def t_confidence_sequence(values: Sequence[float], confidence: float = 0.95, tau2: float = TAU2,
                          looks: Optional[Looks] = None) -> tuple[float, tuple[float, float]]:
    """The mean of `values` and its interval at this n, valid at every look: the repeated confidence interval of
    `looks`' schedule, or (None) Lai's t confidence sequence (`tau2`). Infinite ends: no bound yet (n < 3)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a fraction in (0, 1), found {confidence}")
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        raise ValueError("values: expected at least one value, found none")
    if not np.all(np.isfinite(x)):
        raise ValueError("values: expected finite values, found NaN or infinity")
    n, mean = x.size, float(x.mean())
    if looks is not None:
        if n > looks.last:
            raise ValueError(f"values: {n} pairs, beyond the schedule's last look ({looks.last} pairs, fixed in "
                             "advance): the interval holds only at the looks it was calibrated for")
        if n < looks.first:
            return mean, (-math.inf, math.inf)
        half = boundary_of(looks, confidence).factor(n) * float(np.std(x, ddof=1))
        return mean, (mean - half, mean + half)
    factor = lai_factor(n, confidence, tau2)
    if not math.isfinite(factor):
        return mean, (-math.inf, math.inf)
    half = factor * float(np.std(x, ddof=1))
    return mean, (mean - half, mean + half)


def log_ratio_sequence(numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95,
                       looks: Optional[Looks] = None) -> tuple[float, tuple[float, float]]:
    """The geometric mean of numerators[i] / denominators[i] and its interval, valid at every look
    (`t_confidence_sequence` over the log ratios, exp of its ends)."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.shape != den.shape:
        raise ValueError(f"denominators: expected one per numerator ({num.size}), found {den.size}")
    if num.size == 0 or np.any(num <= 0) or np.any(den <= 0) or not np.all(np.isfinite(num / den)):
        raise ValueError("expected positive, finite figures on both sides of every pair")
    mean, (lo, hi) = t_confidence_sequence(np.log(num / den), confidence, looks=looks)
    return math.exp(mean), (math.exp(lo) if math.isfinite(lo) else 0.0, math.exp(hi) if math.isfinite(hi) else math.inf)


def decides(rule: Rule, interval: Optional[tuple[float, float]]) -> bool:
    """Whether an interval already gives a verdict under `rule`: it lies wholly on one side of the edge that
    decides (a threshold's value, a band's minimum; above a band's maximum still passes)."""
    if interval is None:
        return False
    return not rule.straddles(*interval)


@dataclass(frozen=True)
class Stopping:
    """How many pairs (or blocks) a sequential measurement took, and why it stopped."""

    pairs: int
    decided: bool
    why: str

    def to_dict(self) -> dict:
        return {"pairs": self.pairs, "decided": self.decided, "why": self.why}


Intervals = Optional[tuple[float, float]] | list[Optional[tuple[float, float]]]


def sample_until_decided(take_one: Callable[[int], None], interval_now: Callable[[], Intervals],
                         rules: Sequence[Rule], minimum: int, maximum: int, budget_s: float,
                         clock: Callable[[], float] = time.monotonic) -> Stopping:
    """Call `take_one(i)` for i = 0, 1, ... until, after at least `minimum` pairs, `interval_now()` decides every
    rule, or `maximum` pairs are taken, or `budget_s` seconds have passed (no pair is started after that).

    `interval_now()` gives one interval that every rule judges, or a list of them, one per rule in `rules`'
    order (several figures measured by the same pairs: G3's TTFT and throughput). `rules` empty: exactly
    `minimum` pairs (nothing to decide). The interval holds at every look (`t_confidence_sequence`: over a
    schedule, its looks must run to `maximum`), so looking after every pair does not inflate the error rate."""
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"expected 1 <= minimum <= maximum, found minimum={minimum} maximum={maximum}")
    started, taken = clock(), 0
    while True:
        take_one(taken)
        taken += 1
        if taken < minimum:
            continue
        if not rules:
            return Stopping(taken, False, f"{taken} pairs (no rule to decide)")
        found = interval_now()
        intervals = found if isinstance(found, list) else [found] * len(rules)
        if len(intervals) != len(rules):
            raise ValueError(f"interval_now: expected one interval per rule ({len(rules)}), found {len(intervals)}")
        if all(decides(rule, interval) for rule, interval in zip(rules, intervals)):
            return Stopping(taken, True, f"decided after {taken} pairs")
        if taken >= maximum:
            return Stopping(taken, False, f"not decided after {taken} pairs (the most allowed)")
        spent = clock() - started
        if spent >= budget_s:
            return Stopping(taken, False, f"not decided after {taken} pairs: the time budget "
                                          f"({budget_s:g} s) was spent ({spent:.0f} s)")
