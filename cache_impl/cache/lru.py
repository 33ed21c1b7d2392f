"""Byte-capacity LRU bookkeeping shared by every tier (data lives in the tier)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator

from cache_impl.cache.keys import BlockKey


class LRUAccount(Generic[BlockKey]):
    """Which keys a tier holds, their sizes, and their recency (oldest first)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[BlockKey, int] = OrderedDict()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(list(self._entries))

    def add(self, key: BlockKey, nbytes: int) -> None:
        """Record a key as most recently used; the caller made room first."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = nbytes
        self.used_bytes += nbytes

    def touch(self, key: BlockKey) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def remove(self, key: BlockKey) -> int:
        """Forget a key; returns its size (0 if it was not there)."""
        nbytes = self._entries.pop(key, 0)
        self.used_bytes -= nbytes
        return nbytes

    def victims(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                shortfall: int = 0) -> list[BlockKey] | None:
        """Least recently used unprotected keys whose removal frees room for `nbytes`, and at
        least `shortfall` bytes besides (space the medium beneath lacks).

        Returns [] when it already fits, None when it cannot be made to fit
        (too large, or too much of the tier is protected).
        """
        if nbytes > self.capacity_bytes:
            return None
        needed = max(self.used_bytes + nbytes - self.capacity_bytes, shortfall)
        chosen: list[BlockKey] = []
        for key, size in self._entries.items():
            if needed <= 0:
                break
            if is_protected(key):
                continue
            chosen.append(key)
            needed -= size
        return chosen if needed <= 0 else None
