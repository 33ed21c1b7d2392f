"""G2's cold-read bandwidth, side by side with the storage's best: sequential pairs, anytime-valid.

How it works: docs/methods/side-by-side.md (gates/g2_baseline/cold_read.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gates.side_by_side import (
    MIN_PAIRS,
    FioRegions,
    Pair,
    Pairing,
    Reading,
    SideBySideError,
    measure_pairs,
    own_pattern,
    paired_ratio,
)
from workloads.probes.faults import AdminClient, per_tier
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest

__all__ = ["MIN_PAIRS", "WARMUP_PAIRS", "METRIC", "ColdReadError", "FioRegions", "Pair", "Pairing", "Reading",
           "TierColdLoad", "disk_counters", "measure_pairs", "own_pattern", "paired_ratio"]

METRIC = "cold_read_vs_storage_best"

WARMUP_PAIRS = 1  # the first pair meets a server whose read path is cold (threads, buffers): not judged


class ColdReadError(SideBySideError):
    """A round could not be measured (a request failed, or the tier's load read nothing from disk)."""


# -- the tier's side ---------------------------------------------------------------------------


def disk_counters(admin: AdminClient) -> Reading:
    """The disk tier's bytes read and load seconds so far, from the server's /metrics."""
    samples = admin.metrics()
    return Reading(per_tier(samples, "kvgate_cache_bytes_read_total").get("disk", 0.0),
                   per_tier(samples, "kvgate_cache_load_latency_seconds_sum").get("disk", 0.0))


@dataclass
class TierColdLoad:
    """The tier's side of a round: the n-th call loads prefix set n mod `sets` (one call a round: round i's
    set is i mod sets; with equal draws, side_by_side.measure_pairs(draws=...), a round's draws take the next
    sets in turn, so no draw re-reads what the one before it just read), each of `prefixes` prefixes (set s is
    `request_for(s * prefixes + j)`), loaded cold one after another; their bytes and load seconds
    together are the reading (several prefixes: more bytes per pair, so a short stall of the
    disk moves the ratio less).

    Every set is stored once, at the first round (each prefix a miss: computed, then written behind to
    disk); each round then places its set on disk only (the upper tiers evicted, the disk tier's pages
    dropped) and loads it. Storing costs a prefill per prefix, loading a fraction of one, so rounds
    that reload stored sets are many times cheaper than rounds that each compute fresh ones: more
    pairs in the same budget. fio's side (side_by_side.FioRegions with `rounds=sets`) reads region
    i mod `sets` of a file laid out at the first round too, so both sides read data of the same age.
    """

    admin: AdminClient
    client: StreamingClient
    request_for: Callable[[int], WorkloadRequest]
    prefixes: int = 1
    sets: int = 1
    clear_engine: Callable[[], object] = lambda: None   # an engine's own device cache above the cache (vLLM's)
    stored: list[list[WorkloadRequest]] = field(default_factory=list, init=False)
    loads: int = field(default=0, init=False)

    def __call__(self, index: int) -> Reading:
        if not self.stored:
            self._store_every_set(index)
        requests = self.stored[self.loads % self.sets]
        self.loads += 1
        self.admin.evict(("device", "host"))
        self.clear_engine()
        self.admin.drop_page_cache()
        before = disk_counters(self.admin)
        for request in requests:
            self._send(request, index)
        after = disk_counters(self.admin)
        moved = Reading(after.nbytes - before.nbytes, after.seconds - before.seconds)
        if moved.nbytes <= 0 or moved.seconds <= 0:
            raise ColdReadError(f"cold-read round {index}: the load read nothing from the disk tier "
                                f"({moved.nbytes:.0f} bytes in {moved.seconds:.6f} s by the server's metrics)")
        return moved

    def _store_every_set(self, index: int) -> None:
        self.stored = [[self.request_for(s * self.prefixes + j) for j in range(self.prefixes)]
                       for s in range(self.sets)]
        for request in (r for requests in self.stored for r in requests):
            self._send(request, index)                  # a miss: computes and stores the prefix
        self.admin.flush()                              # the write-behind mover has written them all to disk

    def _send(self, request: WorkloadRequest, index: int) -> None:
        record = self.client.send(request)
        if not record.ok:
            raise ColdReadError(f"cold-read round {index}: request failed: {record.error_type}: "
                                f"{record.error_message}")
