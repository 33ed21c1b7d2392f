"""`kvgate cache-bench` (a): the disk tier's cold load against the storage's best, side by side.

The yardstick is the storage's own best (DESIGN.md): a quick sweep of sequential reads on the bench's
directory first (`BENCH_GRID`, workloads/storage/fio_sweep.py; reads only), then, per I/O mode of the tier
(O_DIRECT; buffered with each block's pages dropped), `rounds` rounds alternating the tier's cold load
of the whole prefix with the sweep's best direct and best buffered jobs reading as many bytes (the faster
of the two is the round's yardstick, judged), and two
diagnostics: fio in the tier's own pattern (1 MiB, its I/O mode, a job per read worker) and fio
reading one file per block, the tier's own layout. The ratio is the geometric mean of the rounds'
ratios with Lai's anytime-valid interval (kvcore.sequential.log_ratio_sequence); the tier's read path
is what it is: this module measures it, it does not move the yardstick to meet it.
"""

from __future__ import annotations

import math
import os
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional

from gates.side_by_side import FasterOf, FioRegions
from kvcore.sequential import METHOD, log_ratio_sequence
from workloads.storage.fio import FioJob, run_fio
from workloads.storage.fio_sweep import SweepGrid, run_storage_sweep

MODES = (("direct", True), ("buffered_cold", False))
# reads only: request size, queue depth, jobs, engine and mode; ~20 points of at most 1 s
BENCH_GRID = SweepGrid(read_bs=("1M", "16M"), iodepths=(4, 32), numjobs=(1, 4), write_bs=(), size="512M",
                       runtime_s=1.0)


def _interval(ours: list[float], best: list[float]) -> tuple[float, Optional[list[float]]]:
    """Geometric mean of the rounds' ratios and its anytime-valid interval (None while unbounded)."""
    value, (lo, hi) = log_ratio_sequence(ours, best)
    return value, ([lo, hi] if lo > 0 and math.isfinite(hi) else None)


def _same_pattern_job(fio_dir: Path, mode: str, direct: bool, workers: int, prefix_mib: int) -> FioJob:
    """fio in the tier's own pattern: 1 MiB sequential reads in its I/O mode, a psync job per read worker."""
    return FioJob(name=f"seqread-{mode}", directory=fio_dir, rw="read", bs="1M",
                  size=f"{max(1, prefix_mib // workers)}M", direct=direct, numjobs=workers)


def _same_layout_job(fio_dir: Path, mode: str, direct: bool, workers: int, block_bytes: int,
                     n_blocks: int) -> FioJob:
    """fio reading one whole file per block, files the size of the tier's block files."""
    file_bytes = block_bytes + 8192  # header + payload, rounded up generously
    per_job = max(1, n_blocks // workers)
    return FioJob(
        name=f"blockfiles-{mode}", directory=fio_dir, rw="read", bs=str(file_bytes), size=str(per_job * file_bytes),
        direct=direct, numjobs=workers,
        extra=(f"--nrfiles={per_job}", f"--filesize={file_bytes}", "--file_service_type=sequential"),
    )


def bench_disk_against_the_best(directory: Path, nbytes: int, block_bytes: int, n_blocks: int, workers: int,
                                prefix_mib: int, rounds: int, tier_load: Callable[[str], float],
                                grid: SweepGrid = BENCH_GRID) -> dict:
    """The sweep, then per mode `rounds` rounds: `tier_load(io_mode)` (seconds for `nbytes`), the best jobs,
    the same-pattern and same-layout diagnostics.

    The yardstick of a round is the faster of the sweep's best direct job and its best buffered job, both run
    in the round: one winner picked from ~20 one-second points is picked by that second's noise as much as by
    its shape (the winner, direct QD32 1 job, read 2.31 GB/s in the sweep and 0.63-0.82 in the rounds while
    4 buffered jobs read 1.4-1.6), and the storage's best mode itself changes from minute to minute here.
    Rounds alternate their order (tier first, then the best jobs first), so what the one before leaves
    behind (a cache below a virtual machine, the device's queue) falls on both sides alike."""
    fio_dir = directory / "fio"
    sweep = run_storage_sweep(grid, directory / "sweep")
    bests = sweep.best_per_mode("read")
    overall = sweep.best("read")
    if overall is None:
        raise RuntimeError(f"cache-bench: expected the storage sweep to have measured reads, found none "
                           f"({len(sweep.points)} points)")
    results = {"best": {**overall.shape.to_dict(), "sweep_gbps": overall.gbps, "points": len(sweep.points),
                        "notes": sweep.notes, "describe": overall.shape.describe(),
                        "shapes": {mode: {**p.shape.to_dict(), "sweep_gbps": p.gbps, "describe": p.shape.describe()}
                                   for mode, p in bests.items()}}}
    # One region per best job, re-read every round with its pages dropped, as the tier re-reads its one stored
    # prefix: the same bytes, age and footprint on both sides (FioRegions). Ten regions, one a round, put
    # 2.5 GiB beside the tier's 256 MiB: the same best job read the first five at a median 1.17 GB/s and the
    # last five at 0.63.
    with ExitStack() as stack:
        sides = {mode: stack.enter_context(FioRegions(fio_dir, rounds=1, shape=p.shape, name=f"best-{mode}"))
                 for mode, p in bests.items()}
        for mode, direct in MODES:
            own = _same_pattern_job(fio_dir, mode, direct, workers, prefix_mib)
            layout = _same_layout_job(fio_dir, mode, direct, workers, block_bytes, n_blocks)
            run_fio(own), run_fio(layout)  # lay out fio's files before anything is timed
            tier_bw, best_bw, own_bw, layout_bw = [], [], [], []
            yardstick = FasterOf(sides)

            def best_jobs() -> None:
                best_bw.append(yardstick(0, nbytes).gbps * 1e9)   # round 0: the best jobs in the sweep's order

            for r in range(rounds):
                if r % 2:
                    best_jobs()
                tier_bw.append(nbytes / tier_load("direct" if direct else "buffered"))
                if not r % 2:
                    best_jobs()
                own_bw.append(run_fio(own).read_bw_bytes)
                layout_bw.append(run_fio(layout).read_bw_bytes)
            by_shape = {name: [readings[name].gbps * 1e9 for _, readings in yardstick.runs] for name in sides}
            for path in fio_dir.glob("seqread-*"):
                path.unlink(missing_ok=True)
            for path in fio_dir.glob("blockfiles-*"):
                path.unlink(missing_ok=True)
            ratio, interval = _interval(tier_bw, best_bw)
            results[mode] = {
                "tier_gbps": statistics.median(tier_bw) / 1e9, "best_gbps": statistics.median(best_bw) / 1e9,
                "ratio": ratio, "interval": interval, "interval_method": METHOD,
                "ratio_rounds": [t / b for t, b in zip(tier_bw, best_bw)],
                "fio_same_pattern_gbps": statistics.median(own_bw) / 1e9,
                "ratio_same_pattern": _interval(tier_bw, own_bw)[0],
                "fio_same_layout_gbps": statistics.median(layout_bw) / 1e9,
                "ratio_same_layout": _interval(tier_bw, layout_bw)[0],
                "tier_rounds_gbps": [b / 1e9 for b in tier_bw], "best_rounds_gbps": [b / 1e9 for b in best_bw],
                "best_rounds_gbps_by_shape": {name: [b / 1e9 for b in bw] for name, bw in by_shape.items()},
                "fio_same_pattern_rounds_gbps": [b / 1e9 for b in own_bw],
                "fio_same_layout_rounds_gbps": [b / 1e9 for b in layout_bw],
                "best_jobs": {name: " ".join(side.read_job(0).argv()[3:12]) for name, side in sides.items()},
                "fio_same_pattern_job": " ".join(own.argv()[3:11]),
                "fio_same_layout_job": " ".join(layout.argv()[3:11] + list(layout.extra)),
            }
    if fio_dir.is_dir() and not any(fio_dir.iterdir()):
        os.rmdir(fio_dir)
    return results
