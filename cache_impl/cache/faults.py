"""Faults in the cache's disk tier, for fault-injection tests and soaks: every kind, and the armed state.

How it works: docs/methods/fault-oracle.md (cache_impl/cache/faults.py).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from cache_impl.cache import integrity

IO_FAULTS = ("disk_full", "write_error", "read_error", "slow_disk")
BLOCK_FAULTS = ("flip_byte", "truncate", "delete", "swap")
# What the cache reports when it meets each damaged block (kvgate_cache_corrupt_blocks{reason}).
EXPECTED_REASON = {"flip_byte": integrity.BAD_CHECKSUM, "truncate": integrity.SHORT_READ,
                   "delete": integrity.MISSING, "swap": integrity.WRONG_KEY}
# A fault outlives no soak (a day) and slows a read by at most a minute: 1e308 s is a typo, not a test.
FAULT_LIMITS = {"duration_s": 86400, "delay_ms": 60000}


# -- I/O faults: armed state and the tier's hooks ----------------------------------------


@dataclass(frozen=True)
class ArmedFault:
    kind: str
    until: Optional[float]    # time.monotonic() deadline, None: until cleared
    delay_s: float = 0.0

    def active(self, now: float) -> bool:
        return self.until is None or now < self.until


class FaultPoints:
    """Thread-safe set of armed I/O faults, the count of times each acted, and the hooks that act them out.

    `tier` (a tier with a `faults` attribute: the disk tier; None: no tier to act in) gets this object
    as its `faults` while a fault is armed, and None otherwise.
    """

    def __init__(self, tier: Any = None) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, ArmedFault] = {}
        self._tier = tier
        self.fired: dict[str, int] = dict.fromkeys(IO_FAULTS, 0)

    def arm(self, kind: str, duration_s: Optional[float] = None, delay_s: float = 0.0) -> ArmedFault:
        if kind not in IO_FAULTS:
            raise ValueError(f"kind: expected one of {', '.join(IO_FAULTS)}, found {kind!r}")
        if kind == "slow_disk" and delay_s <= 0:
            raise ValueError(f"delay_s: expected a delay > 0 for slow_disk, found {delay_s!r}")
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s: expected a duration > 0 (or none: until cleared), found {duration_s!r}")
        fault = ArmedFault(kind, None if duration_s is None else time.monotonic() + duration_s, delay_s)
        with self._lock:
            self._armed[kind] = fault
            self._install()
        return fault

    def clear(self, kind: Optional[str] = None) -> None:
        with self._lock:
            if kind is None:
                self._armed.clear()
            else:
                self._armed.pop(kind, None)
            self._install()

    def armed(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return sorted(kind for kind, fault in self._armed.items() if fault.active(now))

    def snapshot(self) -> dict:
        armed = self.armed()
        with self._lock:
            return {"armed": armed, "fired": dict(self.fired)}

    def _install(self) -> None:
        """Hook into the tier while a fault is armed, and out of it when none is (called holding the lock)."""
        if self._tier is not None:
            self._tier.faults = self if self._armed else None

    # -- the hooks the disk tier calls while armed ----------------------------------------

    def before_publish(self) -> None:
        """Called after a block's data is staged and before it becomes visible."""
        self._act(1, ("disk_full", errno.ENOSPC), ("write_error", errno.EIO))

    def before_read(self, blocks: int) -> None:
        """Called before a batch of `blocks` block reads."""
        self._act(blocks, ("read_error", errno.EIO))

    def _act(self, blocks: int, *failures: tuple[str, int]) -> None:
        """Sleep when the disk is slow; raise the first armed failure among `failures`."""
        slow = self._take("slow_disk", blocks)
        if slow is not None:
            time.sleep(slow.delay_s)
        for kind, code in failures:
            if self._take(kind, blocks) is not None:
                raise OSError(code, f"{os.strerror(code)} (injected {kind})")

    def _take(self, kind: str, blocks: int) -> Optional[ArmedFault]:
        """The armed fault of `kind`, counted as acting on `blocks`; None when none is. A fault that has run
        out is disarmed here (and with the last one the hooks leave the tier)."""
        if not self._armed:  # disarmed since the tier took this hook: no lock
            return None
        with self._lock:
            fault = self._armed.get(kind)
            if fault is not None and not fault.active(time.monotonic()):
                del self._armed[kind]
                self._install()
                fault = None
            if fault is None:
                return None
            self.fired[kind] += blocks
            return fault


# -- stored-block faults ---------------------------------------------------------------------


def flip_byte(path: Path, offset: Optional[int] = None) -> int:
    """Invert one byte of the payload (default: its middle), in place; returns the file offset."""
    with open(path, "r+b") as f:
        if offset is None:
            payload = integrity.stored_payload_nbytes(f.read(integrity.HEADER_BYTES)) or 0
            offset = integrity.HEADER_BYTES + payload // 2
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return offset


def truncate(path: Path, keep: Optional[int] = None) -> int:
    """Cut the file (default: to half its size), as a torn write would; returns the new size."""
    keep = os.path.getsize(path) // 2 if keep is None else keep
    os.truncate(path, keep)
    return keep


def delete(path: Path) -> None:
    os.unlink(path)


def swap(path: Path, donor: Path) -> None:
    """Replace the block with another block's whole file: checksums hold, the key inside is wrong."""
    temp = path.with_name(path.name + ".swap")
    shutil.copyfile(donor, temp)
    os.replace(temp, path)


def damage_block(kind: str, path: Path, donor: Optional[Path] = None) -> dict:
    """Apply one stored-block fault; a description of what was done."""
    if kind == "flip_byte":
        return {"kind": kind, "path": str(path), "offset": flip_byte(path)}
    if kind == "truncate":
        return {"kind": kind, "path": str(path), "size": truncate(path)}
    if kind == "delete":
        delete(path)
        return {"kind": kind, "path": str(path)}
    if kind == "swap":
        if donor is None:
            raise ValueError("swap: needs a donor block file")
        swap(path, donor)
        return {"kind": kind, "path": str(path), "donor": str(donor)}
    raise ValueError(f"kind: expected one of {', '.join(BLOCK_FAULTS)}, found {kind!r}")
