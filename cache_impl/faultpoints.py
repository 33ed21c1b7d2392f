"""Faults injected into a tier's I/O, for fault-injection tests and soaks.

`FaultInjectingTier` wraps any tier (the cache wraps its disk tier) and consults one
`FaultPoints`, which does nothing until a fault is armed (by the server's admin route or a
test). Armed faults act where real ones would:
- `disk_full`: a block write fails with ENOSPC after its data is written (staged) and
  before it is published, so nothing becomes visible (as when the device fills);
- `write_error` / `read_error`: the write or the read fails with EIO;
- `slow_disk`: every block write, and every batch of block reads, takes `delay_s` longer
  (the write's delay falls between writing the data and publishing it).
A fault lasts `duration_s` (None: until cleared); every block it acts on is counted.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import integrity

KINDS = ("disk_full", "write_error", "read_error", "slow_disk")


@dataclass(frozen=True)
class ArmedFault:
    kind: str
    until: Optional[float]    # time.monotonic() deadline, None: until cleared
    delay_s: float = 0.0

    def active(self, now: float) -> bool:
        return self.until is None or now < self.until


class FaultPoints:
    """Thread-safe set of armed I/O faults and the count of times each acted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, ArmedFault] = {}
        self.fired: dict[str, int] = dict.fromkeys(KINDS, 0)

    def arm(self, kind: str, duration_s: Optional[float] = None, delay_s: float = 0.0) -> ArmedFault:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, found {kind!r}")
        if kind == "slow_disk" and delay_s <= 0:
            raise ValueError(f"delay_s: expected a delay > 0 for slow_disk, found {delay_s!r}")
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s: expected a duration > 0 (or none: until cleared), found {duration_s!r}")
        fault = ArmedFault(kind, None if duration_s is None else time.monotonic() + duration_s, delay_s)
        with self._lock:
            self._armed[kind] = fault
        return fault

    def clear(self, kind: Optional[str] = None) -> None:
        with self._lock:
            if kind is None:
                self._armed.clear()
            else:
                self._armed.pop(kind, None)

    def armed(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return sorted(kind for kind, fault in self._armed.items() if fault.active(now))

    def _take(self, kind: str, blocks: int) -> Optional[ArmedFault]:
        if not self._armed:  # the common case: nothing armed, no lock
            return None
        with self._lock:
            fault = self._armed.get(kind)
            if fault is None or not fault.active(time.monotonic()):
                return None
            self.fired[kind] += blocks
            return fault

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

    def snapshot(self) -> dict:
        armed = self.armed()
        with self._lock:
            return {"armed": armed, "fired": dict(self.fired)}


class FaultInjectingTier:
    """A tier that behaves like `inner` except where an armed fault of `points` acts.

    Only `commit` and `read_into` are intercepted; every other verb and attribute is the
    inner tier's own.
    """

    def __init__(self, inner: Any, points: FaultPoints) -> None:
        self.inner = inner
        self.points = points

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, staged: Any) -> None:
        self.points.before_publish()  # raises the injected error: the writer then aborts the staged block
        self.inner.commit(staged)

    def read_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[Optional[str]]:
        try:
            self.points.before_read(len(keys))
        except OSError:
            return [integrity.IO_ERROR] * len(keys)
        return self.inner.read_into(keys, outs)
