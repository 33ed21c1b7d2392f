"""What the disk tier's filesystem really leaves it, and a reserve that leaves it nothing.

The disk tier keeps `min_free_bytes` free on the filesystem beneath it: before a write would cut into
that reserve it evicts its oldest blocks, and when it has none left to evict it refuses the block
(counted, `stores_refused`). So the bytes it can use are what it holds plus the filesystem's free room,
less the reserve, and never more than its configured capacity. A reserve the filesystem cannot hold
with one block besides (a 64 MiB filesystem under the 256 MiB default) leaves no room ever: a
configuration error, found when the tier opens. A filesystem that others filled leaves no room now:
a warning, since the room may come back.

Torch-free: plain figures in, figures and messages out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvcore.settings import ConfigError, format_size


def filesystem_room(path: Path) -> tuple[int, int]:
    """(size, free) of the filesystem beneath `path` as an unprivileged writer sees them: the blocks kept
    for root count in neither."""
    fs = os.statvfs(path)
    return (fs.f_blocks - fs.f_bfree + fs.f_bavail) * fs.f_frsize, fs.f_bavail * fs.f_frsize


def check_reserve(path: Path | str, filesystem_bytes: int, min_free_bytes: int, capacity_bytes: int,
                  block_bytes: int) -> None:
    """ConfigError, naming the field, when the tier could never store a block of `block_bytes` (one file)."""
    if capacity_bytes < block_bytes:
        raise ConfigError(f"cache.disk.capacity_bytes: expected at least one block ({format_size(block_bytes)}), "
                          f"found {format_size(capacity_bytes)}")
    if filesystem_bytes - min_free_bytes < block_bytes:
        raise ConfigError(f"cache.disk.min_free_bytes: expected at most the size of the filesystem beneath {path} "
                          f"({format_size(filesystem_bytes)}) less one block ({format_size(block_bytes)}), found "
                          f"{format_size(min_free_bytes)}: the disk tier could never store a block")


@dataclass(frozen=True)
class DiskRoom:
    """The disk tier's room now: its configured capacity, its own bytes, its filesystem's free room."""

    path: str
    capacity_bytes: int       # configured
    held_bytes: int           # the tier's block files on the filesystem
    free_bytes: int           # the filesystem's free room for an unprivileged writer
    min_free_bytes: int       # the reserve the tier leaves free
    block_bytes: int          # one block file

    @property
    def usable_bytes(self) -> int:
        """The bytes the tier can really fill: at most its capacity, at most what the filesystem leaves it."""
        return max(0, min(self.capacity_bytes, self.held_bytes + self.free_bytes - self.min_free_bytes))

    def warning(self) -> Optional[str]:
        """Why the tier can store no block now, None when it can."""
        if self.usable_bytes >= self.block_bytes:
            return None
        return (f"the disk tier can store no block now: the filesystem beneath {self.path} has "
                f"{format_size(self.free_bytes)} free and the tier keeps cache.disk.min_free_bytes "
                f"({format_size(self.min_free_bytes)}) free; it stores again once there is room (the blocks it "
                f"refuses are counted in kvgate_cache_stores_refused_total)")

    def describe(self) -> str:
        """One phrase for a start line: "12.0 GiB usable of 16.0 GiB"."""
        return f"{format_size(self.usable_bytes)} usable of {format_size(self.capacity_bytes)}"
