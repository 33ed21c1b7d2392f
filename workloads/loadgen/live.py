"""Figures of a load while it runs, for the console: requests, errors and TTFT percentiles so far.

The definitions are a step summary's (workloads.loadgen.sweep.summarize_step) over the records landed so far:
a request counts once its record is written (it completed or failed); a window's requests are those
sent inside it (a step's warm-up is left out by send time, as in its summary); percentiles come from
the raw TTFTs of the requests that succeeded. What a gate judges is the summary at the step's end;
these lines only show where a long step is, as locust and GuideLLM do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np


@dataclass
class LiveFigures:
    """Requests of one window [since, until) as their records land (by send time, as a step's summary)."""

    since: float = -math.inf
    until: float = math.inf
    requests: int = 0
    errors: int = 0
    ttfts_s: list[float] = field(default_factory=list)

    def add(self, records: Iterable[dict]) -> None:
        for record in records:
            if not self.since <= record["sent_at"] < self.until:
                continue
            self.requests += 1
            if not record["ok"]:
                self.errors += 1
            elif record.get("ttft_s") is not None:
                self.ttfts_s.append(record["ttft_s"])

    def ttft_s(self, percentile: float) -> Optional[float]:
        """A TTFT percentile of the window's successful requests so far (None before the first)."""
        return float(np.percentile(self.ttfts_s, percentile)) if self.ttfts_s else None


def step_name(number: int, steps: int, label: str, target: str) -> str:
    """"step 4 / 9, c=4, baseline": a sweep step as every console line names it."""
    return f"step {number} / {steps}, {label}, {target}"


def format_ms(seconds: Optional[float]) -> str:
    """Seconds as whole milliseconds ("212 ms"), "-" for none."""
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


@dataclass(frozen=True)
class LiveStep:
    """A running sweep step: where it is and what it measured so far (its measured window, after the warm-up)."""

    step: int                      # 1-based, of `steps`
    steps: int
    label: str                     # "c=4", "2 req/s", "×1.5"
    target: str
    elapsed_s: float
    planned_s: float
    warming_up: bool
    requests: int
    errors: int
    ttft_p50_s: Optional[float]
    predicted_ttft_p50_s: Optional[float] = None   # the sizing model's, when it made one for this step

    def line(self) -> str:
        """"step 4 / 9, c=4, baseline: 12 / 26 s, 38 requests, 0 errors, TTFT p50 212 ms, predicted 230 ms"."""
        head = (f"{step_name(self.step, self.steps, self.label, self.target)}: "
                f"{self.elapsed_s:.0f} / {self.planned_s:.0f} s")
        if self.warming_up:
            return f"{head}, warming up"
        predicted = "" if self.predicted_ttft_p50_s is None else f", predicted {format_ms(self.predicted_ttft_p50_s)}"
        return (f"{head}, {self.requests} requests, {self.errors} errors, "
                f"TTFT p50 {format_ms(self.ttft_p50_s)}{predicted}")
