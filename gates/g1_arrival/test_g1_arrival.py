"""G1 arrival acceptance: the delivered host and storage match the order; fio meets the spec sheet."""

from __future__ import annotations

import json

import pytest

from gates.storage_best import BEST_READ, BEST_WRITE, sweep_storage
from kvcore.rules import Threshold
from workloads.storage.fio import FioMatrix, run_matrix
from workloads.storage.inventory import capacity_of, collect_inventory

GiB = 2**30


@pytest.fixture(scope="module")
def inventory(gate_context):
    found = collect_inventory()
    (gate_context.store.raw_dir("g1") / "inventory.json").write_text(json.dumps(found, indent=1, default=str))
    return found


@pytest.fixture(scope="module")
def fio_results(gate_context):
    """The fio matrix on the storage under test, run once; raw JSON kept with the run."""
    settings = gate_context.config.fio
    matrix = FioMatrix(size=settings.size, runtime_s=settings.runtime_s, iodepth=settings.iodepth,
                       numjobs=settings.numjobs, direct=settings.direct, ioengine=settings.ioengine,
                       verify=settings.verify, verify_size=settings.verify_size)
    directory = gate_context.config.storage.path.resolve() / "fio"
    results = {r.job.name: r for r in run_matrix(matrix, directory)}
    raw = gate_context.store.raw_dir("g1")
    for name, result in results.items():
        (raw / f"fio-{name}.json").write_text(json.dumps(result.raw, indent=1))
    return results


@pytest.fixture(scope="module")
def storage_sweep(gate_context):
    """The storage's best sequential read and fsync'd write (fio.sweep), every point recorded with its raw JSON."""
    return sweep_storage(gate_context.config, gate_context.store, "g1", "storage_sweep")


@pytest.mark.parametrize("metric, kind", [(BEST_READ, "read"), (BEST_WRITE, "write")], ids=["read", "write"])
def test_storage_best_is_found_by_the_sweep(storage_sweep, verdict, metric, kind):
    """Measured (the sweep's rows are recorded as it runs), judged only against a spec-sheet threshold."""
    best = storage_sweep.best(kind)
    if best is None:
        pytest.fail(f"G1 storage sweep: no {kind} point ran (fio.sweep)", pytrace=False)
    points = sum(p.kind == kind for p in storage_sweep.points)
    notes = f"; {'; '.join(storage_sweep.notes)}" if storage_sweep.notes else ""
    verdict(f"G1 storage's best sequential {kind} ({best.shape.describe()}, best of {points} points{notes})",
            metric, best.gbps, unit="GB/s",
            unjudged_reason=f"no spec-sheet threshold for {metric} in g1.thresholds: measured as G2's yardstick")


def _judge_inventory(gate_context, verdict, label, metric, value, field, op=">=", unit=""):
    """Judge an inventory figure against the order's `inventory.<field>`; unset: measured, not judged."""
    expected = getattr(gate_context.config.inventory, field)
    rule = None
    if field == "rdma_required":
        rule = Threshold(metric, ">=", 1) if expected else None
    elif expected is not None:
        rule = Threshold(metric, op, expected)
    verdict(label, metric, value, rule=rule, unit=unit,
            unjudged_reason=f"inventory.{field} is not in the expected inventory")


def test_cpu_cores_match_the_order(gate_context, inventory, record, verdict):
    cores = inventory["cpu"].get("logical_cores")
    record("cpu_cores", cores)
    _judge_inventory(gate_context, verdict, "G1 CPU cores", "cpu_cores", cores, "min_cpu_cores")


def test_memory_matches_the_order(gate_context, inventory, record, verdict):
    total = inventory["memory"].get("total_bytes", 0) / GiB
    record("memory_gib", total, "GiB")
    _judge_inventory(gate_context, verdict, "G1 memory", "memory_gib", total, "min_memory_gib", unit="GiB")


def test_storage_capacity_is_free_at_the_storage_path(gate_context, record, verdict):
    free = capacity_of(gate_context.config.storage.path)["free_bytes"] / GiB
    record("free_gib", free, "GiB", path=str(gate_context.config.storage.path))
    _judge_inventory(gate_context, verdict, "G1 free capacity at the storage path", "free_gib", free, "min_free_gib",
                     unit="GiB")


def test_gpu_count_matches_the_order(gate_context, inventory, record, verdict):
    gpus = inventory["gpus"]
    count = gpus.get("count", 0) if gpus.get("available") else 0
    record("gpus", count)
    _judge_inventory(gate_context, verdict, "G1 GPUs", "gpus", count, "min_gpus")


def test_nics_are_present(gate_context, inventory, record, verdict):
    nics = inventory["nics"]
    count = len([n for n in nics.get("interfaces", []) if n.get("name") != "lo"]) if nics.get("available") else 0
    record("nics", count)
    _judge_inventory(gate_context, verdict, "G1 network interfaces", "nics", count, "min_nics")


def test_rdma_devices_are_present(gate_context, inventory, record, verdict):
    rdma = inventory["rdma"]
    count = rdma.get("count", len(rdma.get("devices", []))) if rdma.get("available") else 0
    record("rdma_devices", count)
    _judge_inventory(gate_context, verdict, "G1 RDMA/RoCE devices", "rdma_devices", count, "rdma_required")


FIO_CHECKS = [
    ("seq_read_gbps", "seq-read", "G1 fio sequential read 1 MiB", lambda r: r.read_bw_bytes / 1e9, "GB/s"),
    ("seq_write_gbps", "seq-write", "G1 fio sequential write 1 MiB", lambda r: r.write_bw_bytes / 1e9, "GB/s"),
    ("rand_read_iops", "rand-read", "G1 fio random read 4 KiB", lambda r: r.read_iops, "IOPS"),
    ("rand_write_iops", "rand-write", "G1 fio random write 4 KiB", lambda r: r.write_iops, "IOPS"),
    ("rand_read_p99_ms", "rand-read", "G1 fio random read 4 KiB p99 latency", lambda r: r.read_clat.p99_ns / 1e6, "ms"),
    ("mixed_70_30_iops", "rand-rw-70-30", "G1 fio mixed 70/30 4 KiB", lambda r: r.iops, "IOPS"),
]


@pytest.mark.parametrize("metric, job, label, figure, unit", FIO_CHECKS, ids=[c[0] for c in FIO_CHECKS])
def test_fio_meets_the_spec_sheet(fio_results, record, verdict, metric, job, label, figure, unit):
    result = fio_results[job]
    value = figure(result)
    record(metric, value, unit, job=job, fio=" ".join(result.job.argv()[3:12]))
    verdict(label, metric, value, unit=unit)


def test_fio_verify_is_clean_on_written_data(gate_context, fio_results, record, verdict):
    if not gate_context.config.fio.verify:
        pytest.skip("fio.verify is off: nothing written was verified")
    result = next(r for name, r in fio_results.items() if name.startswith("verify-"))
    errors = 0 if result.verify_ok else 1
    record("fio_verify_errors", errors, detail=result.verify_errors[:500])
    verdict("G1 fio crc32c verify", "fio_verify_errors", errors)
