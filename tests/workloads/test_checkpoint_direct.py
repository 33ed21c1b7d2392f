"""kvgate's DCP writer and reader (workloads/storage/checkpoint_kvgate.py) with real files and real `dcp.save` /
`dcp.load`.

In one process (DCP without a process group) unless a test says ranks: checkpoints of kvgate's writer read bit for
bit through kvgate's reader and DCP's own, DCP's own writer's through kvgate's, and a full disk names the file.
"""

from __future__ import annotations

import errno
import io
import threading
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException

from workloads.storage.checkpoint import READERS, CheckpointJob, CheckpointSpec, looks_complete
from workloads.storage.checkpoint_kvgate import (
    DirectWriteStream,
    HugePageBuffers,
    KvgateReader,
    KvgateWriter,
    load_tensor_over,
    torch_save_crc32,
)

CHUNK = 1 << 20


@pytest.fixture(autouse=True)
def _single_process_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _on_ext4(path: Path) -> bool:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount_point, fs_type = line.split()[:3]
        if str(path.resolve()).startswith(mount_point.rstrip("/") + "/") and len(mount_point) > len(best):
            best, kind = mount_point, fs_type
    return kind == "ext4"


def _random_bytes(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _state(seed: int = 0) -> dict:
    """Tensors of several dtypes and odd sizes (one over a 1 MiB chunk, one empty) and non-tensor values (DCP's
    BYTE_IO items)."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {"embed": torch.randn(1000, 333, generator=g).to(torch.bfloat16),
                      "big": torch.randn(3 * CHUNK // 4 + 17, generator=g),
                      "bias": torch.randn(7, generator=g, dtype=torch.float64),
                      "steps": torch.randint(0, 2**40, (5,), generator=g),
                      "empty": torch.empty(0)},
            "optimizer": {"exp_avg": torch.randn(4099, generator=g)},
            "meta": {"step": 1234, "lr": 0.25, "name": "kvgate"}}


def _empty_like(state):
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7) if state.numel() else torch.empty_like(state)
    return None


def _assert_bit_equal(expected, found, where="state") -> None:
    if isinstance(expected, dict):
        assert set(found) == set(expected), where
        for key in expected:
            _assert_bit_equal(expected[key], found[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert found.dtype == expected.dtype and found.shape == expected.shape, where
        assert torch.equal(found.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), where
    else:
        assert found == expected, where


def _load(directory: Path, reader, like: dict) -> dict:
    fresh = _empty_like(like)
    dcp.load(fresh, storage_reader=reader)
    return fresh


# --- the stream ---

@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * CHUNK, 3 * CHUNK + 4096 + 5])
def test_a_direct_write_stream_writes_exactly_its_bytes_and_the_file_is_exactly_as_long(tmp_path, nbytes):
    data = _random_bytes(nbytes, nbytes)
    path = tmp_path / "out.bin"
    pieces = [1, 4095, CHUNK + 3, 17, 2 * CHUNK]           # writes across chunk boundaries, of every size
    with DirectWriteStream(path, chunk_bytes=CHUNK, writers=2) as stream:
        at, i = 0, 0
        while at < nbytes:
            piece = data[at : at + pieces[i % len(pieces)]]
            assert stream.write(piece) == len(piece) and stream.tell() == at + len(piece)
            at, i = at + len(piece), i + 1
    assert path.read_bytes() == data and path.stat().st_size == nbytes
    assert stream.bytes_written == -(-nbytes // 4096) * 4096          # whole chunks and the padded tail
    if _on_ext4(tmp_path):
        assert stream.direct                                          # O_DIRECT took, the direct path ran


def test_streams_sharing_buffers_reuse_them(tmp_path):
    buffers = HugePageBuffers(keep_bytes=4 * CHUNK)
    for name in ("a", "b", "c"):
        with DirectWriteStream(tmp_path / name, chunk_bytes=CHUNK, writers=2, buffers=buffers) as stream:
            stream.write(_random_bytes(5 * CHUNK + 1))
    assert buffers.allocated <= 3                                    # 2 in flight + 1 filling, once


def test_a_write_to_a_closed_stream_is_refused(tmp_path):
    stream = DirectWriteStream(tmp_path / "x", chunk_bytes=CHUNK)
    stream.close()
    with pytest.raises(ValueError, match="closed"):
        stream.write(b"x")


# --- kvgate's checkpoints through either reader, DCP's through kvgate's ---

def test_a_kvgate_checkpoint_restores_bit_for_bit_through_kvgates_reader_and_dcps(tmp_path):
    state = _state()
    writer = KvgateWriter(str(tmp_path / "ckpt"), thread_count=2, buffers=HugePageBuffers())
    dcp.save(state, storage_writer=writer)
    files = sorted((tmp_path / "ckpt").iterdir())
    assert {p.name for p in files} == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    assert looks_complete(tmp_path / "ckpt")
    assert writer.first_error is None
    assert writer.bytes_written >= sum(p.stat().st_size for p in files if p.suffix == ".distcp")
    if _on_ext4(tmp_path):
        assert writer.direct
    buffers = HugePageBuffers()
    allocated = None
    for restore in range(2):                           # the second restore reads into the first's buffers
        reader = KvgateReader(str(tmp_path / "ckpt"), chunk_bytes=64 * 1024, buffers=buffers)
        _assert_bit_equal(state, _load(tmp_path / "ckpt", reader, state))
        if _on_ext4(tmp_path):
            assert reader.direct
        if restore == 0:
            allocated = buffers.allocated
    assert buffers.allocated == allocated
    _assert_bit_equal(state, _load(tmp_path / "ckpt", FileSystemReader(str(tmp_path / "ckpt")), state))


@pytest.mark.parametrize("options", [{"thread_count": 1}, {"thread_count": 3}, {"single_file_per_rank": False}])
def test_a_checkpoint_of_dcps_own_writer_restores_bit_for_bit_through_kvgates_reader(tmp_path, options):
    state = _state(1)
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ckpt"), **options))
    _assert_bit_equal(state, _load(tmp_path / "ckpt", KvgateReader(str(tmp_path / "ckpt")), state))


@pytest.mark.parametrize("batch_bytes, chunk_bytes", [(4096, 4096), (CHUNK, 8192), (64 * CHUNK, 2 * CHUNK)])
def test_kvgates_reader_gives_the_same_bytes_whatever_its_batches_and_chunks(tmp_path, batch_bytes, chunk_bytes):
    state = _state(2)
    dcp.save(state, storage_writer=KvgateWriter(str(tmp_path / "ckpt")))
    reader = KvgateReader(str(tmp_path / "ckpt"), workers=3, chunk_bytes=chunk_bytes, batch_bytes=batch_bytes, ahead=1)
    _assert_bit_equal(state, _load(tmp_path / "ckpt", reader, state))


def test_kvgates_reader_loads_a_part_of_a_checkpoint(tmp_path):
    state = _state(3)
    dcp.save(state, storage_writer=KvgateWriter(str(tmp_path / "ckpt")))
    part = {"model": {"bias": torch.zeros(7, dtype=torch.float64), "steps": torch.zeros(5, dtype=torch.int64)}}
    dcp.load(part, storage_reader=KvgateReader(str(tmp_path / "ckpt")))
    _assert_bit_equal({"model": {k: state["model"][k] for k in ("bias", "steps")}}, part)


class _Xor(StreamTransformExtension):
    """A stream transform (each byte XOR 0x5A) whose load stream cannot seek, as compression's cannot."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> "_Xor":
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                output.write(bytes(x ^ 0x5A for x in bytes(b)))
                return len(memoryview(b))

        return Writer()

    def transform_from(self, input):
        class Reader(io.RawIOBase):
            def readable(self):
                return True

            def seekable(self):
                return False

            def readinto(self, buffer):
                data = input.read(len(buffer))
                buffer[: len(data)] = bytes(x ^ 0x5A for x in data)
                return len(data)

        return Reader()


def test_transformed_items_read_as_dcps_reader_reads_them(tmp_path):
    state = {"w": torch.randn(3000), "meta": {"step": 9}}
    dcp.save(state, storage_writer=KvgateWriter(str(tmp_path / "ckpt"), _extensions=[_Xor()]))
    registry = ExtensionRegistry()
    registry.register(_Xor)
    for reader in (KvgateReader(str(tmp_path / "ckpt"), _extension_registry=registry),
                   FileSystemReader(str(tmp_path / "ckpt"), _extension_registry=registry)):
        _assert_bit_equal(state, _load(tmp_path / "ckpt", reader, state))


# --- torch.save's CRC-32 ---

def test_kvgates_writer_leaves_torch_saves_crc32_out_and_torch_load_reads_the_items_bit_for_bit(tmp_path):
    state = {"w": torch.randn(10_000), "h": torch.randn(77).to(torch.bfloat16)}
    before = torch.serialization.get_crc32_options()
    for crc32 in (False, True):
        directory = tmp_path / f"crc-{crc32}"
        dcp.save(state, storage_writer=KvgateWriter(str(directory), crc32=crc32))
        assert torch.serialization.get_crc32_options() == before          # the process's option is put back
        metadata = FileSystemReader(str(directory)).read_metadata()
        data = (directory / "__0_0.distcp").read_bytes()
        for item in metadata.storage_data.values():
            raw = data[item.offset : item.offset + item.length]
            crcs = [info.CRC for info in zipfile.ZipFile(io.BytesIO(raw)).infolist() if "/data/" in info.filename]
            assert crcs and all((crc != 0) == crc32 for crc in crcs)
            loaded = torch.load(io.BytesIO(raw), weights_only=True)        # torch.load does not check it
            over = load_tensor_over(memoryview(bytearray(raw)))
            assert torch.equal(loaded.view(torch.uint8), over.view(torch.uint8))
        _assert_bit_equal(state, _load(directory, FileSystemReader(str(directory)), state))


def test_a_tensor_loaded_over_the_bytes_shares_them_and_matches_torch_load():
    tensor = torch.randn(4, 1025).to(torch.bfloat16)[:, 3:]        # a view: its storage is wider than it
    sink = io.BytesIO()
    with torch_save_crc32(False):
        torch.save(tensor, sink)
    raw = bytearray(sink.getvalue())
    over = load_tensor_over(memoryview(raw))
    expected = torch.load(io.BytesIO(bytes(raw)), weights_only=True)
    assert over.stride() == expected.stride() and torch.equal(over, expected) and torch.equal(over, tensor)
    base = np.frombuffer(raw, dtype=np.uint8).ctypes.data
    assert base <= over.data_ptr() < base + len(raw)               # no copy: the tensor lies in the bytes


# --- a full disk ---

@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # DCP's own threads drop theirs
@pytest.mark.parametrize("thread_count", [1, 2])
def test_a_save_that_runs_out_of_space_names_the_file_and_leaves_no_metadata(tmp_path, small_tmpfs, thread_count):
    full = small_tmpfs(8)
    state = {f"t{i}": torch.randn(1 << 20) for i in range(4)}        # 16 MiB into 8
    writer = KvgateWriter(str(full / "ckpt"), thread_count=thread_count, buffers=HugePageBuffers())
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=writer)
    errors = [error for error, _ in raised.value.failures.values()]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC and str(e).startswith(
        "[Errno 28] No space left on device: '") and e.filename.startswith(str(full / "ckpt" / "__0_")) for e in errors)
    assert writer.first_error is not None and writer.first_error.errno == errno.ENOSPC
    assert Path(writer.first_error.filename).parent == full / "ckpt"
    sizes = {p.name: p.stat().st_size for p in (full / "ckpt").iterdir()}
    for thread in [t for t in threading.enumerate() if "_write_files_from_queue" in t.name]:
        thread.join(10)                                # DCP's other writer thread, if any, writes nothing more
    assert {p.name: p.stat().st_size for p in (full / "ckpt").iterdir()} == sizes
    assert not (full / "ckpt" / ".metadata").exists() and not looks_complete(full / "ckpt")


# --- real ranks: several files per rank ---

def test_ranks_writing_several_files_each_save_direct_and_restore_equal_through_either_reader(tmp_path):
    spec = CheckpointSpec.for_state_bytes(24 * 2**20, ranks=2, tensor_bytes=2 * 2**20, seed=3)
    with CheckpointJob(spec, thread_count=3, round_timeout_s=120) as job:
        save = job.save(tmp_path / "ckpt", writer="kvgate")
        assert save.ok, save.error
        assert {f"__{r}_{f}.distcp" for r in range(2) for f in range(3)} <= set(save.files)
        assert save.direct == _on_ext4(tmp_path) and save.context()["writer"] == "kvgate"
        for reader in READERS:
            restore = job.restore(tmp_path / "ckpt", reader=reader)
            assert restore.ok and restore.equal, restore.error or restore.differences
            assert restore.context()["reader"] == reader
