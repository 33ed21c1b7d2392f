"""How many side-by-side pairs a measurement takes: G2's rounds and cold-read pairs, G3's block pairs per level; and
how many rounds a short measurement repeats (G2's TTFT rounds, the sizing model's probes).

One settings model for every sequential measurement (gates.yaml's `g2.cold_read_pairs`, `g2.model_load.rounds`,
`g2.checkpoint.rounds`, `g3.blocks`), one for repeated rounds (`g2.rounds`); the method:
docs/methods/side-by-side.md.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from pydantic import Field, model_validator

from .settings import Count, Float, StrictModel


class _Bounded(StrictModel):
    """A count between `min` and `max`; a plain number n means exactly n (min = max = n)."""

    min: int
    max: int

    @model_validator(mode="before")
    @classmethod
    def _a_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"min": value, "max": value}
        if not isinstance(value, dict):
            fields = ", ".join(cls.model_fields)
            raise ValueError(f"expected a whole number or a mapping of {fields}, found {value!r}")
        return value

    @model_validator(mode="after")
    def _max_at_least_min(self) -> "_Bounded":
        if self.max < self.min:
            raise ValueError(f"max: expected at least min ({self.min}), found {self.max}")
        return self


class PairsConfig(_Bounded):
    """Sequential side-by-side pairs: at least `min`, then more until the anytime-valid interval decides every
    rule, at most `max`, none started once `budget_s` has passed. A plain number n means exactly n pairs
    (min = max = n)."""

    min: Count = Field(default=5, ge=3, description="pairs always taken (3: the fewest an interval is given for)")
    max: Count = Field(default=12, ge=3, description="the most pairs taken when the interval does not decide")
    budget_s: Optional[Float] = Field(default=300.0, gt=0, description="seconds after which no further pair is "
                                      "started (null: no limit)")


class RoundsConfig(_Bounded):
    """Rounds of a short measurement, its figure their median: at least `min`, then another while as many rounds as
    that of their median length fit `budget_s`, at most `max`. A measurement of milliseconds repeats many times
    (its median steadies where one round in three may stall 2-3x on a busy machine); one of seconds, `min`. The
    median, not their sum: a stalled round (vLLM on 2 CPU cores: 400-550 ms beside 15-30 ms) would spend the budget
    that more rounds are for. A plain number n means exactly n rounds (min = max = n)."""

    min: Count = Field(default=2, ge=1, description="rounds always taken")
    max: Count = Field(default=2, ge=1, description="the most rounds taken")
    budget_s: Optional[Float] = Field(default=None, gt=0, description="seconds a figure's rounds may take at their "
                                      "median length, the first `min` whatever they take (null: `min` rounds)")

    @model_validator(mode="before")
    @classmethod
    def _max_of_min(cls, value: Any) -> Any:
        if isinstance(value, dict) and "min" in value and "max" not in value:
            return {**value, "max": value["min"]}
        return value

    def more(self, seconds: Sequence[float]) -> bool:
        """Whether to take another round after rounds that took `seconds` each."""
        done = len(seconds)
        if done < self.min:
            return True
        if done >= self.max or self.budget_s is None:
            return False
        return (done + 1) * statistics.median(seconds) <= self.budget_s
