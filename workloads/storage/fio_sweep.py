"""The storage's own best: a short fio sweep of sequential reads and fsync'd writes, every point kept.

How it works: docs/methods/storage-best.md (workloads/storage/fio_sweep.py).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal, Optional, Sequence

from workloads.storage.fio import FioError, FioJob, FioResult, parse_size, run_fio

Kind = Literal["read", "write"]
READ_NAME = "kvgate-sweep-read"
WRITE_NAME = "kvgate-sweep-write"


@dataclass(frozen=True)
class FioShape:
    """How a sequential job moves its bytes: request size, I/O mode, engine, queue depth, jobs."""

    direct: bool = True
    ioengine: str = "libaio"
    iodepth: int = 16
    numjobs: int = 1
    bs: str = "1M"

    @property
    def bs_bytes(self) -> int:
        return parse_size(self.bs) or 1 << 20

    def describe(self) -> str:
        return (f"{'direct' if self.direct else 'buffered'}, {self.ioengine}, iodepth {self.iodepth}, "
                f"{self.numjobs} job{'s' if self.numjobs > 1 else ''}, {self.bs} requests")

    def to_dict(self) -> dict:
        return {"direct": self.direct, "ioengine": self.ioengine, "iodepth": self.iodepth, "numjobs": self.numjobs,
                "bs": self.bs}

    @classmethod
    def from_dict(cls, data: dict) -> "FioShape":
        return cls(direct=bool(data["direct"]), ioengine=str(data["ioengine"]), iodepth=int(data["iodepth"]),
                   numjobs=int(data["numjobs"]), bs=str(data["bs"]))


@dataclass(frozen=True)
class SweepGrid:
    """The sweep's axes. Read points: every (bs, mode, engine, depth, jobs) for direct reads and every
    (bs, jobs) for buffered ones; write points: every (bs, jobs, mode). `size`: bytes per point."""

    read_bs: tuple[str, ...] = ("1M", "4M", "16M")
    iodepths: tuple[int, ...] = (1, 4, 16, 32)
    numjobs: tuple[int, ...] = (1, 4)
    modes: tuple[str, ...] = ("direct", "buffered")
    ioengines: tuple[str, ...] = ("libaio", "io_uring")
    write_bs: tuple[str, ...] = ("1M", "16M")
    write_numjobs: tuple[int, ...] = (1, 4)
    write_modes: tuple[str, ...] = ("direct", "buffered")
    size: str = "512M"
    runtime_s: float = 1.0

    def read_shapes(self, engines: Sequence[str]) -> list[FioShape]:
        shapes = []
        for bs, mode in itertools.product(self.read_bs, self.modes):
            if mode == "buffered":
                shapes += [FioShape(False, "psync", 1, jobs, bs) for jobs in self.numjobs]
                continue
            shapes += [FioShape(True, engine, depth, jobs, bs)
                       for engine, depth, jobs in itertools.product(engines, self.iodepths, self.numjobs)]
        return shapes

    def write_shapes(self) -> list[FioShape]:
        return [FioShape(mode == "direct", "psync", 1, jobs, bs)
                for bs, jobs, mode in itertools.product(self.write_bs, self.write_numjobs, self.write_modes)]


@dataclass(frozen=True)
class SweepPoint:
    """One point of the sweep: its kind, shape, the job as run and fio's result."""

    kind: Kind
    shape: FioShape
    job: FioJob
    result: FioResult

    @property
    def gbps(self) -> float:
        return (self.result.read_bw_bytes if self.kind == "read" else self.result.write_bw_bytes) / 1e9

    def context(self) -> dict:
        return {"kind": self.kind, **self.shape.to_dict(), "fio": " ".join(self.job.argv()[3:])}


@dataclass
class Sweep:
    """Every point run, and what was left out (an engine this host lacks)."""

    points: list[SweepPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def best(self, kind: Kind) -> Optional[SweepPoint]:
        return best_point(self.points, kind)

    def best_per_mode(self, kind: Kind) -> dict[str, SweepPoint]:
        """The fastest direct point and the fastest buffered one of `kind` (either may be absent from a grid)."""
        picks = {mode: best_point([p for p in self.points if p.shape.direct == direct], kind)
                 for mode, direct in (("direct", True), ("buffered", False))}
        return {mode: point for mode, point in picks.items() if point is not None}


def best_point(points: Iterable[SweepPoint], kind: Kind) -> Optional[SweepPoint]:
    """The fastest point of `kind` (reads: read GB/s; writes: write GB/s), None when there is none."""
    matching = [p for p in points if p.kind == kind]
    return max(matching, key=lambda p: p.gbps) if matching else None


def _per_job(size: Optional[int], shape: FioShape) -> int:
    """Bytes each job moves: `size` over the jobs, whole requests of `shape.bs` (at least one)."""
    if size is None:
        raise FioError("sweep size: expected a plain byte size such as '512M', found a percentage or a range")
    requests = max(1, size // shape.bs_bytes // shape.numjobs)
    return requests * shape.bs_bytes


def read_job(directory: Path, grid: SweepGrid, shape: FioShape) -> FioJob:
    """A point reading the laid-out file, each job its own slice."""
    total, per_job = parse_size(grid.size), _per_job(parse_size(grid.size), shape)
    return FioJob(name=READ_NAME, directory=directory, rw="read", bs=shape.bs, size=str(per_job),
                  direct=shape.direct, ioengine=shape.ioengine, iodepth=shape.iodepth, numjobs=shape.numjobs,
                  runtime_s=None, extra=(f"--filename={READ_NAME}.data", f"--filesize={total}",
                                         f"--offset_increment={per_job}", f"--runtime={_seconds(grid.runtime_s)}"))


def write_job(directory: Path, grid: SweepGrid, shape: FioShape, index: int) -> FioJob:
    """A point writing a fresh file per job, fsync'd at the end."""
    return FioJob(name=f"{WRITE_NAME}-{index}", directory=directory, rw="write", bs=shape.bs,
                  size=str(_per_job(parse_size(grid.size), shape)), direct=shape.direct, ioengine=shape.ioengine,
                  iodepth=shape.iodepth, numjobs=shape.numjobs,
                  extra=("--end_fsync=1", f"--runtime={_seconds(grid.runtime_s)}"))


def layout_job(directory: Path, grid: SweepGrid) -> FioJob:
    """The read points' file, written and fsync'd once before the first point (not timed)."""
    return FioJob(name=READ_NAME, directory=directory, rw="write", bs="1M", size=grid.size, direct=False,
                  ioengine="psync", extra=(f"--filename={READ_NAME}.data", "--end_fsync=1"))


def _seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{math.ceil(seconds * 1000)}ms"


def available_engines(directory: Path, engines: Sequence[str], fio_binary: str = "fio") -> tuple[list[str], list[str]]:
    """The engines a one-request direct read of the laid-out file runs with, and a note per one left out."""
    usable, notes = [], []
    for engine in engines:
        probe = FioJob(name=READ_NAME, directory=directory, rw="read", bs="4k", size="4k", direct=True,
                       ioengine=engine, iodepth=1, extra=(f"--filename={READ_NAME}.data", "--readonly"))
        try:
            result = run_fio(probe, fio_binary=fio_binary, timeout_s=60)
        except FioError as error:
            notes.append(f"ioengine {engine} left out of the sweep: {str(error)[:200]}")
            continue
        if result.error:
            notes.append(f"ioengine {engine} left out of the sweep: fio reported error {result.error}")
            continue
        usable.append(engine)
    return usable, notes


def run_storage_sweep(grid: SweepGrid, directory: str | os.PathLike, fio_binary: str = "fio",
                      on_point: Callable[[SweepPoint, int, int], None] = lambda point, done, total: None) -> Sweep:
    """Every point of `grid` in `directory` (reads, then writes); `on_point(point, done, total)` after each.
    The files are removed at the end, also when a point failed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sweep = Sweep()
    try:
        run_fio(layout_job(directory, grid), fio_binary=fio_binary)
        direct_engines = [e for e in grid.ioengines] if "direct" in grid.modes else []
        engines, sweep.notes = available_engines(directory, direct_engines, fio_binary)
        if direct_engines and not engines:
            raise FioError(f"no ioengine of {list(grid.ioengines)} runs here: {'; '.join(sweep.notes)}")
        reads, writes = grid.read_shapes(engines), grid.write_shapes()
        total = len(reads) + len(writes)
        for shape in reads:
            job = read_job(directory, grid, shape)
            sweep.points.append(SweepPoint("read", shape, job, run_fio(job, fio_binary=fio_binary)))
            on_point(sweep.points[-1], len(sweep.points), total)
        for index, shape in enumerate(writes):
            job = write_job(directory, grid, shape, index)
            try:
                sweep.points.append(SweepPoint("write", shape, job, run_fio(job, fio_binary=fio_binary)))
            finally:
                _remove(directory, f"{job.name}.")
            on_point(sweep.points[-1], len(sweep.points), total)
    finally:
        _remove(directory, f"{READ_NAME}.")
    return sweep


def _remove(directory: Path, prefix: str) -> None:
    for path in directory.glob(f"{prefix}*"):
        path.unlink(missing_ok=True)
