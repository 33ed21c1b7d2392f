"""The storage sweep: its job grid, a real short sweep with real fio, the best pick, and the run store's
copy of it that G2 reads (or sweeps itself when G1 did not run)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gates.side_by_side import Pair, Reading
from gates.storage_best import BEST_READ, BEST_WRITE, POINT, record_winners, storage_best
from kvcore.rundata import RunStore
from workloads.storage.fio import FioError
from workloads.storage.fio_sweep import FioShape, Sweep, SweepGrid, best_point, read_job, run_storage_sweep, write_job
from workloads.storage.settings import FioSweepConfig

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")
TINY = SweepGrid(read_bs=("1M",), iodepths=(1, 4), numjobs=(1, 2), modes=("direct", "buffered"),
                 ioengines=("libaio",), write_bs=("1M",), write_numjobs=(2,), write_modes=("buffered",),
                 size="8M", runtime_s=1)
ONE_EACH = SweepGrid(read_bs=("1M",), iodepths=(4,), numjobs=(1,), modes=("direct",), ioengines=("libaio",),
                     write_bs=("1M",), write_numjobs=(1,), write_modes=("buffered",), size="8M", runtime_s=1)


def test_the_grid_holds_every_direct_point_and_buffered_reads_as_psync_jobs_at_depth_one():
    shapes = TINY.read_shapes(["libaio"])
    direct = [s for s in shapes if s.direct]
    buffered = [s for s in shapes if not s.direct]
    assert len(direct) == 2 * 2                     # depth x jobs
    assert {(s.bs, s.iodepth, s.numjobs) for s in direct} == {("1M", d, j) for d in (1, 4) for j in (1, 2)}
    assert {(s.ioengine, s.iodepth) for s in buffered} == {("psync", 1)} and len(buffered) == 2
    assert TINY.write_shapes() == [FioShape(False, "psync", 1, 2, "1M")]
    assert len(SweepGrid().read_shapes(["libaio", "io_uring"])) == 3 * 2 * 4 * 2 + 3 * 2


def test_each_read_point_reads_its_slice_of_one_file_once_and_each_write_is_fsyncd(tmp_path):
    argv = read_job(tmp_path, TINY, FioShape(True, "libaio", 4, 2, "1M")).argv()
    assert {"--rw=read", "--numjobs=2", f"--size={4 << 20}", f"--offset_increment={4 << 20}", "--runtime=1",
            "--invalidate=1"} <= set(argv)
    assert "--time_based" not in argv                # a second pass of a buffered read would be the page cache's
    assert "--zero_buffers" in argv                  # a read's buffers touched before timing, as a reader's are
    argv = write_job(tmp_path, TINY, FioShape(False, "psync", 1, 2, "1M"), 3).argv()
    assert {"--rw=write", "--end_fsync=1", "--numjobs=2", f"--size={4 << 20}", "--direct=0"} <= set(argv)
    assert "--zero_buffers" not in argv              # zeros would flatter a storage that compresses


def test_a_grid_size_that_is_not_plain_bytes_is_a_fio_error_not_a_type_error(tmp_path):
    grid = replace(TINY, size="50%")                 # fio takes it; a point's share of it is not known
    for job in (lambda: read_job(tmp_path, grid, FioShape(True, "libaio", 4, 2, "1M")),
                lambda: write_job(tmp_path, grid, FioShape(False, "psync", 1, 2, "1M"), 0)):
        with pytest.raises(FioError, match="sweep size: expected a plain byte size"):
            job()


def test_the_config_gives_the_grid_it_validated():
    grid = FioSweepConfig(read_bs=["1M"], iodepths=[8], numjobs=[1], size="64M", runtime_s=2).grid()
    assert grid.read_bs == ("1M",) and grid.iodepths == (8,) and grid.size == "64M" and grid.runtime_s == 2


@needs_fio
def test_a_real_sweep_runs_every_point_keeps_them_all_and_picks_the_fastest(tmp_path):
    seen = []
    sweep = run_storage_sweep(TINY, tmp_path / "sweep", on_point=lambda point, done, total: seen.append((done, total)))
    expected = len(TINY.read_shapes(["libaio"])) + len(TINY.write_shapes())
    assert len(sweep.points) == expected and seen[-1] == (expected, expected)
    for point in sweep.points:
        assert point.gbps > 0 and point.result.error == 0
        assert point.result.raw["jobs"]                        # fio's own JSON, parsed
    reads = [p for p in sweep.points if p.kind == "read"]
    assert sweep.best("read") is max(reads, key=lambda p: p.gbps)
    assert sweep.best("write").kind == "write" and best_point([], "read") is None
    per_mode = sweep.best_per_mode("read")                     # each I/O mode's own winner
    assert set(per_mode) == {"direct", "buffered"}
    for mode, direct in (("direct", True), ("buffered", False)):
        assert per_mode[mode] is max((p for p in reads if p.shape.direct == direct), key=lambda p: p.gbps)
    assert set(sweep.best_per_mode("write")) == {"buffered"}   # the grid writes buffered only
    assert list((tmp_path / "sweep").iterdir()) == []          # laid-out and written files removed


@needs_fio
def test_g2_reads_g1s_best_from_the_run_store_and_sweeps_itself_when_g1_did_not_run(tmp_path):
    config = SimpleNamespace(storage=SimpleNamespace(path=tmp_path / "storage"),
                             fio=SimpleNamespace(sweep=SimpleNamespace(grid=lambda: ONE_EACH)))
    store = RunStore(tmp_path / "run")
    alone = storage_best(config, store)                       # no G1 rows: G2 sweeps, records and says so
    assert "G2's own sweep (G1 did not run" in alone.source
    points = [m for m in store.measurements("g2") if m["metric"] == POINT]
    assert len(points) == 2 and {m["context"]["kind"] for m in points} == {"read", "write"}
    assert all((store.raw_dir("g2") / m["context"]["raw"]).is_file() for m in points)
    assert json.loads((store.raw_dir("g2") / points[0]["context"]["raw"]).read_text())["jobs"]
    assert max(m["value"] for m in points if m["context"]["kind"] == "read") == store.latest("g2", BEST_READ)["value"]
    assert storage_best(config, store) == alone                # the second module of G2 reads it, no second sweep
    assert len([m for m in store.measurements("g2") if m["metric"] == POINT]) == len(points)
    best = FioShape(True, "io_uring", 32, 4, "16M")
    store.record("g1", "storage_sweep", BEST_READ, 5.2, "GB/s", kind="read", **best.to_dict())
    store.record(
        "g1", "storage_sweep", BEST_WRITE, 2.1, "GB/s", kind="write", **FioShape(False, "psync", 1, 4).to_dict()
    )
    found = storage_best(config, store)                        # G1 ran: its winners, whatever G2 measured
    assert found.read == best and found.read_gbps == 5.2 and found.source == "G1's sweep"


def test_each_modes_winner_is_recorded_and_both_run_beside_the_subject_the_faster_counted(tmp_path):
    def point(kind, shape, gbps):
        return SimpleNamespace(kind=kind, shape=shape, gbps=gbps, context=lambda: {"kind": kind, **shape.to_dict()})

    direct, buffered = FioShape(True, "libaio", 32, 1, "16M"), FioShape(False, "psync", 1, 4, "16M")
    sweep = Sweep([point("read", direct, 3.1), point("read", buffered, 2.5), point("write", buffered, 1.0)])
    store = RunStore(tmp_path / "run")
    record_winners(store, "g1", "storage_sweep", sweep)
    config = SimpleNamespace(storage=SimpleNamespace(path=tmp_path / "storage"))
    best = storage_best(config, store)
    assert best.read == direct and best.per_mode("read") == {"direct": (direct, 3.1), "buffered": (buffered, 2.5)}
    assert best.per_mode("write") == {"buffered": (buffered, 1.0)}
    assert best.describe("read").endswith("2.50 GB/s, the faster each round, in G1's sweep")
    assert " or " not in best.describe("write")                 # one mode: that job alone
    assert best.context("read")["best_modes"]["buffered"]["sweep_gbps"] == 2.5

    # the yardstick of a round: both modes' jobs run, the faster counted; odd rounds run them in reverse
    ran = []
    speeds = {0: {"direct": 0.5, "buffered": 2.0}, 1: {"direct": 3.0, "buffered": 1.0}}

    def side(mode, shape):
        def run(index, nbytes):
            ran.append((index, mode))
            return Reading(nbytes, nbytes / (speeds[index][mode] * 1e9))
        return run

    yardstick = best.best_of("read", side)
    first, second = yardstick(0, 1e9), yardstick(1, 1e9)
    assert ran == [(0, "direct"), (0, "buffered"), (1, "buffered"), (1, "direct")]
    assert round(first.gbps, 6) == 2.0 and round(second.gbps, 6) == 3.0
    assert yardstick.round_context(0) == {"best_direct_gbps": 0.5, "best_buffered_gbps": 2.0}
    pairs = [Pair(i, Reading(1, 1), r) for i, r in enumerate((first, second))]
    assert yardstick.describe_wins(pairs) == "the faster: direct in 1, buffered in 1 runs"
    assert yardstick.describe_wins(pairs[:1]) == "the faster: direct in 0, buffered in 1 runs"
    assert best.best_of("write", side).describe_wins(pairs) == ""   # one side: nothing to say


def test_for_a_subjects_bytes_each_mode_runs_its_fastest_job_that_streams_them(tmp_path):
    """A job with more than half the bytes to move in flight never streams: G2's 128 MiB regions are read by each
    mode's fastest point whose queue holds at most 64 MiB; a mode with none keeps its winner."""
    def point(kind, shape, gbps):
        return SimpleNamespace(kind=kind, shape=shape, gbps=gbps, context=lambda: {"kind": kind, **shape.to_dict()})

    deep = FioShape(True, "libaio", 32, 1, "16M")           # 512 MiB in flight
    shallow, tiny = FioShape(True, "libaio", 32, 1, "1M"), FioShape(True, "libaio", 4, 1, "1M")   # 32 / 4 MiB
    buffered = FioShape(False, "psync", 1, 4, "16M")       # 64 MiB
    between = FioShape(True, "libaio", 6, 1, "16M")         # 96 MiB: fits in 128, not in half of it
    write = FioShape(True, "psync", 1, 4, "16M")
    sweep = Sweep([point("read", deep, 3.1), point("read", shallow, 2.2), point("read", tiny, 1.0),
                   point("read", between, 2.5), point("read", buffered, 1.8), point("write", write, 2.0)])
    store = RunStore(tmp_path / "run")
    for i, p in enumerate(sweep.points):
        store.record("g1", "storage_sweep", POINT, p.gbps, "GB/s", index=i, **p.context())
    record_winners(store, "g1", "storage_sweep", sweep)
    best = storage_best(SimpleNamespace(storage=SimpleNamespace(path=tmp_path)), store)
    assert best.per_mode("read")["direct"] == (deep, 3.1) and len(best.points) == 6

    region = best.for_bytes(128 << 20)
    assert region.per_mode("read") == {"direct": (shallow, 2.2), "buffered": (buffered, 1.8)}
    assert region.per_mode("write") == {"direct": (write, 2.0)}        # 64 MiB in flight: streams 128 MiB
    assert region.read == deep                                        # the sweep's winner is still said as such
    assert region.describe("read").endswith("in G1's sweep, of the jobs that stream 128 MiB")
    assert region.context("read")["best_streams_bytes"] == 128 << 20
    small = best.for_bytes(16 << 20)
    assert small.per_mode("read") == {"direct": (tiny, 1.0), "buffered": (buffered, 1.8)}   # none fits: its winner
    assert small.per_mode("write") == {"direct": (write, 2.0)}
    assert best.for_bytes(4 << 30).per_mode("read")["direct"] == (deep, 3.1)   # 4 GiB: the winner streams it
