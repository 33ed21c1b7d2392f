"""fio's sides for G2's model-load and checkpoint comparisons, with real fio, in the storage's best job's
shape: the loader's own files read whole (or a slice per job) and untouched, and a fresh write fsync'd
and cleaned up."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from gates.side_by_side import FIO_BLOCK, FioFilesRead, FioFreshWrite, FioShape, SideBySideError
from kvcore.files import drop_cached_pages

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_fio
@pytest.mark.parametrize("direct, numjobs", [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_fio_reads_every_byte_of_the_subjects_files_once_and_changes_none(tmp_path, direct, numjobs):
    # shards of unequal size, as a model's last shard is: fio must read each whole, not an even split
    shards = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
    shards[0].write_bytes(b"\x01" * (6 * FIO_BLOCK + 4096))
    shards[1].write_bytes(b"\x02" * (2 * FIO_BLOCK))
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size, _digest(p)) for p in shards}
    drop_cached_pages(shards)
    reading = FioFilesRead(shards, FioShape(direct=direct, ioengine="libaio", iodepth=4, numjobs=numjobs))(0, 0)
    # every whole request of both, once (the 4 KiB tail is no request); two jobs read half of each file each
    # in 128 KiB requests (8 fit the smaller file's 1 MiB half), and the slice that starts mid-request (the
    # first shard's half is 3 MiB + 2 KiB) loses that one request
    assert reading.nbytes == 8 * FIO_BLOCK - (0 if numjobs == 1 else 128 << 10)
    assert reading.seconds > 0
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size, _digest(p)) for p in shards} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in shards)   # no probe, no layout


def test_fio_files_read_needs_files_with_bytes(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(SideBySideError, match="expected files to read"):
        FioFilesRead([empty]).job()


@needs_fio
def test_fio_fresh_write_moves_at_least_the_subjects_bytes_fsyncd_and_leaves_nothing(tmp_path):
    side = FioFreshWrite(tmp_path / "fio", FioShape(direct=True, ioengine="libaio", iodepth=4, numjobs=2))
    argv = side.job(3, 5 * FIO_BLOCK + 1).argv()
    assert {"--rw=write", "--end_fsync=1", "--numjobs=2", f"--size={3 * FIO_BLOCK}"} <= set(argv)
    reading = side(3, 5 * FIO_BLOCK + 1)
    assert reading.nbytes == 6 * FIO_BLOCK          # whole 1 MiB requests, split over the jobs
    assert reading.gbps > 0
    assert list((tmp_path / "fio").iterdir()) == []


def test_a_request_is_halved_until_the_smallest_slice_holds_eight(tmp_path):
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"\x01" * (8 * FIO_BLOCK))
    argv = (
        FioFilesRead([shard], FioShape(direct=True, ioengine="io_uring", iodepth=32, numjobs=4, bs="16M")).job().argv()
    )
    assert {"--bs=262144", "--numjobs=4", "--size=25%", "--offset_increment=25%", "--readonly"} <= set(argv)
