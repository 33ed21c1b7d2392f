"""Whether a load meets an SLO, decided from its requests while it runs: a binomial confidence sequence.

How it works: docs/methods/confidence-sequence.md (kvcore/attainment.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_STRENGTH = 5.0      # a + b of the mixture's Beta prior (its mean: allowed / 2)

MEETS, MISSES, UNDECIDED = "meets", "misses", "undecided"


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


@dataclass(frozen=True)
class MissShare:
    """The requests of one load so far: how many, how many missed; the share allowed and the confidence."""

    requests: int
    misses: int
    allowed: float                 # the share of requests that may miss (1 - the percentile: 0.10 for p90)
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not 0 <= self.misses <= self.requests:
            raise ValueError(f"misses: expected 0..{self.requests} (the requests), found {self.misses}")
        if not 0 < self.allowed < 1:
            raise ValueError(f"allowed: expected a share in (0, 1), found {self.allowed}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: expected a level in (0, 1), found {self.confidence}")

    @property
    def prior(self) -> tuple[float, float]:
        a = PRIOR_STRENGTH * self.allowed / 2
        return a, PRIOR_STRENGTH - a

    @property
    def share(self) -> float:
        return self.misses / self.requests if self.requests else math.nan

    def log_evidence(self, p: float) -> float:
        """log M_n(p): the mixture's log likelihood ratio against a miss share of p."""
        a, b = self.prior
        s, f = self.misses, self.requests - self.misses
        mixture = _log_beta(a + s, b + f) - _log_beta(a, b)
        if p <= 0:
            return math.inf if s else mixture
        if p >= 1:
            return math.inf if f else mixture
        return mixture - s * math.log(p) - f * math.log1p(-p)

    def excludes(self, p: float) -> bool:
        return self.log_evidence(p) >= math.log(1 / (1 - self.confidence))

    def decision(self) -> str:
        """MEETS (the share lies below `allowed` at the confidence), MISSES (above it) or UNDECIDED."""
        if not self.requests or not self.excludes(self.allowed):
            return UNDECIDED
        return MEETS if self.share < self.allowed else MISSES

    def interval(self) -> tuple[float, float]:
        """The confidence sequence at this n: the shares p the mixture does not exclude (bisection to 1e-6)."""
        centre = self.share if self.requests else self.prior[0] / PRIOR_STRENGTH
        return self._edge(centre, 0.0), self._edge(centre, 1.0)

    def _edge(self, inside: float, outside: float) -> float:
        if not self.excludes(outside):
            return outside
        for _ in range(60):
            middle = (inside + outside) / 2
            if self.excludes(middle):
                outside = middle
            else:
                inside = middle
            if abs(outside - inside) < 1e-6:
                break
        return inside


def requests_to_decide_when_all_meet(allowed: float, confidence: float = 0.95, most: int = 100_000) -> int:
    """The fewest requests, none missing, that decide MEETS: a probe's least sample at a healthy load."""
    for n in range(1, most + 1):
        if MissShare(n, 0, allowed, confidence).decision() == MEETS:
            return n
    raise ValueError(f"no sample up to {most} requests decides a {allowed:.0%} allowance")
