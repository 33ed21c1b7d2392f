"""Checkpoint save and restore through torch.distributed.checkpoint from 2 real gloo ranks.

~32 MiB of state, so the file runs in seconds. The out-of-space test mounts a real 16 MiB tmpfs
(root only; skipped, saying so, elsewhere).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from kvcore.settings import ConfigError
from tests.torch_probe import imports_torch
from workloads.storage.checkpoint import (
    KVGATE_WRITER,
    READERS,
    STATE_PRESETS,
    WRITERS,
    CheckpointError,
    CheckpointJob,
    CheckpointSpec,
    RestoreRound,
    SaveRound,
    looks_complete,
    rounds_agree,
    spread,
)
from workloads.storage.rank_group import RankFailure

SPEC = CheckpointSpec.for_state_bytes(32 * 2**20, ranks=2, tensor_bytes=2 * 2**20, seed=7)
SMALL_FS_MIB = 16


@pytest.fixture(scope="module")
def job():
    with CheckpointJob(SPEC, thread_count=2, round_timeout_s=120) as running:
        yield running


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount_point, fs_type = line.split()[:3]
        if str(path.resolve()).startswith(mount_point.rstrip("/") + "/") and len(mount_point) > len(best):
            best, kind = mount_point, fs_type
    return kind


# --- the state: presets and sizes (arithmetic only, nothing written) ---

def test_presets_give_mlperfs_bytes_per_parameter():
    eight = CheckpointSpec.from_preset("8b", ranks=8)
    assert eight.total_bytes == STATE_PRESETS["8b"] * 14          # 112.4 GB
    assert 112e9 < eight.total_bytes < 113e9
    assert CheckpointSpec.from_preset("70b").total_bytes == 70_553_706_496 * 14
    assert CheckpointSpec.from_preset("1t", ranks=64).total_bytes > 18e12
    adapter = CheckpointSpec.from_preset("adapter")
    assert adapter.total_bytes == 134_217_728 * 14               # 1.88 GB: a LoRA adapter with Adam state


def test_bytes_per_parameter_scales_the_optimizer_state_and_tensors_keep_their_cap():
    spec = CheckpointSpec(parameters=3_000_000, bytes_per_parameter=8, ranks=3, tensor_bytes=1 << 20)
    tensors = [t for r in range(3) for t in spec.rank_tensors(r)]
    weights = sum(t.numel for t in tensors if t.path[0] == "model")
    exp_avg = sum(t.numel for t in tensors if t.path[-1] == "exp_avg")
    assert weights == 3_000_000 and abs(exp_avg - weights / 2) <= len(tensors)
    assert max(t.nbytes for t in tensors) <= 1 << 20
    assert spec.total_bytes == sum(t.nbytes for t in tensors)
    assert abs(spec.total_bytes - 8 * 3_000_000) <= 12 * len(tensors)
    weights_only = CheckpointSpec(parameters=1000, bytes_per_parameter=2, ranks=2)
    assert {t.path[0] for r in range(2) for t in weights_only.rank_tensors(r)} == {"model"}
    assert weights_only.total_bytes == 2000
    assert 0.99 * 2**29 < CheckpointSpec.for_state_bytes(2**29).total_bytes <= 2**29


@pytest.mark.parametrize("fields, named", [({"parameters": 1, "ranks": 2}, "checkpoint.parameters"),
                                           ({"parameters": 10, "bytes_per_parameter": 1}, "bytes_per_parameter"),
                                           ({"parameters": 10, "ranks": 0}, "checkpoint.ranks")])
def test_a_bad_spec_names_its_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        CheckpointSpec(**fields)
    with pytest.raises(ConfigError, match="'9b'"):
        CheckpointSpec.from_preset("9b")


# --- figures of a round ---

def test_the_slowest_rank_sets_the_rounds_time_and_bandwidth():
    save = SaveRound("d", rank_seconds=(1.0, 4.0, 2.0), nbytes=8_000_000_000, files=(".metadata",), ok=True)
    assert save.seconds == 4.0 and save.gbps == 2.0
    restore = RestoreRound("d", (3.0, 1.0), (5 * 10**9, 5 * 10**9), 9 * 10**9, equal=True, ok=True)
    assert restore.seconds == 3.0 and restore.gbps == 3.0 and restore.cold
    failed = SaveRound("d", (1.0,), 100, (), ok=False, error="rank 0: boom")
    assert failed.gbps == 0.0


def test_rounds_agree_when_their_spread_is_within_five_percent_of_the_median():
    assert spread([1.0, 1.02, 1.04]) == pytest.approx(0.04 / 1.02)
    assert rounds_agree([1.0, 1.02, 1.04])
    assert not rounds_agree([1.0, 1.06])
    assert rounds_agree([2.0])


def test_the_parent_side_does_not_import_torch(tmp_path):
    assert not imports_torch("import workloads.storage.checkpoint", tmp_path)


# --- real rounds, 2 ranks ---

@pytest.mark.parametrize("writer", WRITERS)
def test_save_then_restore_gives_the_state_back_bit_for_bit_through_either_reader(job, tmp_path, writer):
    save = job.save(tmp_path / "ckpt", writer=writer)
    assert save.ok, save.error
    assert save.writer == writer and save.context()["writer"] == writer
    if writer == KVGATE_WRITER and _filesystem_type(tmp_path) == "ext4":
        assert save.direct                             # every rank's files went O_DIRECT
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(save.files)
    assert looks_complete(tmp_path / "ckpt")
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())
    assert save.nbytes == on_disk
    assert SPEC.total_bytes <= save.nbytes <= SPEC.total_bytes * 1.01 + (1 << 20)   # payload + framing + metadata
    assert len(save.rank_seconds) == 2 and save.seconds == max(save.rank_seconds) > 0
    assert save.gbps == pytest.approx(save.nbytes / save.seconds / 1e9)

    for reader in READERS:                             # kvgate's checkpoints are DCP's format, and the reverse
        restore = job.restore(tmp_path / "ckpt", reader=reader)
        assert restore.ok, restore.error
        assert restore.equal and restore.differences == () and restore.reader == reader
        assert restore.seconds == max(restore.rank_seconds) > 0 and restore.nbytes == save.nbytes


def test_a_cold_restore_reads_the_checkpoint_from_the_device(job, tmp_path):
    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {_filesystem_type(tmp_path)}: there is no device to read")
    assert job.save(tmp_path / "ckpt").ok
    restore = job.restore(tmp_path / "ckpt")           # its pages dropped first
    assert restore.equal
    assert restore.read_bytes >= restore.nbytes and restore.cold
    assert all(read > 0 for read in restore.rank_read_bytes)   # each rank read its own shard


def test_a_flipped_byte_in_a_saved_file_is_caught_by_the_restore(job, tmp_path):
    assert job.save(tmp_path / "ckpt").ok
    shard = tmp_path / "ckpt" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    restore = job.restore(tmp_path / "ckpt")
    assert not restore.equal
    if restore.ok:                                     # the damage fell in tensor data: the comparison saw it
        assert len(restore.differences) == 1
        assert restore.differences[0].startswith(("optimizer.rank1_", "model.rank1_"))
        assert "1 of" in restore.differences[0]
    else:                                              # or in the framing: the load itself failed, saying why
        assert restore.error.startswith("rank 1: ")


def test_a_checkpoint_missing_a_file_does_not_look_complete_and_is_not_restored(job, tmp_path):
    assert job.save(tmp_path / "ckpt").ok
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    (tmp_path / "copy" / "__0_0.distcp").unlink()
    assert not looks_complete(tmp_path / "copy")
    restore = job.restore(tmp_path / "copy")
    assert not restore.ok and "not a complete checkpoint" in restore.error
    assert not looks_complete(tmp_path / "nothing-here")


def test_a_save_into_a_directory_that_holds_files_is_refused(job, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected an absent or empty directory"):
        job.save(tmp_path / "used")


@pytest.fixture
def small_fs(small_tmpfs):
    return small_tmpfs(SMALL_FS_MIB)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_save_that_runs_out_of_space_fails_naming_the_file_and_leaves_nothing_that_looks_complete(
        job, small_fs, tmp_path, writer):
    assert SPEC.total_bytes > 2 * SMALL_FS_MIB * 2**20 * 0.9
    save = job.save(small_fs / "ckpt", writer=writer)
    assert not save.ok
    assert "No space left on device" in save.error and save.error.startswith("rank ")
    assert re.search(r"No space left on device: '[^']*/ckpt/[^'/]+'", save.error), save.error   # the file it wrote
    assert not (small_fs / "ckpt" / ".metadata").exists()
    assert not (small_fs / "ckpt" / ".metadata.tmp").exists()
    assert not looks_complete(small_fs / "ckpt")
    after = job.save(tmp_path / "after")               # the job goes on
    assert after.ok and job.restore(tmp_path / "after").equal


def test_a_killed_rank_is_a_clear_error_naming_it(tmp_path):
    spec = CheckpointSpec(parameters=100_000, ranks=2)
    job = CheckpointJob(spec, round_timeout_s=60)
    try:
        os.kill(job.pids[1], signal.SIGKILL)
        with pytest.raises(RankFailure, match=r"rank 1 was killed by SIGKILL during save") as failure:
            job.save(tmp_path / "ckpt")
        assert failure.value.rank == 1
        with pytest.raises(RankFailure, match="stopped"):
            job.save(tmp_path / "again")
    finally:
        job.close()
    assert not looks_complete(tmp_path / "ckpt")


def test_a_hung_rank_is_an_error_after_the_timeout_not_a_hang(tmp_path):
    spec = CheckpointSpec(parameters=100_000, ranks=2)
    with CheckpointJob(spec, round_timeout_s=3) as job:
        os.kill(job.pids[1], signal.SIGSTOP)           # alive, silent
        with pytest.raises(RankFailure, match=r"no answer to save into .* within 3 s from rank 0, rank 1"):
            job.save(tmp_path / "ckpt")
