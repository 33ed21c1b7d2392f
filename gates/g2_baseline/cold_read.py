"""G2's cold-read bandwidth, side by side with fio: alternating rounds, judged as a ratio of medians.

This storage swings 2-3x between minutes (one fio job gave 1.3-3.5 GB/s on one disk), so a ratio
whose two sides ran minutes apart is a draw. Each round is a *pair*, measured back to back:

1. the tier: fresh prefixes (`g2.cold_read_prefixes`) are stored, placed on disk only (the upper
   tiers evicted, the disk tier's pages dropped) and loaded once each; its bandwidth is the server's own disk bytes read over
   disk load seconds, both as that one request moved them;
2. fio: a sequential read of a fresh region of one laid-out file on the same storage, as many
   bytes as the tier read, in the tier's I/O mode (direct when the tier reads with O_DIRECT) and
   with its parallelism (queue depth = the tier's read workers).

The verdict takes the ratio of the medians (tier / fio) with a bootstrap interval that resamples
whole pairs (gates.stats.ratio_ci(paired=True)), so INCONCLUSIVE when the interval straddles the
threshold. Fewer than MIN_PAIRS pairs is never judged (the config refuses such a count).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from gates.stats import ratio_ci
from workloads.client import StreamingClient
from workloads.faults import AdminClient, per_tier
from workloads.fio import FioJob, run_fio
from workloads.requests import WorkloadRequest

MIN_PAIRS = 5
FIO_BLOCK = 1 << 20   # the sequential-read job's request size, as G1's (1 MiB)


class ColdReadError(RuntimeError):
    """A round could not be measured (a request failed, or the tier's load read nothing from disk)."""


@dataclass(frozen=True)
class Reading:
    """One side of one round: bytes read and the seconds they took."""

    nbytes: float
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass(frozen=True)
class ColdReadPair:
    """One round: the tier's cold load and fio's read right after it."""

    round: int
    tier: Reading
    fio: Reading

    @property
    def ratio(self) -> float:
        return self.tier.gbps / self.fio.gbps

    def context(self) -> dict:
        """Everything the report shows of the pair."""
        return {"round": self.round, "tier_gbps": _four(self.tier.gbps), "fio_gbps": _four(self.fio.gbps),
                "tier_bytes": int(self.tier.nbytes), "tier_seconds": _four(self.tier.seconds),
                "fio_bytes": int(self.fio.nbytes), "fio_seconds": _four(self.fio.seconds)}


def _four(number: float) -> float:
    """Four significant digits: what the report shows of a measured figure."""
    return float(f"{number:.4g}")


@dataclass(frozen=True)
class PairedRatio:
    """The judged figure: median tier GB/s over median fio GB/s, its interval, and whether it may be judged."""

    value: Optional[float]
    interval: Optional[tuple[float, float]]
    pairs: int
    tier_gbps: Optional[float] = None
    fio_gbps: Optional[float] = None

    @property
    def valid(self) -> bool:
        return self.pairs >= MIN_PAIRS

    def describe(self) -> str:
        """"5 pairs, medians 1.17 / 2.15 GB/s" (tier / fio), for the verdict's label."""
        if not self.pairs:
            return "no pairs"
        return f"{self.pairs} pairs, medians {self.tier_gbps:.2f} / {self.fio_gbps:.2f} GB/s"

    def verdict_options(self) -> dict:
        """Keyword arguments for gates.verdict.judge (and the `verdict` fixture)."""
        options = {"unit": "%", "interval": self.interval, "valid": self.valid}
        if not self.valid:
            options["invalid_reason"] = f"{self.pairs} tier/fio pairs, at least {MIN_PAIRS} needed"
        return options


def paired_ratio(pairs: Sequence[ColdReadPair]) -> PairedRatio:
    """The ratio of medians of the pairs' GB/s with its paired bootstrap 95% interval."""
    if not pairs:
        return PairedRatio(None, None, 0)
    tier, fio = [p.tier.gbps for p in pairs], [p.fio.gbps for p in pairs]
    value, interval = ratio_ci(tier, fio, paired=True)
    return PairedRatio(value, interval, len(pairs), tier_gbps=statistics.median(tier),
                       fio_gbps=statistics.median(fio))


WARMUP_PAIRS = 1  # the first pair meets a server whose read path is cold (threads, buffers): not judged


def measure_pairs(tier_round: Callable[[int], Reading], fio_round: Callable[[int, float], Reading],
                  rounds: int, warmup: int = 0) -> list[ColdReadPair]:
    """`warmup` pairs left out, then `rounds` pairs, alternating: the tier's cold load, then fio reading
    as many bytes (round indices count the warm-up ones: each round reads fresh data)."""
    pairs = []
    for index in range(warmup + rounds):
        tier = tier_round(index)
        pair = ColdReadPair(index, tier, fio_round(index, tier.nbytes))
        if index >= warmup:
            pairs.append(pair)
    return pairs


# -- the tier's side ---------------------------------------------------------------------------


def disk_counters(admin: AdminClient) -> Reading:
    """The disk tier's bytes read and load seconds so far, from the server's /metrics."""
    samples = admin.metrics()
    return Reading(per_tier(samples, "kvgate_cache_bytes_read_total").get("disk", 0.0),
                   per_tier(samples, "kvgate_cache_load_latency_seconds_sum").get("disk", 0.0))


@dataclass
class TierColdLoad:
    """The tier's side of round i: `prefixes` fresh prefixes (`request_for(i * prefixes + j)`) stored, placed
    on disk only and loaded one after another; their bytes and load seconds together are the round's reading
    (several prefixes: more bytes per pair, so a short stall of the disk moves the ratio less)."""

    admin: AdminClient
    client: StreamingClient
    request_for: Callable[[int], WorkloadRequest]
    prefixes: int = 1

    def __call__(self, index: int) -> Reading:
        requests = [self.request_for(index * self.prefixes + j) for j in range(self.prefixes)]
        for request in requests:
            self._send(request, index)                  # a miss: computes and stores the prefix
        self.admin.flush()                              # the write-behind mover has written it to disk
        self.admin.evict(("device", "host"))
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

    def _send(self, request: WorkloadRequest, index: int) -> None:
        record = self.client.send(request)
        if not record.ok:
            raise ColdReadError(f"cold-read round {index}: request failed: {record.error_type}: "
                                f"{record.error_message}")


# -- fio's side --------------------------------------------------------------------------------


@dataclass
class FioRegions:
    """fio's side: sequential reads of fresh regions of one file laid out in `directory`.

    The region is the first round's byte count rounded up to whole 1 MiB requests (per job); the
    file holds `rounds` regions, written once before the first read (not timed), and round i reads
    region i, so no round reads what an earlier one brought into a cache. Direct: one job with
    `parallel` requests in flight (`ioengine`, G1's). Buffered: libaio completes each buffered read
    before taking the next, so up to `parallel` psync jobs read a slice of the region each, as the
    tier's read threads do. Use as a context manager: the file goes away at the end.
    """

    directory: Path
    rounds: int
    direct: bool
    parallel: int
    ioengine: str = "libaio"
    name: str = "g2-cold-read"
    region: int = 0
    numjobs: int = 1

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.0.0"   # fio's name for job 0's file 0

    def __call__(self, index: int, nbytes: float) -> Reading:
        if not self.region:
            self._size_regions(nbytes)
            run_fio(self._layout_job())
        job = self.read_job(index)
        result = run_fio(job)
        read = sum(float(entry["read"]["io_bytes"]) for entry in result.raw["jobs"])
        if read <= 0 or result.read_bw_bytes <= 0:
            raise ColdReadError(f"cold-read round {index}: fio read nothing ({' '.join(job.argv()[1:])})")
        return Reading(read, read / result.read_bw_bytes)

    def _size_regions(self, nbytes: float) -> None:
        requests = max(1, math.ceil(nbytes / FIO_BLOCK))
        self.numjobs = 1 if self.direct else min(self.parallel, requests)
        self.region = math.ceil(requests / self.numjobs) * self.numjobs * FIO_BLOCK

    def _layout_job(self) -> FioJob:
        return FioJob(name=self.name, directory=self.directory, rw="write", bs=str(FIO_BLOCK),
                      size=str(self.rounds * self.region), direct=self.direct, ioengine="psync",
                      extra=("--end_fsync=1",))

    def read_job(self, index: int) -> FioJob:
        """The read of region `index`: G1's sequential read (1 MiB), in the tier's I/O mode and parallelism."""
        per_job = self.region // self.numjobs
        return FioJob(name=self.name, directory=self.directory, rw="read", bs=str(FIO_BLOCK), size=str(per_job),
                      direct=self.direct, ioengine=self.ioengine if self.direct else "psync",
                      iodepth=self.parallel if self.direct else 1, numjobs=self.numjobs,
                      extra=(f"--filename={self.path.name}", f"--filesize={self.rounds * self.region}",
                             f"--offset={index * self.region}", f"--offset_increment={per_job}"))

    def __enter__(self) -> "FioRegions":
        self._created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)
        if self._created and not any(self.directory.iterdir()):
            self.directory.rmdir()
