"""Handing freed heap memory back to the OS (glibc's `malloc_trim`), for an engine whose buffers vary in size.

How it works: docs/methods/soak-trends.md (cache_impl/platform/heap.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # ctypes' base class of foreign functions (documented as ctypes._CFuncPtr)
    from _ctypes import CFuncPtr

DEFAULT_EVERY_BYTES = 32 * 2**20
SERVE_MMAP_THRESHOLD = 128 * 2**10   # glibc's own starting threshold, kept from sliding up
_M_MMAP_THRESHOLD = -3               # mallopt's parameter number (malloc.h)


def _libc_function(name: str) -> Optional[CFuncPtr]:
    """A glibc function by name (a ctypes foreign function, whose argument and result types are set on it), or
    None where the C library has none."""
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
