"""Anytime-valid intervals over paired rounds or blocks, and sampling until one decides.

A side-by-side figure (the tier against fio, the candidate against the baseline) is measured in
rounds or blocks: each yields one paired ratio, subject over yardstick, measured in the same
minute. The verdict's interval comes from the variation *between* those pairs, so drift between
minutes is inside it, and it is a confidence sequence: valid at every number of pairs at once, so
a gate may look after every pair and stop as soon as the interval clears the rule without
inflating its error rate (a fixed-n interval looked at after every pair is not).

The sequence is Lai's (1976) t confidence sequence for the mean of Gaussian observations with
unknown variance: the scale-invariant likelihood ratio mixed over a N(0, tau^2) prior on the
standardized effect (Lai, "On confidence sequences", Ann. Statist. 4(2), 1976; derived and
studied as an anytime-valid t-test by Wang & Ramdas, "Anytime-valid t-tests and confidence
sequences for Gaussian means with unknown variance", 2023). For n observations with mean m and
sum of squared deviations S, the mixture martingale at a candidate mean mu is

    M_n(mu) = (1 + n tau^2)^(-1/2) * (1 - tau^2 T / ((1 + n tau^2) Q))^(-n/2),
    T = (sum (x_i - mu))^2,  Q = sum (x_i - mu)^2,

and {mu : M_n(mu) < 1/alpha} is, solved in closed form, m +- sqrt(R S / (n (n - R))) with
R = (1 + n tau^2) / tau^2 * (1 - (alpha^2 / (1 + n tau^2))^(1/n)) (the whole line while R >= n).
By Ville's inequality it misses the mean at any n with probability <= alpha. Ratios are judged in
log space (the log of a ratio of medians is near Gaussian and its sign is symmetric), so the
figure is the geometric mean of the pairs' ratios and the interval's ends are exp of the
sequence's ends. tau^2 = 10 keeps the sequence finite from 3 pairs (about 3x a fixed-n t interval
at 3 pairs, 2x at 6, 1.8x at 30): the price of stopping when decided.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from kvcore.rules import Rule

TAU2 = 10.0                 # the mixture's prior variance of the standardized effect (see the module's docstring)
MIN_PAIRS_FOR_AN_INTERVAL = 3
METHOD = ("Lai's t confidence sequence (anytime-valid, 95%) over the pairs' log ratios: "
          "the interval holds at every number of pairs, so sampling stopped when it decided")


def t_confidence_sequence(values: Sequence[float], confidence: float = 0.95,
                          tau2: float = TAU2) -> tuple[float, tuple[float, float]]:
    """The mean of `values` and Lai's anytime-valid t confidence sequence at this n (infinite ends: no bound yet)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a fraction in (0, 1), found {confidence}")
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        raise ValueError("values: expected at least one value, found none")
    if not np.all(np.isfinite(x)):
        raise ValueError("values: expected finite values, found NaN or infinity")
    n, mean = x.size, float(x.mean())
    alpha = 1.0 - confidence
    r = (1.0 + n * tau2) / tau2 * (1.0 - (alpha * alpha / (1.0 + n * tau2)) ** (1.0 / n))
    if r >= n:
        return mean, (-math.inf, math.inf)
    spread = float(np.sum((x - mean) ** 2))
    half = math.sqrt(r * spread / (n * (n - r)))
    return mean, (mean - half, mean + half)


def log_ratio_sequence(numerators: Sequence[float], denominators: Sequence[float],
                       confidence: float = 0.95) -> tuple[float, tuple[float, float]]:
    """The geometric mean of numerators[i] / denominators[i] and its anytime-valid interval (pairs side by side)."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.shape != den.shape:
        raise ValueError(f"denominators: expected one per numerator ({num.size}), found {den.size}")
    if num.size == 0 or np.any(num <= 0) or np.any(den <= 0) or not np.all(np.isfinite(num / den)):
        raise ValueError("expected positive, finite figures on both sides of every pair")
    mean, (lo, hi) = t_confidence_sequence(np.log(num / den), confidence)
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
                         rules: Sequence[Rule | dict], minimum: int, maximum: int, budget_s: float,
                         clock: Callable[[], float] = time.monotonic) -> Stopping:
    """Call `take_one(i)` for i = 0, 1, ... until, after at least `minimum` pairs, `interval_now()` decides every
    rule, or `maximum` pairs are taken, or `budget_s` seconds have passed (no pair is started after that).

    `interval_now()` gives one interval that every rule judges, or a list of them, one per rule in `rules`'
    order (several figures measured by the same pairs: G3's TTFT and throughput). `rules` empty: exactly
    `minimum` pairs (nothing to decide). The interval is anytime-valid, so looking after every pair does
    not inflate the error rate."""
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
