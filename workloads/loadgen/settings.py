"""gates.yaml's load-generation sections: G3's levels, when a level's warm-up ends (`g3.steady`), the
service-level objective (`slo`) and the capacity search under it (`g3.capacity`). Composed by gates/config.py."""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional, Union

from pydantic import Field, PlainValidator, model_validator

from kvcore.settings import MAX_COUNT, Count, Float, StrictModel
from workloads.loadgen.steady import SteadyRule


def _level(value: Any) -> Union[int, float]:
    """A G3 level as given: an int stays an int (a concurrency), a float a float (a multiplier)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, found {value!r}")
    if abs(value) > MAX_COUNT:
        raise ValueError(f"expected a value <= {MAX_COUNT}, found {value!r}")
    return value


Level = Annotated[Union[int, float], PlainValidator(_level)]


class G3SteadyConfig(StrictModel):
    """When a level's warm-up pairs end (workloads/loadgen/steady.py): two candidate blocks two pairs apart agree."""

    ttft_change: Float = Field(default=0.35, gt=0, description="the candidate's TTFT p50 within this fraction of the "
                               "block before (where its engine's block size is not known)")
    hit_ratio_points: Float = Field(default=0.05, ge=0, le=1, description="its cached share of its prompts' whole "
                                    "blocks (else its hit ratio) within this many points (a fraction) of the block "
                                    "before")
    max_pairs: Count = Field(default=3, ge=1, description="warm-up pairs at most; a level not settled by then is "
                             "measured from the last and says so")

    def rule(self) -> SteadyRule:
        return SteadyRule(self.ttft_change, self.hit_ratio_points, self.max_pairs)


class SLOConfig(StrictModel):
    """The service-level objective a request meets: its TTFT and its TPOT within their limits at a percentile of
    the requests, errors within their share. G3's capacity search (g3.capacity) finds the most load at which it
    holds (kvcore/attainment.py: a request misses when a latency is over its limit, it failed, or it never
    finished)."""

    percentile: Float = Field(default=90, gt=50, lt=100, description="the percentile both limits hold at (90: at "
                              "most 10% of the requests may miss)")
    ttft_ms: Float = Field(gt=0, description="TTFT limit at the percentile, ms")
    tpot_ms: Optional[Float] = Field(default=None, gt=0, description="time per output token limit at the "
                                     "percentile, ms (after the first token; none: TTFT alone)")
    max_error_share: Float = Field(default=0.001, ge=0, lt=1, description="a load whose failed share is decided above "
                                   "this misses the SLO")


class G3CapacityConfig(StrictModel):
    """The capacity search: per target, the most load at which `slo` holds (kvcore/capacity.py), baseline and
    candidate probes in turn; each probe stops when its requests decide it. The load is closed-loop users, or with
    `g3.replay: rate_multipliers` a multiple of the trace's arrival rate (open loop, in steps of `rate_step`)."""

    enabled: bool = Field(default=False, description="run the capacity search after the sweep (needs `slo`)")
    start: Level = Field(default=1, description="the first load probed (users, or a multiple of the trace's rate)")
    most: Level = Field(default=64, description="the most load probed (the ramp doubles up to it)")
    rate_step: Float = Field(default=0.25, gt=0, description="replay: rate_multipliers: the search's resolution, in "
                             "multiples of the trace's rate (start and most are whole multiples of it)")
    probe_requests: Count = Field(default=400, ge=34, description="requests a probe sends at most (34: the fewest "
                                  "that decide a 10% allowance when none misses)")
    probe_budget_s: Float = Field(default=60, gt=0, description="seconds a probe may run before it is undecided")
    confidence: Float = Field(default=0.95, gt=0.5, lt=1, description="each probe's confidence sequence level")

    @model_validator(mode="after")
    def _start_within_most(self) -> "G3CapacityConfig":
        for name in ("start", "most"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a load > 0, found {getattr(self, name)}")
        if self.start > self.most:
            raise ValueError(f"start: expected at most `most` ({self.most}), found {self.start}")
        return self

    def unit(self, replay: str) -> float:
        """The search's step: one user closed loop, `rate_step` open loop."""
        return 1 if replay == "closed_loop" else self.rate_step

    def check_loads(self, replay: str) -> None:
        """start and most are whole multiples of the search's step for `replay`; else a ValueError naming the field."""
        unit = self.unit(replay)
        what = "a whole number of users (replay: closed_loop)" if unit == 1 else \
            f"a whole multiple of rate_step ({unit:g}, replay: rate_multipliers)"
        for name in ("start", "most"):
            value = getattr(self, name)
            if not math.isclose(round(value / unit) * unit, value) or (unit == 1 and not isinstance(value, int)):
                raise ValueError(f"g3.capacity.{name}: expected {what}, found {value}")
