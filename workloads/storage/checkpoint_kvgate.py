"""kvgate's checkpoint writer and reader: DCP's planning, files and metadata, written and read at the storage's best.

`KvgateWriter` is DCP's `FileSystemWriter` whose streams are `DirectWriteStream`s: the bytes are copied into
16 MiB huge-page buffers and written with aligned O_DIRECT pwrites by a few threads per file; `close` writes the
padded tail, cuts the file to its length and fsyncs it. torch.save's CRC-32 is left out while it writes (it runs
below the disk's rate on one core; torch.load never checks it). `KvgateReader` is DCP's `FileSystemReader` whose
reads are O_DIRECT chunks into reused huge-page buffers, read ahead while the items already read are loaded,
each tensor loaded over those bytes without a copy. Both keep DCP's format: either side pairs with DCP's own.
A failed write (ENOSPC, EIO) raises OSError naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import io
import os
import threading
from collections import deque
from concurrent.futures import Future as _ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, cast

import torch
import torch.serialization as serialization
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from cache_impl.platform.buffers import ALIGN, HUGE_PAGE, huge_page_empty
from cache_impl.weights.direct_io import Span, address_of, copy_bytes, open_direct, read_piece

CHUNK_BYTES = 16 << 20       # fio's best fsync'd write job here: direct, 16 MiB requests
WRITERS_PER_FILE = 4         # chunks in flight per file
KEEP_BUFFER_BYTES = 512 << 20  # free buffers a HugePageBuffers keeps between saves and restores
READ_CHUNK_BYTES = 2 << 20   # as kvgate's model loader reads: 16 threads of 2 MiB requests
READ_WORKERS = 16
READ_BATCH_BYTES = 64 << 20  # items read together into one buffer
READ_AHEAD_BATCHES = 3       # batches being read while one is loaded


def _named(path: Path, call):
    """`call()`, its OSError re-raised naming `path` ("[Errno 28] No space left on device: '/x/__0_0.distcp'")."""
    try:
        return call()
    except OSError as error:
        if error.filename:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


# ------------------------------------------------------------------------------------------------- the stream


class HugePageBuffers:
    """Huge-page buffers taken and given back, so one owner's saves and restores reuse warm memory (no page faults,
    no zeroing); free buffers are kept up to `keep_bytes` in all (None: no limit), the rest unmapped."""

    def __init__(self, keep_bytes: Optional[int] = KEEP_BUFFER_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[memoryview]] = {}
        self._kept = 0
        self._lock = threading.Lock()
        self.allocated = 0                             # buffers mapped so far

    def take(self, nbytes: int) -> memoryview:
        """A buffer of exactly `nbytes`, on a 2 MiB boundary; its contents are whatever they were."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
            self.allocated += 1
        return huge_page_empty(nbytes).numpy().data   # the array's bytes as a memoryview (flat, unsigned bytes)

    def give(self, buffer: memoryview) -> None:
        with self._lock:
            if self.keep_bytes is None or self._kept + len(buffer) <= self.keep_bytes:
                self._free.setdefault(len(buffer), []).append(buffer)
                self._kept += len(buffer)


class DirectWriteStream(io.RawIOBase):
    """A file written in aligned O_DIRECT chunks of `chunk_bytes` from huge-page buffers by `writers` threads;
    `close` waits for them, writes the padded tail, cuts the file to its length and fsyncs it. Falls back to
    buffered writes where the filesystem refuses O_DIRECT (`direct` says which). The first OSError of any write
    is kept (`error`, naming the file) and raised by the next `write` and by `close`."""

    def __init__(self, path: Path, chunk_bytes: int = CHUNK_BYTES, writers: int = WRITERS_PER_FILE,
                 buffers: Optional[HugePageBuffers] = None) -> None:
        super().__init__()
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes: expected a positive multiple of {ALIGN}, found {chunk_bytes}")
        self._buffers = buffers or HugePageBuffers(keep_bytes=None)
        self.path, self.chunk_bytes, self.writers = Path(path), chunk_bytes, max(1, writers)
        self.fd, self.direct = _named(self.path, lambda: open_direct(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        self.error: Optional[OSError] = None
        self.bytes_written = 0                        # bytes pwritten to the file so far (padding included)
        self._pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="kvgate-direct-write")
        self._in_flight: deque[_ThreadFuture] = deque()
        self._lock = threading.Lock()
        self._buffer: Optional[memoryview] = None
        self._filled = 0                               # bytes in the current buffer
        self._flushed = 0                              # bytes handed to the writers

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._flushed + self._filled

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        if self.closed:
            raise ValueError(f"{self.path}: write to a closed stream")
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
            if self.error is None and self._filled:
                self._hand_over(-(-self._filled // ALIGN) * ALIGN, logical=self._filled)
            self._wait(0)
            self._raise_error()
            self._checked(lambda: os.ftruncate(self.fd, self._flushed))
            self._checked(lambda: os.fsync(self.fd))
        finally:
            self._pool.shutdown(wait=True)
            if self._buffer is not None:
                self._buffers.give(self._buffer)
                self._buffer = None
            os.close(self.fd)
            super().close()

    def _take_buffer(self) -> memoryview:
        self._wait(self.writers)                       # at most `writers` chunks in flight
        self._raise_error()
        return self._buffers.take(self.chunk_bytes)

    def _hand_over(self, nbytes: int, logical: Optional[int] = None) -> None:
        """Write the current buffer's first `nbytes` (aligned; past `logical` it is padding) at its offset."""
        buffer, offset = self._buffer, self._flushed
        if buffer is None:
            raise RuntimeError(f"{self.path}: nothing to write (no buffer filled)")
        if logical is not None:
            buffer[logical:nbytes] = bytes(nbytes - logical)
        self._buffer, self._filled = None, 0
        self._flushed += nbytes if logical is None else logical
        self._in_flight.append(self._pool.submit(self._write_at, buffer, nbytes, offset))

    def _write_at(self, buffer: memoryview, nbytes: int, offset: int) -> None:
        try:
            done = 0
            while done < nbytes:
                done += self._checked(lambda: os.pwrite(self.fd, buffer[done:nbytes], offset + done))
            with self._lock:
                self.bytes_written += nbytes
        except OSError:
            pass                                       # kept in self.error by _checked
        finally:
            self._buffers.give(buffer)

    def _checked(self, call):
        """`call()`, its OSError (naming the file) kept as the stream's first error before it is raised."""
        try:
            return _named(self.path, call)
        except OSError as error:
            with self._lock:
                self.error = self.error or error
            raise

    def _wait(self, at_most: int) -> None:
        while len(self._in_flight) > at_most:
            self._in_flight.popleft().result()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error


# -------------------------------------------------------------------------------------------------- the writer


class DirectFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams are DirectWriteStreams (it reads as DCP's own); `first_error`:
    the first OSError of any of its streams, naming the file; `stop` refuses new streams and waits for the open."""

    def __init__(self, buffers: Optional[HugePageBuffers] = None, writers: int = WRITERS_PER_FILE,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__()
        self.buffers, self.writers, self.chunk_bytes = buffers or HugePageBuffers(), writers, chunk_bytes
        self.streams: list[DirectWriteStream] = []
        self._open_errors: list[OSError] = []
        self._lock = threading.Condition()
        self._open = 0
        self._stopped = False

    @property
    def first_error(self) -> Optional[OSError]:
        with self._lock:
            return next(iter(self._open_errors + [s.error for s in self.streams if s.error is not None]), None)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self._lock:
            if self._stopped:
                raise OSError(errno.ECANCELED, "not written: another file of this save failed", str(path))
            self._open += 1
        try:
            try:
                stream = DirectWriteStream(Path(path), self.chunk_bytes, self.writers, self.buffers)
            except OSError as error:
                with self._lock:
                    self._open_errors.append(error)
                raise
            with self._lock:
                self.streams.append(stream)
            try:
                yield stream
            finally:
                stream.close()
        finally:
            with self._lock:
                self._open -= 1
                self._lock.notify_all()

    def stop(self) -> None:
        """Refuse new streams and wait until the open ones are closed."""
        with self._lock:
            self._stopped = True
            self._lock.wait_for(lambda: self._open == 0)


class KvgateWriter(FileSystemWriter):
    """DCP's FileSystemWriter (same options; `thread_count` files written at once per rank) writing through
    DirectWriteStreams, `writers_per_file` chunks of `chunk_bytes` in flight each, from `buffers` (pass one
    HugePageBuffers to reuse its memory over saves). `crc32`: whether torch.save computes its per-record CRC-32
    (off by default). `direct`: every file took O_DIRECT; `first_error`: why a write failed, naming the file;
    `bytes_written`: bytes written to the files (their tails padded to 4 KiB)."""

    fs: DirectFileSystem           # DCP's writer makes a plain FileSystem; __init__ replaces it with this

    def __init__(self, path, *, buffers: Optional[HugePageBuffers] = None, writers_per_file: int = WRITERS_PER_FILE,
                 chunk_bytes: int = CHUNK_BYTES, crc32: bool = False, **options) -> None:
        super().__init__(path, **options)
        self.fs = DirectFileSystem(buffers, writers_per_file, chunk_bytes)
        self.crc32 = crc32

    @property
    def direct(self) -> bool:
        return bool(self.fs.streams) and all(s.direct for s in self.fs.streams)

    @property
    def first_error(self) -> Optional[OSError]:
        return self.fs.first_error

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self.fs.streams)

    def write_data(self, plan, planner):
        """DCP's write_data; a failure raised as the OS's error naming the file (torch.save's zip writer would
        say "unexpected pos"), once DCP's other writer threads are done: DCP neither joins them when one thread
        fails nor raises what they raise."""
        with torch_save_crc32(self.crc32):
            try:
                written = super().write_data(plan, planner)
            except Exception as error:
                self.fs.stop()
                first = self.first_error
                if first is None or first is error:
                    raise
                raise first from error
            if self.first_error is not None:
                raise self.first_error
        return written


@contextlib.contextmanager
def torch_save_crc32(compute: bool):
    """torch.save with or without its per-record CRC-32 (process-wide while inside; torch.load never checks it)."""
    saved = serialization.get_crc32_options()
    serialization.set_crc32_options(compute)
    try:
        yield
    finally:
        serialization.set_crc32_options(saved)


# -------------------------------------------------------------------------------------------------- the reader


@dataclass
class _Batch:
    """Consecutive items of one file read together: bytes [start, end) of `path` (start aligned)."""

    path: Path
    start: int
    end: int
    requests: list = field(default_factory=list)   # (ReadItem, _StorageInfo), in offset order


class KvgateReader(FileSystemReader):
    """DCP's FileSystemReader whose reads are kvgate's: the plan's items, in file and offset order, read in batches
    of about `batch_bytes` by `workers` threads in parallel O_DIRECT chunks of `chunk_bytes` into huge-page buffers,
    `ahead` batches read while one is loaded; each item then loaded as DCP's reader loads it (torch.load, narrowed,
    copied into the planner's tensor), its tensor over the buffer's bytes. `buffers`: pass one HugePageBuffers to
    reuse its memory over restores. `direct`: every file was read O_DIRECT."""

    def __init__(self, path, *, workers: int = READ_WORKERS, chunk_bytes: int = READ_CHUNK_BYTES,
                 batch_bytes: int = READ_BATCH_BYTES, ahead: int = READ_AHEAD_BATCHES,
                 buffers: Optional[HugePageBuffers] = None, **options) -> None:
        super().__init__(path, **options)
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes: expected a positive multiple of {ALIGN}, found {chunk_bytes}")
        self.workers, self.chunk_bytes, self.batch_bytes, self.ahead = workers, chunk_bytes, batch_bytes, max(1, ahead)
        self.buffers = buffers
        self.direct: Optional[bool] = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        batches = self._batches(plan.items)
        buffers = self.buffers or HugePageBuffers(keep_bytes=None)
        descriptors: dict[Path, int] = {}
        pending: deque = deque()
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvgate-checkpoint-read")
        try:
            for path in dict.fromkeys(batch.path for batch in batches):
                descriptors[path], direct = open_direct(path)
                self.direct = direct if self.direct is None else self.direct and direct
            upcoming = iter(batches)
            while True:
                while len(pending) <= self.ahead and (batch := next(upcoming, None)) is not None:
                    pending.append(self._submit(pool, batch, descriptors[batch.path], buffers))
                if not pending:
                    break
                batch, buffer, reads = pending.popleft()
                for read in reads:
                    read.result()
                self._load_batch(batch, buffer, planner)
                buffers.give(buffer)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for _, buffer, _ in pending:
                buffers.give(buffer)
            for fd in descriptors.values():
                os.close(fd)
        done: Future = Future()
        done.set_result(None)
        return done

    def _batches(self, items: list[ReadItem]) -> list[_Batch]:
        """The items grouped by file, in offset order, into batches of at most batch_bytes (an item larger is one
        alone); an item not next to the one before (a gap) starts a batch, so unneeded bytes are never read."""
        ordered = sorted(((self.storage_data[item.storage_index], item) for item in items),
                         key=lambda pair: (pair[0].relative_path, pair[0].offset))
        batches: list[_Batch] = []
        for info, item in ordered:
            path = Path(self.fs.concat_path(self.path, info.relative_path))
            last = batches[-1] if batches else None
            end = info.offset + info.length
            if (last is None or last.path != path or info.offset > last.end + ALIGN
                    or end - last.start > self.batch_bytes):
                last = _Batch(path, info.offset - info.offset % ALIGN, end)
                batches.append(last)
            last.end = max(last.end, end)
            last.requests.append((item, info))
        return batches

    def _submit(self, pool: ThreadPoolExecutor, batch: _Batch, fd: int, buffers: HugePageBuffers):
        """Start reading the batch into a buffer: (batch, buffer, reads). Buffers come in sizes of batch_bytes + 2 MiB
        (a batch's largest: an item of batch_bytes and its framing) so they are reused; a larger item's fits it."""
        nbytes = max(self.batch_bytes + HUGE_PAGE, -(-(batch.end - batch.start) // HUGE_PAGE) * HUGE_PAGE)
        buffer = buffers.take(nbytes)
        reads = [pool.submit(read_piece, fd, Span(batch.path, at, min(self.chunk_bytes, batch.end - at)),
                             buffer[at - batch.start :])
                 for at in range(batch.start, batch.end, self.chunk_bytes)]
        return batch, buffer, reads

    def _load_batch(self, batch: _Batch, buffer: memoryview, planner: LoadPlanner) -> None:
        """What DCP's FileSystemReader does per item, from the bytes in `buffer`."""
        for request, info in batch.requests:
            item = buffer[info.offset - batch.start : info.offset - batch.start + info.length]
            descriptors = info.transform_descriptors or ()
            if request.type == LoadItemType.BYTE_IO:
                stream = self.transforms.transform_load_stream(request, descriptors, _view_file(item))
                planner.load_bytes(request, io.BytesIO(stream.read(-1)))
                continue
            if descriptors:
                stream = self.transforms.transform_load_stream(request, descriptors, _view_file(item))
                seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
                loaded = torch.load(seekable, map_location="cpu", weights_only=True)
            else:
                loaded = load_tensor_over(item)
            tensor = narrow_tensor_by_index(loaded, request.storage_offsets, request.lengths)
            target = planner.resolve_tensor(request).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"{batch.path}: item {request.storage_index}: expected a tensor of "
                                     f"{list(target.size())}, found {list(tensor.size())}")
            target.copy_(tensor)
            planner.commit_tensor(request, target)


# torch.load(mmap=True) loads tensors over a file's mapping through these; the same over bytes in memory.
_LOADS_OVER_A_STORAGE = (hasattr(serialization, "_open_zipfile_reader") and hasattr(serialization, "_load")
                         and "overall_storage" in inspect.signature(serialization._load).parameters)


def load_tensor_over(item: memoryview):
    """torch.load(weights_only=True) of a torch.save'd object's bytes, its tensors' storage those bytes (no copy),
    as torch.load(mmap=True) does over a file's mapping; where this torch lacks that, torch.load of a copy."""
    if not _LOADS_OVER_A_STORAGE or not serialization._is_zipfile(_ViewFile(item)):
        return torch.load(_view_file(item), map_location="cpu", weights_only=True)
    storage = torch.frombuffer(item, dtype=torch.uint8).untyped_storage()
    with serialization._open_zipfile_reader(_view_file(item)) as zip_file:
        return serialization._load(zip_file, "cpu", serialization._weights_only_unpickler,
                                   overall_storage=storage, encoding="utf-8")   # torch.load's encoding


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, without copying them (io.BytesIO copies)."""

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


def _view_file(view: memoryview) -> IO[bytes]:
    """A `_ViewFile` over `view`, typed as the binary file torch's readers take: they use only read, readinto, seek
    and tell, which it has, but name IO[bytes], which a RawIOBase is not declared as."""
    return cast(IO[bytes], _ViewFile(view))
