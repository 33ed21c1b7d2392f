"""kvgate's checkpoint writer and reader: DCP's planning, files and metadata, written and read at the storage's best.

`KvgateWriter` is DCP's `FileSystemWriter` (the same plans, file names, items at the offsets `tell()` gives,
`.metadata` written last and renamed) whose streams are `DirectWriteStream`s: the bytes DCP writes are
copied into huge-page buffers and written in 16 MiB aligned O_DIRECT writes by a few threads per file, the
tail padded and the file cut to its length, then fsync'd on close. torch.save's CRC-32 of every record is
left out (`torch.utils.serialization.config.save.compute_crc32`): it ran at ~1.4 GB/s on one core here,
below the disk, and torch.load never checks it (a flipped byte loads without complaint), so DCP's reader
loses nothing. A checkpoint it writes is DCP's format: `dcp.load` with DCP's own `FileSystemReader` reads it.

`KvgateReader` is DCP's `FileSystemReader` whose `read_data` reads each file's items with
`cache_impl.direct_io.read_range` (parallel O_DIRECT reads straight into one huge-page buffer per file), then
loads each item from it as DCP's reader does (torch.load, narrowed, copied into the planner's tensor). It
reads checkpoints DCP's own writer wrote too (no sidecar: nothing to verify but what torch.load checks).

A failed write (ENOSPC, EIO) raises OSError naming the file, from the writing thread to the caller.

The reader is not faster than DCP's here: of a 2-rank restore of 0.3 GB, the reads take about a third
and torch.load's copy of each item into fresh storage (and DCP's copy into the target) the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
from concurrent.futures import Future as _ThreadFuture, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Iterator, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from cache_impl.buffers import ALIGN, huge_page_empty
from cache_impl.direct_io import address_of, copy_bytes, open_direct, read_range

CHUNK_BYTES = 16 << 20       # fio's best fsync'd write job here: direct, 16 MiB, 4 jobs
WRITERS_PER_FILE = 4         # chunks in flight per file
READ_CHUNK_BYTES = 2 << 20   # as kvgate's model loader reads
READ_WORKERS = 16


class StagingBuffers:
    """Huge-page staging buffers kept for the process's next streams: a save allocates none after the first. A new
    huge page can stall on the kernel's compaction; in G2's quick saves one save in six ran at 0.4 of its
    neighbours' speed with fresh buffers each save."""

    def __init__(self) -> None:
        self._free: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            kept = self._free.get(nbytes)
            if kept:
                return kept.pop()
        return memoryview(huge_page_empty(nbytes).numpy())

    def give(self, buffers: list[memoryview]) -> None:
        with self._lock:
            for buffer in buffers:
                self._free.setdefault(len(buffer), []).append(buffer)


STAGING = StagingBuffers()


class DirectWriteStream(io.RawIOBase):
    """A file written in aligned O_DIRECT chunks from huge-page buffers by `writers` threads; `close` writes the
    padded tail, cuts the file to its length and fsyncs it. Falls back to buffered writes where the filesystem
    refuses O_DIRECT (`direct` says which). An OSError of any write is raised, naming the file, by the next
    `write` or by `close`."""

    def __init__(self, path: Path, chunk_bytes: int = CHUNK_BYTES, writers: int = WRITERS_PER_FILE) -> None:
        super().__init__()
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes: expected a multiple of {ALIGN}, found {chunk_bytes}")
        self.path, self.chunk_bytes = Path(path), chunk_bytes
        self.fd, self.direct = _named(self.path, lambda: open_direct(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        self._free: queue.Queue = queue.Queue()
        self._held = [STAGING.take(chunk_bytes) for _ in range(writers + 1)]   # one filling, `writers` written
        for buffer in self._held:
            self._free.put(buffer)
        self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="kvgate-direct-write")
        self._in_flight: list[_ThreadFuture] = []
        self._buffer: Optional[memoryview] = None
        self._filled = 0                               # bytes in the current buffer
        self._flushed = 0                              # bytes handed to the writers (a multiple of chunk_bytes)
        self._error: Optional[OSError] = None

    # -- io.RawIOBase ----------------------------------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._flushed + self._filled

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        self._raise_error()
        source = memoryview(data).cast("B")
        done = 0
        while done < len(source):
            if self._buffer is None:
                self._buffer = self._take_buffer()
            n = min(len(source) - done, self.chunk_bytes - self._filled)
            copy_bytes(address_of(self._buffer) + self._filled, source[done : done + n], n)
            self._filled += n
            done += n
            if self._filled == self.chunk_bytes:
                self._hand_over(self.chunk_bytes)
        return done

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._error is None and self._filled:
                self._hand_over(-(-self._filled // ALIGN) * ALIGN, logical=self._filled)
            self._wait()
            self._raise_error()
            _named(self.path, lambda: os.ftruncate(self.fd, self._flushed))
            _named(self.path, lambda: os.fsync(self.fd))
        finally:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            STAGING.give(self._held)
            super().close()

    # -- the writers -----------------------------------------------------------------------------------------------

    def _take_buffer(self) -> memoryview:
        while True:
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                self._reap()
                self._raise_error()

    def _hand_over(self, nbytes: int, logical: Optional[int] = None) -> None:
        """Write the current buffer's first `nbytes` (aligned; past `logical` it is padding) at its offset."""
        buffer, offset = self._buffer, self._flushed
        if nbytes > (logical or nbytes):
            buffer[logical:nbytes] = bytes(nbytes - logical)
        self._buffer, self._filled = None, 0
        self._flushed += logical if logical is not None else nbytes
        self._in_flight.append(self._pool.submit(self._write_at, buffer, nbytes, offset))
        self._reap()

    def _write_at(self, buffer: memoryview, nbytes: int, offset: int) -> None:
        try:
            done = 0
            while done < nbytes:
                done += _named(self.path, lambda: os.pwrite(self.fd, buffer[done:nbytes], offset + done))
        except OSError as error:
            self._error = self._error or error
        finally:
            self._free.put(buffer)

    def _reap(self) -> None:
        self._in_flight = [f for f in self._in_flight if not f.done()]

    def _wait(self) -> None:
        for future in self._in_flight:
            future.result()
        self._in_flight = []

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _named(path: Path, call):
    """`call()`, an OSError from it re-raised naming `path` ("[Errno 28] No space left on device: '/x/__0_0.distcp'")."""
    try:
        return call()
    except OSError as error:
        if error.filename:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


# -------------------------------------------------------------------------------------------------- the writer


class DirectFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams are DirectWriteStreams (reads as DCP's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[DirectWriteStream] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[IO[bytes]]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = DirectWriteStream(Path(path))
        with self._lock:
            self.streams.append(stream)
        try:
            yield stream
        finally:
            stream.close()


class KvgateWriter(FileSystemWriter):
    """DCP's FileSystemWriter (same options) writing through DirectWriteStreams, each item's bytes checksummed.
    `thread_count`: files written at once per rank (DCP's own bins); `direct`: every file took O_DIRECT."""

    def __init__(self, path, **options) -> None:
        super().__init__(path, **options)
        self.fs = DirectFileSystem()

    @property
    def direct(self) -> bool:
        return bool(self.fs.streams) and all(s.direct for s in self.fs.streams)

    def write_data(self, plan, planner):
        with torch_save_without_crc32():
            return super().write_data(plan, planner)


@contextlib.contextmanager
def torch_save_without_crc32():
    """torch.save without its per-record CRC-32, which torch.load never checks."""
    saved = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        serialization_config.save.compute_crc32 = saved


# -------------------------------------------------------------------------------------------------- the reader


class KvgateReader(FileSystemReader):
    """DCP's FileSystemReader whose reads are kvgate's: each file's items read in parallel O_DIRECT chunks into
    one huge-page buffer, then loaded from it item by item as DCP's reader loads them."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        for relative_path, requests in per_file.items():
            infos = [self.storage_data[request.storage_index] for request in requests]
            start = min(info.offset for info in infos)
            data, _ = read_range(Path(self.fs.concat_path(self.path, relative_path)), start,
                                 max(info.offset + info.length for info in infos), READ_WORKERS, READ_CHUNK_BYTES)
            for request, info in zip(requests, infos):
                item = _ViewFile(data[info.offset - start : info.offset - start + info.length])
                stream = self.transforms.transform_load_stream(request, info.transform_descriptors or (), item)
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(stream.read(-1)))
                    continue
                seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
                tensor = narrow_tensor_by_index(torch.load(seekable, map_location="cpu", weights_only=True),
                                                request.storage_offsets, request.lengths)
                target = planner.resolve_tensor(request).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"{relative_path}: item {request.storage_index}: expected a tensor of "
                                     f"{list(target.size())}, found {list(tensor.size())}")
                target.copy_(tensor)
                planner.commit_tensor(request, target)
        done: Future = Future()
        done.set_result(None)
        return done


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, without copying them (io.BytesIO copies: 0.28 s against
    0.03 s for torch.load of a 64 MiB item here)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._position))
        memoryview(buffer).cast("B")[:n] = self._view[self._position : self._position + n]
        self._position += n
        return n
