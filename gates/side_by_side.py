"""A figure judged against the storage's best on the same storage, measured side by side: sequential pairs.

How it works: docs/methods/side-by-side.md (gates/side_by_side.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from kvcore.sampling import PairsConfig
from kvcore.sequential import (
    METHOD,
    MIN_PAIRS_FOR_AN_INTERVAL,
    Looks,
    Stopping,
    log_ratio_sequence,
    method,
    sample_until_decided,
)
from workloads.storage.fio import FioJob, FioResult, run_fio
from workloads.storage.fio_sweep import FioShape

MIN_PAIRS = MIN_PAIRS_FOR_AN_INTERVAL
MIN_YARDSTICK_BYTES = 128 << 20   # the least a judged fio read moves (FioRegions: below it fio's start shows)
FIO_BLOCK = 1 << 20   # the same-pattern jobs' request size (1 MiB)


class SideBySideError(RuntimeError):
    """A round could not be measured (the subject failed, or one side moved no bytes)."""


@dataclass(frozen=True)
class Reading:
    """One side of one round: bytes moved and the seconds they took."""

    nbytes: float
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass(frozen=True)
class Pair:
    """One round: the subject's reading, the best job's right after it, and optionally fio in the subject's
    own pattern (a diagnostic, never judged). `subject_draws`: every run of the subject in the round when it
    ran more than once (equal draws, `measure_pairs(draws=...)`), `subject` the faster of them."""

    round: int
    subject: Reading
    fio: Reading
    same_pattern: Optional[Reading] = None
    subject_draws: tuple[Reading, ...] = ()

    @property
    def ratio(self) -> float:
        return self.subject.gbps / self.fio.gbps

    def context(self, subject: str) -> dict:
        """Everything the report shows of the pair, the subject's figures under `subject`_… keys."""
        context: dict[str, object] = {
            "round": self.round, f"{subject}_gbps": four(self.subject.gbps), "fio_gbps": four(self.fio.gbps),
            f"{subject}_bytes": int(self.subject.nbytes), f"{subject}_seconds": four(self.subject.seconds),
            "fio_bytes": int(self.fio.nbytes), "fio_seconds": four(self.fio.seconds)}
        if self.same_pattern is not None:
            context.update(same_pattern_gbps=four(self.same_pattern.gbps),
                           same_pattern_ratio=four(self.subject.gbps / self.same_pattern.gbps))
        if len(self.subject_draws) > 1:
            context[f"{subject}_draws_gbps"] = [four(r.gbps) for r in self.subject_draws]
        return context


def four(number: float) -> float:
    """Four significant digits: what the report shows of a measured figure."""
    return float(f"{number:.4g}")


@dataclass(frozen=True)
class PairedRatio:
    """The judged figure: the geometric mean of the pairs' subject / best ratios, its interval (valid at every look)
    and the interval's method, the sides' medians, the diagnostic same-pattern ratio, and how sampling stopped."""

    value: Optional[float]
    interval: Optional[tuple[float, float]]
    pairs: int
    subject_gbps: Optional[float] = None
    fio_gbps: Optional[float] = None
    same_pattern_ratio: Optional[float] = None
    stopping: Optional[Stopping] = None
    method: str = METHOD

    @property
    def valid(self) -> bool:
        return self.pairs >= MIN_PAIRS

    def describe(self) -> str:
        """"7 pairs (decided after 7 pairs), medians 1.17 / 2.15 GB/s" (subject / best), for the verdict's label."""
        if not self.pairs:
            return "no pairs"
        why = f" ({self.stopping.why})" if self.stopping is not None else ""
        return f"{self.pairs} pairs{why}, medians {self.subject_gbps:.2f} / {self.fio_gbps:.2f} GB/s"

    def diagnostic(self) -> str:
        """"at its own parallelism the subject reaches 0.97 of fio" when the same-pattern leg ran, else ""."""
        if self.same_pattern_ratio is None:
            return ""
        return f"at its own pattern it reaches {self.same_pattern_ratio:.2f} of fio (diagnostic, not judged)"

    def verdict_options(self) -> dict:
        """Keyword arguments for kvcore.verdict.judge (and the `verdict` fixture)."""
        options = {"unit": "%", "interval": self.interval, "valid": self.valid}
        if not self.valid:
            options["invalid_reason"] = f"{self.pairs} side-by-side pairs, at least {MIN_PAIRS} needed"
        return options

    def aa_context(self) -> dict:
        """What an A/A row (kvcore.aa) carries: the ratio, its interval, the pairs and how sampling stopped."""
        return {"ratio": self.value, "interval": list(self.interval or ()), "pairs": self.pairs,
                **({"stopping": self.stopping.to_dict()} if self.stopping else {})}

    def record_context(self) -> dict:
        """What the judged figure's run-store row carries besides its value."""
        return {"pairs": self.pairs, "interval": list(self.interval or ()), "subject_gbps": self.subject_gbps,
                "fio_gbps": self.fio_gbps, "same_pattern_ratio": self.same_pattern_ratio,
                "interval_method": self.method, **({"stopping": self.stopping.to_dict()} if self.stopping else {})}


def paired_ratio(pairs: Sequence[Pair], stopping: Optional[Stopping] = None,
                 looks: Optional[Looks] = None) -> PairedRatio:
    """The geometric mean of the pairs' ratios with its 95% interval (none below MIN_PAIRS), valid at every look:
    over `looks`, the schedule the pairs were sampled under (`Pairing.looks()`), else Lai's sequence."""
    if not pairs:
        return PairedRatio(None, None, 0, stopping=stopping, method=method(looks))
    subject, fio = [p.subject.gbps for p in pairs], [p.fio.gbps for p in pairs]
    value, interval = log_ratio_sequence(subject, fio, looks=looks)
    same = [(p.subject, p.same_pattern) for p in pairs if p.same_pattern is not None]
    diagnostic = (log_ratio_sequence([s.gbps for s, _ in same], [o.gbps for _, o in same])[0]
                  if same else None)
    return PairedRatio(value, interval if len(pairs) >= MIN_PAIRS else None, len(pairs),
                       subject_gbps=statistics.median(subject), fio_gbps=statistics.median(fio),
                       same_pattern_ratio=diagnostic, stopping=stopping, method=method(looks))


@dataclass(frozen=True)
class Pairing:
    """How many pairs a sequential measurement takes: at least `min`, at most `max`, none started after `budget_s`."""

    min: int = 5
    max: int = 12
    budget_s: float = 120.0

    @classmethod
    def of(cls, settings: PairsConfig) -> "Pairing":
        """The pairing gates.yaml's settings ask for (a budget of null: no limit)."""
        return cls(settings.min, settings.max, math.inf if settings.budget_s is None else settings.budget_s)

    def looks(self) -> Looks:
        """The schedule the pairs' interval is calibrated for: a look after every pair from the 3rd to `max`."""
        return Looks(last=max(self.max, MIN_PAIRS_FOR_AN_INTERVAL))


Round = Callable[[int], Reading]
FioRound = Callable[[int, float], Reading]


def measure_pairs(subject_round: Round, fio_round: FioRound, pairing: Pairing, rules: Sequence = (),
                  warmup: int = 0, same_pattern: Optional[FioRound] = None,
                  on_pair: Callable[[Pair], None] = lambda pair: None, draws: int = 1,
                  ) -> tuple[list[Pair], Stopping]:
    """`warmup` pairs left out, then pairs until the interval decides every rule (kvcore.sequential), each
    the subject (`draws` runs, the faster counted: equal draws, below), then fio moving as many bytes, then
    (optional) fio in the subject's own pattern. Round indices count the warm-up ones: each round moves
    fresh data. `pairing` has min, max and budget_s.

    Equal draws: a yardstick that counts the faster of its jobs each round (`FasterOf`) draws `len(sides)`
    times from this storage's noise, a subject run once draws once. Every job here stalls now and then (on
    the development VM a direct 4 x 16 MiB read of 128 MiB ran at 0.57-0.77 GB/s in 4 of 16 runs, 1.74-2.10
    in the rest); the faster of two runs misses a stall that a single run meets, so a subject run once is
    judged against a luckier yardstick whatever its speed (by simulation, tests/gates/test_g2_cold_read.py: a
    subject exactly as fast as the storage came out at 0.83 [0.76, 0.91] of it over 400 pairs). With
    `draws` = the yardstick's jobs an equal subject comes out at 1 (the A/A of this is the best jobs on
    both sides)."""
    if draws < 1:
        raise ValueError(f"draws: expected an integer >= 1, found {draws}")
    for index in range(warmup):
        _pair(index, subject_round, fio_round, same_pattern, draws)
    pairs: list[Pair] = []

    def take_one(i: int) -> None:
        pairs.append(_pair(warmup + i, subject_round, fio_round, same_pattern, draws))
        on_pair(pairs[-1])

    def interval_now():
        return paired_ratio(pairs, looks=pairing.looks()).interval

    stopping = sample_until_decided(take_one, interval_now, list(rules), pairing.min, pairing.max, pairing.budget_s)
    return pairs, stopping


@dataclass
class FasterOf:
    """The storage's best side of a round: every side in `sides` (the sweep's winner of each I/O mode) run in
    the round, the faster one's reading counted. Odd rounds run them in reverse order, so what one leaves
    behind (a cache below a virtual machine, the device's queue) falls on each alike. `runs` keeps every
    call's round and each side's reading (several subjects may share a round: G2's model loaders)."""

    sides: Mapping[str, FioRound]
    runs: list[tuple[int, dict[str, Reading]]] = field(default_factory=list)

    def __call__(self, index: int, nbytes: float) -> Reading:
        order = list(self.sides.items())
        if index % 2:
            order.reverse()
        readings = {label: side(index, nbytes) for label, side in order}
        self.runs.append((index, readings))
        return readings[_faster(readings)]

    def round_context(self, index: int) -> dict:
        """Each side's GB/s in the last run of round `index` (`best_direct_gbps`, ...): for the pair's record."""
        last = next((readings for i, readings in reversed(self.runs) if i == index), {})
        return {f"best_{label}_gbps": four(r.gbps) for label, r in last.items()}

    def describe_wins(self, pairs: Sequence[Pair]) -> str:
        """"the faster: direct in 7, buffered in 5 runs" over the runs of `pairs`' rounds when more than one side
        ran, else ""."""
        if len(self.sides) < 2:
            return ""
        rounds = {p.round for p in pairs}
        faster = [_faster(readings) for i, readings in self.runs if i in rounds]
        return "the faster: " + ", ".join(f"{label} in {faster.count(label)}" for label in self.sides) + " runs"


def _faster(readings: dict[str, Reading]) -> str:
    return max(readings, key=lambda label: readings[label].gbps)


def _pair(index: int, subject_round: Round, fio_round: FioRound, same_pattern: Optional[FioRound],
          draws: int) -> Pair:
    runs = tuple(subject_round(index) for _ in range(draws))
    subject = max(runs, key=lambda reading: reading.gbps)
    best = fio_round(index, subject.nbytes)
    return Pair(index, subject, best, same_pattern(index, subject.nbytes) if same_pattern is not None else None,
                runs if draws > 1 else ())


def _moved(result: FioResult, job: FioJob, direction: str, index: int) -> Reading:
    moved = sum(float(entry[direction]["io_bytes"]) for entry in result.raw["jobs"])
    bandwidth = result.read_bw_bytes if direction == "read" else result.write_bw_bytes
    if moved <= 0 or bandwidth <= 0:
        raise SideBySideError(f"round {index}: fio moved nothing ({' '.join(job.argv()[1:])})")
    return Reading(moved, moved / bandwidth)


# -- fio's sides -------------------------------------------------------------------------------


def own_pattern(direct: bool, parallel: int, ioengine: str = "libaio") -> FioShape:
    """fio in the disk tier's own pattern (the diagnostic leg): 1 MiB requests in its I/O mode with its
    parallelism. Direct: one job with `parallel` requests in flight; buffered: libaio completes each
    buffered read before taking the next, so `parallel` psync jobs, as the tier's read threads."""
    if direct:
        return FioShape(True, ioengine, parallel, 1, str(FIO_BLOCK))
    return FioShape(False, "psync", 1, parallel, str(FIO_BLOCK))


@dataclass
class FioRegions:
    """fio's side of the disk tier's cold read: sequential reads of regions of one file in `directory`, in
    `shape` (the storage's best job, or the tier's own pattern for the diagnostic leg).

    The region is the first round's byte count, at least `min_bytes`, rounded up to whole requests of
    `shape.bs` over its jobs. Not much more than the tier read: the same bytes, age and footprint on
    both sides, since a cache below a virtual machine can hold one side's data and not the other's
    (492 MiB regions beside the tier's 124 MiB sets read at 1.6-2.0 and 0.75-0.9 GB/s in turn while the
    tier read steadily). Not less than `min_bytes` (MIN_YARDSTICK_BYTES for G2's cold read): fio's own
    start (its jobs' threads, opens, first requests) is a share of a short run, and the best job (4
    buffered jobs) read 62 MiB at 0.63-0.83 GB/s, no faster than one job, where it read 124 MiB at
    1.0-1.4: a tier reading with one worker then passed at 104% [82, 132] (the b-serial-read control).
    The file holds `rounds` regions and round i reads region i mod rounds, its pages dropped first
    (`invalidate=1`). Each job reads its own slice of the region
    (`offset_increment`). The regions are written (buffered, fsync'd, not timed) once, at the first
    round, as G2's tier stores its prefix sets at its first round and round i reloads set i mod sets:
    both sides read data of the same age (a virtual machine's host may cache recent writes, so the
    yardstick must not read older data than the subject does). Use as a context manager: the file goes
    away at the end.
    """

    directory: Path
    rounds: int
    shape: FioShape = field(default_factory=FioShape)
    name: str = "g2-cold-read"
    region: int = 0
    numjobs: int = 1
    min_bytes: int = 0

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.0.0"   # fio's name for job 0's file 0

    def __call__(self, index: int, nbytes: float) -> Reading:
        if not self.region:
            self._size_regions(nbytes)
            run_fio(self.layout_job())
        job = self.read_job(index % self.rounds)
        return _moved(run_fio(job), job, "read", index)

    def _size_regions(self, nbytes: float) -> None:
        block = self.shape.bs_bytes
        requests = max(1, math.ceil(max(nbytes, self.min_bytes) / block))
        self.numjobs = self.shape.numjobs          # the shape's parallelism, whatever the bytes: at least as many
        self.region = math.ceil(requests / self.numjobs) * self.numjobs * block

    def layout_job(self) -> FioJob:
        """Every round's region written (buffered, any size, and fsync'd) once, before the first read."""
        return FioJob(name=self.name, directory=self.directory, rw="write", bs=str(min(FIO_BLOCK, self.region)),
                      size=str(self.rounds * self.region), direct=False, ioengine="psync", extra=("--end_fsync=1",))

    def read_job(self, index: int) -> FioJob:
        """The read of region `index` in `shape`, each job a slice of it."""
        per_job = self.region // self.numjobs
        return FioJob(name=self.name, directory=self.directory, rw="read", bs=self.shape.bs, size=str(per_job),
                      direct=self.shape.direct, ioengine=self.shape.ioengine, iodepth=self.shape.iodepth,
                      numjobs=self.numjobs,
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


@dataclass
class FioFilesRead:
    """fio's side of a loader: a sequential read of the same files the loader read, in `shape` (the
    storage's best read job).

    Read only (`--readonly`: fio never writes or extends them, so an existing model directory is
    safe), one file after another (`file_service_type=sequential`), with the pages dropped first
    (`invalidate=1`, and direct I/O when the shape reads direct). One job reads each file whole (no
    `--size`: fio would split it evenly and refuse a shorter last shard); n jobs read a 1/n slice of
    each file each (`--size` and `--offset_increment` as percentages: no byte twice; a slice that starts
    mid-request loses that one request). A
    request is halved until the smallest file's slice holds 8 of them (a larger one reads little or
    nothing of a small file: fio reads whole requests only).
    """

    files: Sequence[Path]
    shape: FioShape = field(default_factory=FioShape)
    name: str = "g2-files-read"

    def __call__(self, index: int, nbytes: float) -> Reading:
        job = self.job()
        return _moved(run_fio(job), job, "read", index)

    def job(self) -> FioJob:
        files = [Path(f) for f in self.files]
        total = sum(f.stat().st_size for f in files)
        if not files or total <= 0:
            raise SideBySideError(f"fio read: expected files to read, found {len(files)} holding {total} bytes")
        directory = files[0].parent
        names = ":".join(str(f.relative_to(directory)) if f.parent == directory else str(f) for f in files)
        slices: tuple[str, ...] = ()
        bs = self.shape.bs_bytes
        if self.shape.numjobs > 1:
            share = f"{100 / self.shape.numjobs:g}%"
            slices = (f"--size={share}", f"--offset_increment={share}")
        smallest = min(f.stat().st_size for f in files) // self.shape.numjobs
        while bs > 4096 and 8 * bs > smallest:  # 8 requests in the smallest slice at least: a slice's last
            bs //= 2                             # partial request (not read) stays small
        return FioJob(name=self.name, directory=directory, rw="read", bs=str(bs), size=None,
                      direct=self.shape.direct, ioengine=self.shape.ioengine, iodepth=self.shape.iodepth,
                      numjobs=self.shape.numjobs,
                      extra=(f"--filename={names}", "--file_service_type=sequential", "--readonly", *slices))


@dataclass
class FioFreshWrite:
    """fio's side of a checkpoint save: a sequential write of a fresh file of at least as many bytes, in
    `shape` (the storage's best fsync'd write job), fsync'd at the end (`end_fsync=1`: a save counts as
    done once it is on the device, so fio's does too), the files removed after each round."""

    directory: Path
    shape: FioShape = field(default_factory=FioShape)
    name: str = "g2-fresh-write"

    def __call__(self, index: int, nbytes: float) -> Reading:
        job = self.job(index, nbytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            return _moved(run_fio(job), job, "write", index)
        finally:
            for path in self.directory.glob(f"{self.name}-{index}.*"):
                path.unlink(missing_ok=True)

    def job(self, index: int, nbytes: float) -> FioJob:
        block = self.shape.bs_bytes
        per_job = math.ceil(max(1.0, nbytes) / block / self.shape.numjobs) * block
        return FioJob(name=f"{self.name}-{index}", directory=self.directory, rw="write", bs=self.shape.bs,
                      size=str(per_job), direct=self.shape.direct, ioengine=self.shape.ioengine,
                      iodepth=self.shape.iodepth, numjobs=self.shape.numjobs, extra=("--end_fsync=1",))
