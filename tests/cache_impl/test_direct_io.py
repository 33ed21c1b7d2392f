"""kvgate's read path at the storage's best (cache_impl/weights/direct_io.py) and its model loader over it: every byte
of every span arrives once, in place, whatever the chunking and alignment, O_DIRECT where the filesystem
takes it and buffered where it does not, and a file shorter than asked is an error naming it."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch

from cache_impl.weights import direct_io
from cache_impl.weights.direct_io import Span, open_direct, read_spans
from cache_impl.weights.loaders import load_checkpoint, loaded_checksums, verify_loaded
from cache_impl.weights.safetensors_dir import file_checksums, read_safetensors_dir, write_safetensors_dir
from kvcore.files import drop_cached_pages, process_read_bytes


def _file(tmp_path, nbytes: int, name: str = "data.bin"):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("chunk_bytes", [4096, 3 * 4096, 1 << 20])
@pytest.mark.parametrize("offset, nbytes", [(0, None), (1, 4095), (4097, 3 * 4096 + 5), (-10, 10), (777, 0)])
def test_a_span_arrives_whole_whatever_its_alignment_and_the_chunking(tmp_path, chunk_bytes, offset, nbytes):
    path, data = _file(tmp_path, 5 * 4096 * 7 + 123)
    span = Span(path, offset % len(data), len(data) if nbytes is None else nbytes)
    got = bytearray(span.nbytes)
    threads = set()

    def consume(piece: Span, chunk: memoryview) -> None:
        assert len(chunk) == piece.nbytes <= chunk_bytes and piece.path == path
        threads.add(threading.get_ident())
        got[piece.offset - span.offset : piece.offset - span.offset + piece.nbytes] = chunk

    stats = read_spans([span], consume, workers=3, chunk_bytes=chunk_bytes)
    assert stats.nbytes == span.nbytes and stats.chunks == -(-span.nbytes // chunk_bytes)
    assert stats.direct                                           # this disk takes O_DIRECT
    assert bytes(got) == data[span.offset : span.offset + span.nbytes]
    if stats.chunks >= 3:
        assert threading.get_ident() not in threads               # read by the pool's threads


def test_a_file_shorter_than_its_span_is_an_error_naming_it(tmp_path):
    path, data = _file(tmp_path, 10_000)
    with pytest.raises(OSError, match="short read") as raised:
        read_spans([Span(path, 0, 20_000)], lambda span, chunk: None, chunk_bytes=4096)
    assert raised.value.filename == str(path)


def test_a_filesystem_refusing_o_direct_is_read_buffered_and_said_so(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 9000)
    real_open = os.open

    def refusing(file, flags, *args):      # what tmpfs on older kernels answers an O_DIRECT open
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refusing)
    fd, direct = open_direct(path)
    os.close(fd)
    assert not direct
    got = bytearray(len(data))

    def consume(span: Span, chunk: memoryview) -> None:
        got[span.offset : span.offset + span.nbytes] = chunk

    stats = read_spans([Span(path, 0, len(data))], consume, chunk_bytes=4096)
    assert not stats.direct and bytes(got) == data


def test_other_open_errors_are_not_taken_for_a_refused_o_direct(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_direct(tmp_path / "absent")


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    """Tensors of odd sizes and several dtypes in shards of 3 MiB: 1 MiB chunks cut through tensors at unaligned
    offsets, and one tensor is larger than a chunk."""
    rng = np.random.default_rng(7)
    tensors = []
    for i, (dtype, itemsize, shape) in enumerate([("float32", 4, [333, 17]), ("bfloat16", 2, [1001, 3]),
                                                  ("uint8", 1, [5]), ("float16", 2, [700_001]),
                                                  ("int64", 8, [12_345]), ("float32", 4, [1, 1])]):
        nbytes = itemsize * int(np.prod(shape))
        tensors.append((f"layer{i}.weight", dtype, shape, rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()))
    directory = tmp_path_factory.mktemp("odd") / "checkpoint"
    return write_safetensors_dir(directory, tensors, 3 << 20)


@pytest.mark.parametrize("read_bytes", [1 << 20, 64 << 10])
def test_kvgates_loader_puts_every_byte_in_place_when_chunks_cut_through_tensors(odd_checkpoint, monkeypatch,
                                                                                 read_bytes):
    asked = []

    def read_spans(*args, **kwargs):        # the real reader, its request size seen on the way
        asked.append(kwargs["chunk_bytes"])
        return real_read_spans(*args, **kwargs)

    real_read_spans = direct_io.read_spans
    monkeypatch.setattr(direct_io, "read_spans", read_spans)
    drop_cached_pages(odd_checkpoint.files)
    before = process_read_bytes()
    result = load_checkpoint(odd_checkpoint, "kvgate", "cpu", concurrency=3, read_bytes=read_bytes)
    assert asked == [read_bytes]                                               # the loader read that much a time
    assert process_read_bytes() - before >= odd_checkpoint.tensor_bytes       # it read the device, cold
    assert verify_loaded(result, odd_checkpoint) == "the checksum sidecar"
    assert loaded_checksums(result) == file_checksums(read_safetensors_dir(odd_checkpoint.path))
    assert result.folded == {"deserialize": "read", "copy": "read"} and result.phases["read"] > 0


def test_kvgates_loader_fills_tensors_another_load_left_dirty(odd_checkpoint):
    first = load_checkpoint(odd_checkpoint, "kvgate", "cpu", concurrency=2)
    for tensor in first.tensors.values():
        tensor.view(-1).view(torch.uint8).fill_(0xAB)
    again = load_checkpoint(odd_checkpoint, "kvgate", "cpu", destinations=first.tensors, concurrency=2)
    verify_loaded(again, odd_checkpoint)


@pytest.mark.parametrize("start, end", [(0, 0), (0, 1), (1, 4097), (4096, 3 * (1 << 20) + 5), (5, 9 * 4096 + 1)])
def test_a_range_is_read_straight_into_one_buffer_whatever_its_alignment(tmp_path, start, end):
    path, data = _file(tmp_path, 3 * (1 << 20) + 4096 * 3 + 7)
    got, direct = direct_io.read_range(path, start, end, workers=4, chunk_bytes=1 << 20)
    assert bytes(got) == data[start:end] and direct


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * (1 << 20) + 123])
@pytest.mark.parametrize("pieces", [1, 7])
def test_a_direct_write_stream_writes_exactly_what_it_was_given_whatever_the_sizes(tmp_path, nbytes, pieces):
    from workloads.storage.checkpoint_kvgate import DirectWriteStream

    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "out.bin"
    with DirectWriteStream(path, chunk_bytes=1 << 20, writers=3) as stream:
        step = max(1, -(-nbytes // pieces))
        for at in range(0, nbytes, step):
            assert stream.write(data[at : at + step]) == len(data[at : at + step])   # read-only bytes are taken
            assert stream.tell() == min(at + step, nbytes)
    assert stream.direct and path.read_bytes() == data and path.stat().st_size == nbytes


def test_a_direct_write_that_fails_names_the_file(tmp_path, small_tmpfs):
    from workloads.storage.checkpoint_kvgate import DirectWriteStream

    full = small_tmpfs(4) / "full.bin"
    with pytest.raises(OSError) as raised:
        with DirectWriteStream(full, chunk_bytes=1 << 20, writers=2) as stream:
            stream.write(bytes(8 << 20))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(full)
