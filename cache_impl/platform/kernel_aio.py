"""Linux's native asynchronous I/O (io_setup / io_submit / io_getevents), reached through libc's syscall().

Why: a Python thread per read in flight pays for every system call with a hand-off of the interpreter's
lock, and on a machine with few cores the woken readers queue on it (measured inside `kvgate serve`: a
load's 31 reads issued 0.4-0.5 ms apart, the last 11-13 ms in, and the load 0.78 of fio's rate in its own
pattern). With native AIO one thread hands the kernel every read of a load, each as soon as its file is
open, and reaps them as they complete, as fio's libaio engine does. For O_DIRECT reads only: on a buffered
file io_submit reads synchronously.

`AioContext` is one kernel context: `submit_preadv` queues one vectored read, `reap` waits for at least one
completion. A context is used by one thread at a time. `supported()` says whether this machine has the
interface (Linux on x86_64 or aarch64, little-endian); a context that cannot be set up raises OSError.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# the system call numbers (x86_64's table; aarch64 uses the generic one)
_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
IOCB_CMD_PREADV = 7  # linux/aio_abi.h


class _Iocb(ctypes.Structure):
    """struct iocb (linux/aio_abi.h) on a little-endian machine: 64 bytes."""

    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32), ("aio_rw_flags", ctypes.c_int32),
                ("aio_lio_opcode", ctypes.c_uint16), ("aio_reqprio", ctypes.c_int16),
                ("aio_fildes", ctypes.c_uint32), ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64), ("aio_flags", ctypes.c_uint32),
                ("aio_resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):
    """struct io_event: the iocb's aio_data, the iocb, and its result (bytes, or a negative errno)."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def _numbers() -> dict[str, int] | None:
    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        return None
    return _SYSCALLS.get(platform.machine())


_NUMBERS = _numbers()
_libc = ctypes.CDLL(None, use_errno=True) if _NUMBERS else None
if _libc is not None:
    _libc.syscall.restype = ctypes.c_long


def machine() -> str:
    """This machine's system and architecture, as the module judges them (e.g. "linux x86_64")."""
    return f"{sys.platform} {platform.machine()}"


def supported() -> bool:
    """Whether this machine has native AIO as this module calls it (Linux, x86_64 or aarch64)."""
    return _NUMBERS is not None


def _call(name: str, *args) -> int:
    """A system call by name; OSError with its errno when it fails (EINTR retried)."""
    assert _libc is not None and _NUMBERS is not None, "native AIO is not supported here"
    while True:
        result = _libc.syscall(ctypes.c_long(_NUMBERS[name]), *args)  # ctypes releases the GIL around the call
        if result >= 0:
            return result
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, f"{name}: {os.strerror(code)}")


@dataclass(frozen=True)
class Completion:
    """One finished read: the tag given at submit, and its result (bytes read, or a negative errno)."""

    tag: int
    result: int


class AioContext:
    """A kernel AIO context for up to `depth` reads in flight, with one iocb and one iovec array per slot.

    A read's slot is its tag: `submit_preadv(slot, ...)` queues it, `reap()` gives it back. The memory the
    read lands in must stay alive until its completion is reaped.
    """

    def __init__(self, depth: int, max_iovecs: int) -> None:
        if not supported():
            raise OSError(errno.ENOSYS, f"native AIO is not supported on {machine()}")
        self.depth = depth
        self.max_iovecs = max_iovecs
        self.pid = os.getpid()   # a context is the process's own: a forked child has none of its parent's
        handle = ctypes.c_ulong(0)
        _call("io_setup", ctypes.c_long(depth), ctypes.byref(handle))
        self._handle = handle.value
        self._iocbs = (_Iocb * depth)()
        self._iovecs = np.zeros((depth, max_iovecs, 2), dtype=np.uint64)  # (iov_base, iov_len) per slot
        self._events = (_IoEvent * depth)()
        self._one = (ctypes.c_void_p * 1)()

    def submit_preadv(self, slot: int, fd: int, regions: Sequence[tuple[int, int]], offset: int = 0) -> None:
        """Queue one read of `fd` from `offset` into the (address, length) regions, tagged `slot`."""
        if len(regions) > self.max_iovecs:
            raise ValueError(f"{len(regions)} buffers, at most {self.max_iovecs} a read")
        iovecs = self._iovecs[slot]
        iovecs[: len(regions)] = regions
        iocb = self._iocbs[slot]
        ctypes.memset(ctypes.byref(iocb), 0, ctypes.sizeof(iocb))
        iocb.aio_data = slot
        iocb.aio_lio_opcode = IOCB_CMD_PREADV
        iocb.aio_fildes = fd
        iocb.aio_buf = iovecs.ctypes.data
        iocb.aio_nbytes = len(regions)
        iocb.aio_offset = offset
        self._one[0] = ctypes.addressof(iocb)
        _call("io_submit", ctypes.c_ulong(self._handle), ctypes.c_long(1), self._one)

    def reap(self, at_least: int = 1) -> list[Completion]:
        """Wait for at least `at_least` reads to finish; every finished read's completion."""
        n = _call("io_getevents", ctypes.c_ulong(self._handle), ctypes.c_long(at_least),
                  ctypes.c_long(self.depth), self._events, None)
        return [Completion(self._events[i].data, self._events[i].res) for i in range(n)]

    def close(self) -> None:
        """Destroy the context (the kernel waits for reads still in flight). Idempotent; in a forked child,
        which never had the context, only forgets it."""
        if self._handle:
            handle, self._handle = self._handle, 0
            if self.pid == os.getpid():
                _call("io_destroy", ctypes.c_ulong(handle))
