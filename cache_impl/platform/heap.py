"""Handing freed heap memory back to the OS (glibc's `malloc_trim`), for an engine whose buffers vary in size.

Each request's KV and each prefill chunk's activations are megabytes of a size that depends
on the prompt. glibc serves them from its arenas once its mmap threshold has risen past them
(it rises to the largest block freed, up to 32 MiB), and a freed block in the middle of an
arena stays resident until a block of a fitting size comes back. In 9-minute soaks of the
embedded candidate (tools/memory_soak.py, G4's quick load, the device and host tiers evicted
every 90 s as each G4 fault does) the server's memory outside the cache pools stepped from 357
to 368 MiB over the first evictions and held there, with 44-57 MiB free inside the arenas;
trimmed, it stayed at 328-332 MiB with 14-21 MiB free. `malloc_trim(0)` returns every whole
free page of every arena.

`HeapTrimmer.released(nbytes)` counts what the caller let go and trims once `every_bytes` have
been released since the last trim, so the cost (a walk of the arenas' free lists, and the
page faults when the memory is used again) comes once every few requests, never per token.
Without glibc (musl, macOS) it does nothing.

Trimming returns whole free pages only; a page that still holds a live chunk stays. Under G4's
faults (a disk_full's refused stores drop their write-behind copies in bursts) the arenas grew
anyway: a 2-hour soak with a fault every 4 minutes grew +12.1 MiB/h [+10.2, +14.4] outside the
cache pools, with the Python heap flat (tracemalloc 88.5 -> 88.6 MiB) and the arenas' free space
47 -> 121 MiB. The cause is glibc's sliding mmap threshold: once a block of several MiB is freed,
blocks up to that size come from the arenas for the rest of the process's life. `fix_mmap_threshold`
pins it (which turns the sliding off), so every block of 128 KiB or more is its own mapping and goes
back to the OS whole when freed; `kvgate serve` pins it at start. In a 6-minute soak the server held
369-374 MiB pinned against 368-389 MiB sliding.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Callable, Optional

DEFAULT_EVERY_BYTES = 32 * 2**20
SERVE_MMAP_THRESHOLD = 128 * 2**10   # glibc's own starting threshold, kept from sliding up
_M_MMAP_THRESHOLD = -3               # mallopt's parameter number (malloc.h)


def _libc_function(name: str) -> Optional[Callable]:
    """A glibc function by name, or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None where the C library has none."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def fix_mmap_threshold(nbytes: int = SERVE_MMAP_THRESHOLD) -> bool:
    """Blocks of `nbytes` or more are mapped on their own from now on, in every thread (glibc's threshold
    pinned, no longer sliding up to the largest block freed). False where the C library has no mallopt."""
    if nbytes < 1:
        raise ValueError(f"nbytes: expected at least 1, found {nbytes}")
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


class HeapTrimmer:
    """Trims the C heap once every `every_bytes` the caller reports released (thread-safe)."""

    def __init__(self, every_bytes: int = DEFAULT_EVERY_BYTES) -> None:
        if every_bytes < 1:
            raise ValueError(f"every_bytes: expected at least 1, found {every_bytes}")
        self.every_bytes = every_bytes
        self.trims = 0
        self._trim = _malloc_trim()
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def released(self, nbytes: int) -> bool:
        """Count `nbytes` let go; trim when enough has been since the last trim. True when it trimmed."""
        with self._lock:
            self._pending += nbytes
            if self._trim is None or self._pending < self.every_bytes:
                return False
            self._pending = 0
            self.trims += 1
        self._trim(0)
        return True
