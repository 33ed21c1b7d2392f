"""Disk tier: one verified file per block in a directory (local NVMe or a shared mount).

How it works: docs/methods/storage-best.md (cache_impl/cache/tiers/disk.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from cache_impl.cache import blockfiles, integrity
from cache_impl.cache.config import DiskTierConfig
from cache_impl.cache.disk_room import check_reserve, filesystem_room
from cache_impl.cache.faults import FaultPoints
from cache_impl.cache.keys import Fingerprint, Key
from cache_impl.cache.tiers.base import Discovered, cpu_bytes
from cache_impl.cache.tiers.disk_probe import IoMode, IoProbe, probe_io_mode
from cache_impl.cache.tiers.disk_submit import SubmittedReads, read_submitted
from cache_impl.platform import buffers, kernel_aio
from cache_impl.platform.thread_pools import started_pool


class DiskTier:
    name = "disk"
    accounted = True
    faults: Optional[FaultPoints] = None  # set by FaultPoints while a fault is armed

    def __init__(self, config: DiskTierConfig, fingerprint: Fingerprint) -> None:
        self.config = config
        self.fingerprint = fingerprint.digest
        self.payload_nbytes = fingerprint.layout.block_nbytes
        self.stored_nbytes = integrity.file_nbytes(self.payload_nbytes)
        self.root = Path(config.path) / fingerprint.hex
        self._dir = blockfiles.BlockDir(self.root, create=True)
        check_reserve(config.path, filesystem_room(self.root)[0], config.min_free_bytes, config.capacity_bytes,
                      self.stored_nbytes)
        self._local = threading.local()
        self._padding = bytes(integrity.padded(self.payload_nbytes) - self.payload_nbytes)
        # every reader started now with its staging buffers, read_workers x one padded block (thread_pools.py:
        # the server's memory does not step up the first time reads are slow)
        self._pool = started_pool(config.read_workers, "kv-disk-read", self._set_up_reader)
        self.shared = config.shared
        # direct reads into host memory: through native AIO (disk_submit.py) unless threads are asked for (the
        # config refuses read_engine aio where the kernel has none)
        self.submits: bool = config.read_engine != "threads" and kernel_aio.supported()
        self.submit_error: Optional[str] = None   # why a reader could not set up its AIO context (it used threads)
        self._submitters: list[SubmittedReads] = []
        self._submitters_lock = threading.Lock()
        self.probe: Optional[IoProbe] = None
        # with "auto", reads are buffered until the probe has chosen (it sets each mode it times itself)
        self.io_mode: IoMode = "buffered" if config.io_mode == "auto" else config.io_mode
        if config.io_mode == "auto":
            self.probe = probe_io_mode(self)
            self.io_mode = self.probe.chosen

    def path_for(self, key: Key) -> Path:
        """Where the key's block file is (for messages and tests)."""
        return self._dir.path_for(key)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether a block file (a regular file, not a link) stands at each key's place; not verified."""
        return [self._dir.contains(key) for key in keys]

    def view(self, key: Key) -> None:
        return None  # the bytes are on disk

    # -- write ---------------------------------------------------------------

    def stage(self, key: Key, block: torch.Tensor) -> blockfiles.StagedFile:
        """Write the block's file under a temp name; raises OSError (ENOSPC, EIO, ...) leaving nothing."""
        payload = cpu_bytes(block)
        if payload.nbytes != self.payload_nbytes:
            raise ValueError(f"disk tier: block has {payload.nbytes} bytes, layout says {self.payload_nbytes}")
        header = integrity.encode_header(self.fingerprint, key, payload.nbytes, integrity.checksum(payload))
        return self._dir.stage(key, [header, payload, self._padding], fsync=self.config.fsync)

    def commit(self, staged: blockfiles.StagedFile) -> None:
        """Publish a staged block (an atomic rename); an armed fault may raise first (the writer then aborts it)."""
        faults = self.faults
        if faults is not None:
            faults.before_publish()
        self._dir.publish(staged)

    def abort(self, staged: blockfiles.StagedFile) -> None:
        self._dir.discard(staged)

    # -- read ----------------------------------------------------------------

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        """Read and verify blocks, `read_workers` at a time; per key None (ok) or the reason it was refused.

        An out may be any tensor of the block's shape, a strided view included (a block of a
        request's KV); a refused block leaves its out's contents unspecified. O_DIRECT reads into
        host memory go through this thread's AIO context (disk_submit.py), the others through threads.
        """
        faults = self.faults
        if faults is not None:
            try:
                faults.before_read(len(keys))
            except OSError:
                return [integrity.IO_ERROR] * len(keys)
        reasons: list[Optional[str]] = [None] * len(keys)
        left: Sequence[int] = range(len(keys))
        reads = self._submitter() if self.io_mode == "direct" and self.submits else None
        if reads is not None:
            left = read_submitted(reads, self._open_direct, keys, lambda i: self._submittable(outs[i]),
                                  self._check_read, reasons)
        self._read_threaded(left, keys, outs, reasons)
        return reasons

    def _read_threaded(self, indices: Sequence[int], keys: Sequence[Key], outs: Sequence[torch.Tensor],
                       reasons: list[Optional[str]]) -> None:
        """Read the blocks at `indices` with up to `read_workers` threads, the calling one included."""
        pending = iter(indices)  # shared by the workers: each takes the next block when it is done

        def work() -> None:
            for i in pending:
                reasons[i] = self._read_one(keys[i], outs[i])

        workers = [self._pool.submit(work) for _ in range(min(self.config.read_workers, len(indices)) - 1)]
        work()
        for worker in workers:
            worker.result()

    def _submittable(self, out: torch.Tensor) -> Optional[buffers.Spans]:
        """`out`'s spans when an AIO read can land in them (host memory, aligned for O_DIRECT, few enough
        runs), else None."""
        spans = self._spans(out)
        if spans is None or not spans.aligned or len(spans.regions) >= integrity.IOV_MAX:  # + the header's buffer
            return None
        return spans

    def _spans(self, out: torch.Tensor) -> Optional[buffers.Spans]:
        """`out`'s bytes as spans (None when its innermost run is strided or it is not in host memory); a
        ValueError when they are not one block's."""
        spans = buffers.byte_spans(out)
        if spans is not None and spans.nbytes != self.payload_nbytes:
            raise ValueError(f"disk tier: out has {spans.nbytes} bytes, layout says {self.payload_nbytes}")
        return spans

    def _submitter(self) -> Optional[SubmittedReads]:
        """This thread's AIO context, set up at its first direct read; None when it cannot be."""
        reads: Optional[SubmittedReads] = getattr(self._local, "submitted", None)
        if reads is not None and reads.context.pid == os.getpid():
            return reads                     # (a forked child sets up its own: its parent's is not its)
        try:
            reads = SubmittedReads(self.config.read_workers)
        except OSError as error:   # e.g. EAGAIN: the system's fs.aio-max-nr reached
            self.submit_error = f"native AIO context not set up ({error}): this thread reads with threads"
            return None
        with self._submitters_lock:
            self._submitters.append(reads)
        self._local.submitted = reads
        return reads

    def _open_direct(self, key: Key) -> int:
        return self._dir.open_block(key, os.O_RDONLY | os.O_DIRECT)

    def _check_read(self, key: Key, header: memoryview, payload: Sequence[memoryview], got: int) -> Optional[str]:
        return integrity.verify_read(header, payload, got, self.fingerprint, key, self.payload_nbytes)

    def _set_up_reader(self) -> None:
        """A reader's thread-local buffers, made when its thread starts (pinned ones only where CUDA is)."""
        self._scratch(pinned=False)
        self._header()
        if torch.cuda.is_available():
            self._scratch(pinned=True)

    def verify(self, key: Key) -> Optional[str]:
        """Read a stored block fully and check it; None when it is whole and ours."""
        return self._read_staged(key, pinned=False)[0]

    def _scratch(self, pinned: bool) -> tuple[torch.Tensor, memoryview]:
        """This thread's aligned staging buffer for one padded payload (O_DIRECT needs alignment), pinned
        for copies to a CUDA device: as a tensor and as the memoryview a read fills."""
        name = "pinned" if pinned else "staging"
        buf = getattr(self._local, name, None)
        if buf is None:
            tensor = buffers.aligned_empty((integrity.padded(self.payload_nbytes),), torch.uint8, "cpu",
                                           pin_memory=pinned)
            buf = (tensor, tensor.numpy().data)  # .data: numpy's stubs give ndarray __buffer__ from Python 3.12 only
            setattr(self._local, name, buf)
        return buf

    def _header(self) -> memoryview:
        """This thread's aligned buffer for a block file's header."""
        header = getattr(self._local, "header", None)
        if header is None:
            header = buffers.aligned_empty((integrity.HEADER_BYTES,), torch.uint8, "cpu").numpy().data
            self._local.header = header
        return header

    def _read_one(self, key: Key, out: torch.Tensor) -> Optional[str]:
        """Read straight into `out` when it can take the read (for O_DIRECT: aligned), else through staging."""
        spans = self._spans(out)
        if spans is not None and (spans.aligned or self.io_mode != "direct"):
            return self._read_verified(key, spans.views)
        reason, staged = self._read_staged(key, pinned=out.is_cuda)
        if reason is None:
            out.copy_(staged.view(out.dtype).view(out.shape))
        return reason

    def _read_staged(self, key: Key, pinned: bool) -> tuple[Optional[str], torch.Tensor]:
        """Read and verify into this thread's staging buffer; (reason or None, the payload there)."""
        staging, view = self._scratch(pinned)
        reason = self._read_verified(key, [view], [view[: self.payload_nbytes]])
        return reason, staging[: self.payload_nbytes]

    def _read_verified(self, key: Key, into: Sequence[memoryview], payload: Sequence[memoryview] | None = None,
                       ) -> Optional[str]:
        """One preadv of the block file's header and payload into `into`; verify `payload` (default: all of
        `into`, which may hold padding past it); None or the reason it was refused."""
        direct = self.io_mode == "direct"
        try:
            fd = self._dir.open_block(key, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            return integrity.MISSING
        except OSError:
            return integrity.IO_ERROR  # also a link or a directory at the block's place: never followed
        header = self._header()
        try:
            if self.config.cold_reads and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = integrity.read_all(fd, [header, *into])
        except OSError:
            return integrity.IO_ERROR
        finally:
            os.close(fd)
        return self._check_read(key, header, into if payload is None else payload, got)

    # -- housekeeping ----------------------------------------------------------

    def delete(self, key: Key) -> None:
        """Remove the block's file; never raises (the index forgets the block either way), never removes a link."""
        self._dir.delete(key)

    def discover(self) -> Iterator[Discovered]:
        """Re-index: remove temp files; yield (key, refusal reason or None, mtime) per block file.

        Only the tier's own files count (see `cache_impl.cache.blockfiles`); links and foreign names are
        left alone. Blocks are checked fully when `verify_on_start`, else by header only.
        A refused block is deleted before it is yielded.
        """
        files = []
        for found in self._dir.walk():
            if found.kind == blockfiles.TEMP:
                self._dir.unlink(found.sub, found.name)
            elif found.kind == blockfiles.BLOCK:
                files.append(found)
        for found, reason in zip(files, self._pool.map(self._check_file, files)):
            if reason:
                self._dir.unlink(found.sub, found.name)
                yield None, reason, 0.0
            else:
                yield found.block_key, None, found.mtime

    def _check_file(self, found: blockfiles.Found) -> Optional[str]:
        if self.config.verify_on_start:
            return self.verify(found.block_key)
        try:
            fd = self._dir.open_block(found.block_key)
        except FileNotFoundError:
            return integrity.MISSING
        except OSError:
            return integrity.IO_ERROR
        try:
            header = os.pread(fd, integrity.HEADER_BYTES, 0)
            if os.fstat(fd).st_size < self.stored_nbytes:
                return integrity.SHORT_READ
        except OSError:
            return integrity.IO_ERROR
        finally:
            os.close(fd)
        return integrity.verify_header(header, self.fingerprint, found.block_key, self.payload_nbytes)[0]

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop every block file's cached pages (for cold-read benchmarks)."""
        for found in self._dir.walk():
            if found.kind == blockfiles.BLOCK:
                self.drop_block_pages(found.block_key)

    def drop_block_pages(self, key: Key) -> None:
        """Write back and drop one block file's cached pages; nothing when it is gone."""
        try:
            fd = self._dir.open_block(key)
        except OSError:
            return  # evicted meanwhile
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def free_bytes(self) -> int:
        """Bytes the filesystem beneath the tier still gives an unprivileged writer."""
        return filesystem_room(self.root)[1]

    def snapshot(self) -> dict:
        """The I/O mode reads use (with `io_mode: auto`, the start-up probe that chose it), and the temp files
        in the tier now (writes in flight; one that stays is a leak)."""
        return {"io_mode": self.io_mode, "temp_files": self._dir.temp_files(),
                "read_engine": "aio" if self.submits and self.io_mode == "direct" else "threads",
                **({"read_engine_error": self.submit_error} if self.submit_error else {}),
                **({"io_probe": self.probe.to_dict()} if self.probe else {})}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._submitters_lock:
            for reads in self._submitters:
                reads.close()
            self._submitters.clear()
        self._dir.close()

