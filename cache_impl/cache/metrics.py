"""Per-tier counters and a load-latency histogram, exported as a plain snapshot."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Seconds; Prometheus-style cumulative buckets are derived in `snapshot()`.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

COUNTERS = (
    "hits", "misses", "bytes_read", "bytes_written", "blocks_written",
    "evictions", "evictions_for_space", "demotions", "corrupt_blocks", "write_errors", "read_errors",
    "stores_refused",
)


@dataclass
class LatencyHistogram:
    """Counts of observations per upper bound (last slot: above every bound)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_seconds += seconds
        self.count += 1

    def snapshot(self) -> dict:
        cumulative, running = {}, 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.counts):
            running += n
            cumulative["+Inf" if bound == float("inf") else repr(bound)] = running
        return {"buckets": cumulative, "sum": self.total_seconds, "count": self.count}


class TierMetrics:
    """Thread-safe counters of one tier; `corrupt_by_reason` says what verification caught."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.corrupt_by_reason: dict[str, int] = {}
        self.load_latency = LatencyHistogram()

    def add(self, counter: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[counter] += amount

    def corrupt(self, reason: str) -> None:
        with self._lock:
            self.counters["corrupt_blocks"] += 1
            self.corrupt_by_reason[reason] = self.corrupt_by_reason.get(reason, 0) + 1

    def observe_load(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.load_latency.observe(seconds)
            self.counters["bytes_read"] += nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return {
                **self.counters,
                "corrupt_by_reason": dict(self.corrupt_by_reason),
                "load_latency_seconds": self.load_latency.snapshot(),
            }
