"""How many side-by-side pairs a measurement takes: G2's rounds and cold-read pairs, G3's block pairs per level.

One settings model for every sequential measurement (gates.yaml's `g2.cold_read_pairs`, `g2.model_load.rounds`,
`g2.checkpoint.rounds`, `g3.blocks`); the method: docs/methods/side-by-side.md.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from .settings import Count, Float, StrictModel


class PairsConfig(StrictModel):
    """Sequential side-by-side pairs: at least `min`, then more until the anytime-valid interval decides every
    rule, at most `max`, none started once `budget_s` has passed. A plain number n means exactly n pairs
    (min = max = n)."""

    min: Count = Field(default=5, ge=3, description="pairs always taken (3: the fewest an interval is given for)")
    max: Count = Field(default=12, ge=3, description="the most pairs taken when the interval does not decide")
    budget_s: Optional[Float] = Field(default=300.0, gt=0, description="seconds after which no further pair is "
                                      "started (null: no limit)")

    @model_validator(mode="before")
    @classmethod
    def _a_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"min": value, "max": value}
        return value

    @model_validator(mode="after")
    def _max_at_least_min(self) -> "PairsConfig":
        if self.max < self.min:
            raise ValueError(f"max: expected at least min ({self.min}), found {self.max}")
        return self
