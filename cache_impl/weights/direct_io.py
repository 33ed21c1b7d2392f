"""Reading files at the storage's best: parallel, large, aligned O_DIRECT reads into huge pages.

The disk tier's read path, for whole files: each file is cut into chunks, `workers` threads each
read one chunk at a time with one pread into a buffer of their own (huge pages, so one request can
be several MiB: `cache_impl.platform.buffers`), and hand the chunk to `consume` in that thread. Where a
filesystem refuses O_DIRECT (tmpfs on older kernels, some FUSE mounts) the file is read buffered
instead and `ReadStats.direct` says so.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from cache_impl.platform.buffers import ALIGN, huge_page_empty

DEFAULT_CHUNK_BYTES = 2 * 2**20       # one huge page a read; 16 of them in flight read as fio's best job here
DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class Span:
    """`nbytes` of `path` from `offset`: what one chunk read delivers."""

    path: Path
    offset: int
    nbytes: int


Consume = Callable[[Span, memoryview], None]


@dataclass
class ReadStats:
    """What a read did: bytes delivered, chunks, whether every file was opened O_DIRECT."""

    nbytes: int = 0
    chunks: int = 0
    direct: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.nbytes += nbytes
            self.chunks += 1


def open_direct(path: Path, flags: int = os.O_RDONLY) -> tuple[int, bool]:
    """`path` opened with O_DIRECT where its filesystem takes it, else without: (fd, direct)."""
    base = flags | os.O_CLOEXEC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, base | os.O_DIRECT, 0o644), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, base, 0o644), False


def chunked(spans: Iterable[Span], chunk_bytes: int) -> list[Span]:
    """Each span cut into pieces of at most `chunk_bytes`, in order."""
    pieces = []
    for span in spans:
        for start in range(span.offset, span.offset + span.nbytes, chunk_bytes):
            pieces.append(Span(span.path, start, min(chunk_bytes, span.offset + span.nbytes - start)))
    return pieces


def copy_bytes(destination: int, source, nbytes: int) -> None:
    """memcpy of `nbytes` from `source` (any buffer, read-only too) to the address `destination`, without holding
    the GIL."""
    if nbytes:
        ctypes.memmove(destination, np.frombuffer(source, dtype=np.uint8, count=nbytes).ctypes.data, nbytes)


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_spans(spans: Sequence[Span], consume: Consume, workers: int = DEFAULT_WORKERS,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               buffer: Callable[[int], torch.Tensor] = huge_page_empty) -> ReadStats:
    """Read every span (cut into chunks of `chunk_bytes`) with `workers` threads, O_DIRECT where the
    filesystem takes it, calling `consume(span, bytes)` in the reading thread for each chunk. Each thread
    reads into one `buffer(nbytes)` of its own (a flat uint8 tensor starting on a page boundary: huge pages
    by default, pinned memory for copies to a GPU); the bytes are valid only during the call. A short file
    raises OSError naming it. (Handing the copies to threads of their own, each reader reading on into a
    second buffer, was slower here: 0.87 of a bare read against 0.92.)"""
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes: expected a multiple of {ALIGN}, found {chunk_bytes}")
    pieces = chunked(spans, chunk_bytes)
    stats = ReadStats()
    if not pieces:
        return stats
    descriptors: dict[Path, int] = {}
    try:
        for path in dict.fromkeys(piece.path for piece in pieces):
            descriptors[path], direct = open_direct(path)
            stats.direct = stats.direct and direct
        pending = iter(pieces)
        lock = threading.Lock()

        def work() -> None:
            memory = buffer(chunk_bytes + 2 * ALIGN)         # a misaligned span spans one page more
            view = memory.numpy().data  # .data: numpy's stubs give ndarray __buffer__ from Python 3.12 only
            while True:
                with lock:
                    piece = next(pending, None)
                if piece is None:
                    return
                consume(piece, read_piece(descriptors[piece.path], piece, view))
                stats.add(piece.nbytes)

        count = min(workers, len(pieces))
        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="kvgate-direct-read") as pool:
            for future in [pool.submit(work) for _ in range(count)]:
                future.result()
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return stats


def read_range(path: Path, start: int, end: int, workers: int = DEFAULT_WORKERS,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[memoryview, bool]:
    """Bytes [start, end) of `path`, read by `workers` threads in chunks straight into one huge-page buffer
    (O_DIRECT where the filesystem takes it: no copy on the way), and whether it was read O_DIRECT."""
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes: expected a multiple of {ALIGN}, found {chunk_bytes}")
    base = start - start % ALIGN
    memory = huge_page_empty(max(-(-(end - base) // ALIGN) * ALIGN, ALIGN)).numpy().data  # the array's memoryview
    pieces = chunked([Span(path, base, end - base)], chunk_bytes)
    fd, direct = open_direct(path)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(pieces))),
                                thread_name_prefix="kvgate-direct-read") as pool:
            for future in [pool.submit(read_piece, fd, piece, memory[piece.offset - base :]) for piece in pieces]:
                future.result()
    finally:
        os.close(fd)
    return memory[start - base : end - base], direct


def read_piece(fd: int, piece: Span, view: memoryview) -> memoryview:
    """The piece's bytes, read into `view` with aligned O_DIRECT-safe requests."""
    start = piece.offset - piece.offset % ALIGN
    end = -(-(piece.offset + piece.nbytes) // ALIGN) * ALIGN
    got = 0
    while start + got < end:
        try:
            n = os.preadv(fd, [view[got : end - start]], start + got)
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(piece.path)) from None
        if n == 0:
            break
        got += n
    skip = piece.offset - start
    if got < skip + piece.nbytes:
        raise OSError(errno.EIO, f"short read: expected {piece.nbytes} bytes at offset {piece.offset}, the file "
                                 f"ends {max(got - skip, 0)} bytes in", str(piece.path))
    return view[skip : skip + piece.nbytes]

