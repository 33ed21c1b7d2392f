"""The storage's best sequential read and fsync'd write, found once per run and read by the gates after.

G1 runs the sweep (`fio.sweep`, workloads/storage/fio_sweep.py) on `storage.path` and records every point
(`storage_sweep_point`, its raw fio JSON in the gate's raw dir) and the two winners
(`storage_best_read_gbps`, `storage_best_write_gbps`, their context the winning job's shape and
the winner of each I/O mode, direct and buffered). G2 reads those records from the run store
(`storage_best`); when G1 did not run in this run (`kvgate run g2`), G2 runs the sweep itself first,
records it under g2 and says so. The figures themselves never divide a G2 ratio: G2 runs the
winners again beside each of its subjects, every mode's winner in every round, and the faster one
of the round is its yardstick (`best_of`): one winner picked from ~20 one-second points is picked by
that second's noise as much as by its shape. The G2 run that had one winner, a direct QD32 16 MiB
read at 3.14 GB/s in G1's sweep, read 0.53 GB/s (median) beside the tier's 124 MiB loads and
2.14 beside the model loaders; the tier "passed" at 199% [84, 471].
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from gates.side_by_side import FasterOf, FioRound
from workloads.storage.fio_sweep import FioShape, Kind, Sweep, SweepPoint, run_storage_sweep

BEST_READ, BEST_WRITE, POINT = "storage_best_read_gbps", "storage_best_write_gbps", "storage_sweep_point"
SWEEP_DIR = "fio-sweep"       # under storage.path


@dataclass(frozen=True)
class StorageBest:
    """The winning read and write shapes, their sweep figures, each I/O mode's winner, and where they come from."""

    read: FioShape
    write: FioShape
    read_gbps: float
    write_gbps: float
    source: str          # "G1's sweep" or "G2's own sweep (G1 did not run in this run)"
    # each mode's winner ("direct", "buffered") with its sweep GB/s; the overall winner alone when not recorded
    reads: dict[str, tuple[FioShape, float]] = field(default_factory=dict)
    writes: dict[str, tuple[FioShape, float]] = field(default_factory=dict)
    # every point of the sweep: (kind, shape, GB/s), for `for_bytes`
    points: tuple[tuple[str, FioShape, float], ...] = ()
    streams: Optional[float] = None    # the bytes `for_bytes` chose the modes' picks for (None: the sweep's winners)

    def for_bytes(self, nbytes: float) -> "StorageBest":
        """The same, each I/O mode's pick the fastest sweep point that streams `nbytes` (`streams`): a job whose
        queue holds more than half the bytes to move never settles into a stream, so what it gives is its
        start, not the storage's rate. The sweep moves 512 MiB a point, the subjects less: G2's cold read
        reads 128 MiB beside each tier load, and there the sweep's direct winner (libaio QD32 x 16 MiB, 512
        MiB in flight: its 8 requests all sent at once) read 0.37-1.36 GB/s in 5 pairs while fio in the tier's
        own pattern (libaio QD16 x 1 MiB, 16 MiB in flight) read 1.78-2.41. A mode with no such point keeps its
        winner."""
        if not self.points:
            return self
        return replace(self, reads=self._streaming("read", nbytes), writes=self._streaming("write", nbytes),
                       streams=nbytes)

    def _streaming(self, kind: str, nbytes: float) -> dict[str, tuple[FioShape, float]]:
        picks = dict(self.per_mode(kind))
        for mode in picks:
            fitting = [(shape, gbps) for k, shape, gbps in self.points
                       if k == kind and shape.direct == (mode == "direct") and in_flight(shape) <= nbytes / 2]
            if fitting:
                picks[mode] = max(fitting, key=lambda pick: pick[1])
        return picks

    def winner(self, kind: str = "read") -> tuple[FioShape, float]:
        """The sweep's overall winning shape of `kind` and its GB/s."""
        return (self.read, self.read_gbps) if kind == "read" else (self.write, self.write_gbps)

    def per_mode(self, kind: str = "read") -> dict[str, tuple[FioShape, float]]:
        """Each I/O mode's winning shape and its sweep GB/s (at least the overall winner)."""
        modes = self.reads if kind == "read" else self.writes
        if modes:
            return modes
        shape, gbps = self.winner(kind)
        return {"direct" if shape.direct else "buffered": (shape, gbps)}

    def describe(self, kind: str = "read") -> str:
        """"direct, libaio, ... 16M requests: 3.14 GB/s, or buffered, ...: 2.50 GB/s, the faster each round, in
        G1's sweep" (one mode: that job alone)."""
        jobs = [f"{shape.describe()}: {gbps:.2f} GB/s" for shape, gbps in self.per_mode(kind).values()]
        where = self.source if self.streams is None else f"{self.source}, of the jobs that stream " \
                                                         f"{self.streams / 2**20:.0f} MiB"
        if len(jobs) == 1:
            return f"{jobs[0]} in {where}"
        return f"{' or '.join(jobs)}, the faster each round, in {where}"

    def best_of(self, kind: str, side: Callable[[str, FioShape], FioRound]) -> FasterOf:
        """The yardstick of a round: `side(mode, shape)` for each mode's winner, the faster one counted."""
        return FasterOf({mode: side(mode, shape) for mode, (shape, _) in self.per_mode(kind).items()})

    def context(self, kind: str = "read") -> dict:
        """The yardstick as a record's context: the overall winner, each mode's winner, the source."""
        return {
            "best": self.winner(kind)[0].to_dict(),
            "best_source": self.source,
            "best_modes": {
                mode: {**s.to_dict(), "sweep_gbps": gbps} for mode, (s, gbps) in self.per_mode(kind).items()
            },
            **({"best_streams_bytes": self.streams} if self.streams is not None else {}),
        }


def in_flight(shape: FioShape) -> int:
    """The bytes a job keeps in flight: its requests' size times its queue depth times its jobs."""
    return shape.bs_bytes * shape.iodepth * shape.numjobs


def record_point(store, gate: str, check: str, point: SweepPoint, index: int) -> None:
    """One sweep point as a run-store row of `gate`, its raw fio JSON in the gate's raw dir."""
    name = f"fio-sweep-{index:02d}-{point.kind}.json"
    (store.raw_dir(gate) / name).write_text(json.dumps(point.result.raw, indent=1))
    store.record(gate, check, POINT, point.gbps, "GB/s", index=index, raw=name, **point.context())


def record_winners(store, gate: str, check: str, sweep: Sweep) -> None:
    """The fastest read and write of the sweep, with the winning job's shape, as rows of `gate`."""
    winners: tuple[tuple[str, Kind], ...] = ((BEST_READ, "read"), (BEST_WRITE, "write"))
    for metric, kind in winners:
        best = sweep.best(kind)
        if best is not None:
            modes = {mode: {**p.shape.to_dict(), "gbps": p.gbps} for mode, p in sweep.best_per_mode(kind).items()}
            store.record(gate, check, metric, best.gbps, "GB/s", points=sum(p.kind == kind for p in sweep.points),
                         notes=sweep.notes, modes=modes, **best.context())


def sweep_storage(config, store, gate: str, check: str) -> Sweep:
    """Run `config.fio.sweep` on `config.storage.path` with live progress, each point recorded under `gate`
    as it comes (a crash loses nothing already measured), then the winners."""
    directory = config.storage.path.resolve() / SWEEP_DIR

    def on_point(point: SweepPoint, done: int, total: int) -> None:
        record_point(store, gate, check, point, done - 1)
        store.set_progress(gate, f"storage sweep: point {done} / {total}, {point.kind} {point.shape.describe()}: "
                                 f"{point.gbps:.2f} GB/s")

    sweep = run_storage_sweep(config.fio.sweep.grid(), directory, on_point=on_point)
    record_winners(store, gate, check, sweep)
    return sweep


def _recorded(store, gate: str, source: str) -> Optional[StorageBest]:
    read, write = store.latest(gate, BEST_READ), store.latest(gate, BEST_WRITE)
    if read is None or write is None:
        return None
    points = tuple((str(row["context"]["kind"]), FioShape.from_dict(row["context"]), float(row["value"]))
                   for row in store.measurements(gate) if row["metric"] == POINT and row["value"] is not None)
    return StorageBest(FioShape.from_dict(read["context"]), FioShape.from_dict(write["context"]),
                       float(read["value"]), float(write["value"]), source, _modes(read), _modes(write), points)


def _modes(row: dict) -> dict[str, tuple[FioShape, float]]:
    return {mode: (FioShape.from_dict(shape), float(shape["gbps"]))
            for mode, shape in (row["context"].get("modes") or {}).items()}


def storage_best(config, store, gate: str = "g2") -> StorageBest:
    """G1's winners in this run; else `gate`'s own, swept now when it has none yet (and said so)."""
    found = _recorded(store, "g1", "G1's sweep")
    if found is not None:
        return found
    source = f"{gate.upper()}'s own sweep (G1 did not run in this run)"
    found = _recorded(store, gate, source)
    if found is None:
        sweep_storage(config, store, gate, "storage_sweep")
        found = _recorded(store, gate, source)
    if found is None:
        raise RuntimeError("the storage sweep gave no read or no write point (fio.sweep)")
    return found
