"""A capacity search: the highest load at which a target meets its SLO, bracketed by decided probes.

How it works: docs/methods/confidence-sequence.md (kvcore/capacity.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .attainment import MEETS, MISSES, UNDECIDED


@dataclass(frozen=True)
class LoadKind:
    """What a search's load is: the capacity's measurement, its unit, and the loop it runs."""

    metric: str
    unit: str
    loop: str

    @property
    def axis(self) -> str:
        """'users (closed loop)'."""
        return f"{self.unit} ({self.loop} loop)"


USERS = LoadKind("capacity_users", "users", "closed")
RATE = LoadKind("capacity_rate", "x the trace's rate", "open")   # a multiple of a trace's arrival rate
LOAD_KINDS = (USERS, RATE)


def load_kind(replay: str) -> LoadKind:
    """The load G3's replay searches: users closed loop, a rate multiple for `rate_multipliers`."""
    return USERS if replay == "closed_loop" else RATE


@dataclass(frozen=True)
class Probe:
    """One load probed: its decision and what it rests on."""

    load: float                  # users (an int) or a rate
    decision: str                # MEETS, MISSES or UNDECIDED (budget spent first)
    requests: int
    misses: int
    interval: tuple[float, float]   # the miss share's confidence sequence when the probe stopped
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"load": self.load, "decision": self.decision, "requests": self.requests, "misses": self.misses,
                "interval": list(self.interval), "seconds": round(self.seconds, 2)}


@dataclass
class CapacitySearch:
    """The search's state for one target: `next_load()` to probe next (None: done), `record()` its result.
    `start` and `most` are loads, whole multiples of `unit` (1: users)."""

    start: float = 1
    most: float = 64
    unit: float = 1
    probes: list[Probe] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.unit > 0:
            raise ValueError(f"unit: expected a number > 0, found {self.unit}")
        for name in ("start", "most"):
            if not math.isclose(self._steps(getattr(self, name)) * self.unit, getattr(self, name)):
                raise ValueError(f"{name}: expected a whole multiple of {self.unit:g} (the search's step), "
                                 f"found {getattr(self, name):g}")
        if not 1 <= self._steps(self.start) <= self._steps(self.most):
            raise ValueError(f"start: expected {self.unit:g}..{self.most:g} (most), found {self.start:g}")

    def _steps(self, load: float) -> int:
        return round(load / self.unit)

    def _load(self, steps: int):
        """A load of `steps` units: an int when the unit is 1 (users)."""
        return steps if self.unit == 1 else round(steps * self.unit, 9)

    @property
    def low(self) -> float:
        return max((p.load for p in self.probes if p.decision == MEETS), default=0)

    @property
    def high(self) -> Optional[float]:
        return min((p.load for p in self.probes if p.decision == MISSES), default=None)

    @property
    def closed(self) -> bool:
        return self.high is not None and self._steps(self.high) - self._steps(self.low) == 1

    @property
    def stopped_undecided(self) -> bool:
        return any(p.decision == UNDECIDED for p in self.probes)

    def next_load(self) -> Optional[float]:
        if self.closed or self.stopped_undecided:
            return None
        if not self.probes:
            return self.start
        low, high, most = self._steps(self.low), self.high, self._steps(self.most)
        if high is None:                                  # ramping: every probe so far met the SLO
            return None if low >= most else self._load(min(2 * low, most))
        return self._load((low + self._steps(high)) // 2)   # bisecting (from 0 when the first load missed)

    def record(self, probe: Probe) -> None:
        expected = self.next_load()
        if expected is None or not math.isclose(probe.load, expected):
            raise ValueError(f"probe load: expected {expected} (the search's next), found {probe.load}")
        self.probes.append(probe)

    @property
    def capacity(self) -> Optional[float]:
        """The capacity when the bracket is closed, else None."""
        return self.low if self.closed else None

    def bounds(self) -> tuple[float, float]:
        """The least and most the capacity can be: [low, high - unit] (inf when no load was decided to miss)."""
        return float(self.low), (math.inf if self.high is None else float(self._load(self._steps(self.high) - 1)))

    def describe(self) -> str:
        """'capacity 4 (meets at 4, misses at 5; 5 probes)' or 'between 4 and 7 (… undecided at 6 …)'."""
        low, high = self.low, self.high
        undecided = [p.load for p in self.probes if p.decision == UNDECIDED]
        tail = f"{len(self.probes)} probe{'s' if len(self.probes) != 1 else ''}" + (
            f", undecided at {undecided[0]:g} (budget spent)" if undecided else "")
        if self.closed:
            return f"{low:g} (meets at {low:g}, misses at {high:g}; {tail})" if low else \
                f"0 (misses at {high:g}; {tail})"
        upper = f"misses at {high:g}" if high is not None else f"met up to {low:g}, the most searched {self.most:g}" \
            if self._steps(low) >= self._steps(self.most) else "no load decided to miss"
        top = "?" if high is None else f"{self._load(self._steps(high) - 1):g}"
        return f"between {low:g} and {top} ({upper}; {tail})"


def capacity_gain(candidate: CapacitySearch, baseline: CapacitySearch) -> tuple[float, float, float]:
    """(estimate, least, most) of candidate / baseline - 1 from the two brackets; the estimate is the ratio of
    the lows (nan when the baseline met no load)."""
    c_low, c_high = candidate.bounds()
    b_low, b_high = baseline.bounds()
    least = (c_low / b_high - 1) if b_high > 0 else (math.inf if c_low > 0 else math.nan)
    most = (c_high / b_low - 1) if b_low > 0 else math.inf
    estimate = c_low / b_low - 1 if b_low > 0 else math.nan
    return estimate, least, most
