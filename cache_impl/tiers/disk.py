"""Disk tier: one verified file per block in a directory (local NVMe or a shared mount).

Files live under `<path>/<fingerprint hex>/<first two key hex digits>/<key hex>.kvb`,
so caches of different models can share one directory without seeing each
other (the layout, and how files are reached without following links, is
`cache_impl.blockfiles`). Writes publish atomically (temp file + rename); reads
are whole-file, parallel over `read_workers` threads, optionally cold (page cache
dropped first) or O_DIRECT, and every read is verified (see `cache_impl.integrity`).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from .. import blockfiles, integrity
from ..config import DiskTierConfig
from ..keys import Fingerprint, Key
from .base import Discovered, cpu_bytes


class DiskTier:
    name = "disk"
    accounted = True

    def __init__(self, config: DiskTierConfig, fingerprint: Fingerprint) -> None:
        self.config = config
        self.fingerprint = fingerprint.digest
        self.payload_nbytes = fingerprint.layout.block_nbytes
        self.stored_nbytes = integrity.file_nbytes(self.payload_nbytes)
        self.root = Path(config.path) / fingerprint.hex
        self._dir = blockfiles.BlockDir(self.root, create=True)
        self._pool = ThreadPoolExecutor(config.read_workers, thread_name_prefix="kv-disk-read")
        self._local = threading.local()
        self._padding = bytes(integrity.padded(self.payload_nbytes) - self.payload_nbytes)
        self.shared = config.shared

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
        """Publish a staged block (an atomic rename)."""
        self._dir.publish(staged)

    def abort(self, staged: blockfiles.StagedFile) -> None:
        self._dir.discard(staged)

    # -- read ----------------------------------------------------------------

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        """Read and verify blocks in parallel; per key None (ok) or the reason it was refused."""
        if len(keys) == 1:
            return [self._read_one(keys[0], outs[0])]
        return list(self._pool.map(self._read_one, keys, outs))

    def verify(self, key: Key) -> Optional[str]:
        """Read a stored block fully and check it; None when it is whole and ours."""
        scratch = self._scratch(self.stored_nbytes)
        return self._read_verified(key, scratch)[0]

    def _scratch(self, nbytes: int) -> mmap.mmap:
        """A page-aligned per-thread buffer (O_DIRECT needs alignment)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, nbytes)
            self._local.buf = buf
        return buf

    def _read_one(self, key: Key, out: torch.Tensor) -> Optional[str]:
        direct_to_out = (
            self.config.io_mode == "buffered" and out.device.type == "cpu" and out.is_contiguous()
        )
        if direct_to_out:
            payload = out.view(-1).view(torch.uint8).numpy()
            reason, _ = self._read_verified(key, None, payload)
            return reason
        scratch = self._scratch(self.stored_nbytes)
        reason, payload = self._read_verified(key, scratch)
        if reason is None:
            out.copy_(torch.frombuffer(payload, dtype=torch.uint8).view(out.dtype).view(out.shape))
        return reason

    def _read_verified(self, key: Key, scratch, into: np.ndarray | None = None):
        """Read header and payload (into `into`, or the aligned scratch); verify; return (reason, payload view)."""
        direct = self.config.io_mode == "direct"
        try:
            fd = self._dir.open_block(key, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            return integrity.MISSING, None
        except OSError:
            return integrity.IO_ERROR, None  # also a link or a directory at the block's place: never followed
        try:
            if self.config.cold_reads and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if into is not None:
                header = bytearray(integrity.HEADER_BYTES)
                buffers, wanted = [header, into], integrity.HEADER_BYTES + into.nbytes
            else:
                header = memoryview(scratch)[: integrity.HEADER_BYTES]
                buffers, wanted = [memoryview(scratch)[: self.stored_nbytes]], self.stored_nbytes
            got = integrity.read_all(fd, buffers)
        except OSError:
            return integrity.IO_ERROR, None
        finally:
            os.close(fd)
        if got < integrity.HEADER_BYTES + self.payload_nbytes or (into is not None and got < wanted):
            return integrity.SHORT_READ, None
        reason, expected_sum = integrity.verify_header(header, self.fingerprint, key, self.payload_nbytes)
        if reason:
            return reason, None
        payload = into if into is not None else memoryview(scratch)[
            integrity.HEADER_BYTES : integrity.HEADER_BYTES + self.payload_nbytes
        ]
        if integrity.checksum(payload) != expected_sum:
            return integrity.BAD_CHECKSUM, None
        return None, payload

    # -- housekeeping ----------------------------------------------------------

    def delete(self, key: Key) -> None:
        """Remove the block's file; never raises (the index forgets the block either way), never removes a link."""
        self._dir.delete(key)

    def discover(self) -> Iterator[Discovered]:
        """Re-index: remove temp files; yield (key, refusal reason or None, mtime) per block file.

        Only the tier's own files count (see `cache_impl.blockfiles`); links and foreign names are
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
                yield found.key, None, found.mtime

    def _check_file(self, found: blockfiles.Found) -> Optional[str]:
        if self.config.verify_on_start:
            return self.verify(found.key)
        try:
            fd = self._dir.open_block(found.key)
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
        return integrity.verify_header(header, self.fingerprint, found.key, self.payload_nbytes)[0]

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop every block file's cached pages (for cold-read benchmarks)."""
        for found in self._dir.walk():
            if found.kind != blockfiles.BLOCK:
                continue
            try:
                fd = self._dir.open_block(found.key)
            except OSError:
                continue  # evicted meanwhile
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def free_bytes(self) -> int:
        """Bytes the filesystem beneath the tier still gives an unprivileged writer."""
        fs = os.statvfs(self.root)
        return fs.f_bavail * fs.f_frsize

    def snapshot(self) -> dict:
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._dir.close()

