"""Placement: which level holds which block, what may be evicted, and where an evicted block goes.

How it works: docs/methods/cache-and-engines.md (cache_impl/cache/placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Mapping, Optional, Protocol, Sequence, TypeVar

from cache_impl.cache.index import BlockIndex
from cache_impl.cache.keys import BlockKey
from cache_impl.cache.lru import LRUAccount
from cache_impl.cache.metrics import TierMetrics

if TYPE_CHECKING:  # annotations only: placement itself is torch-free (the sizing model replays with it)
    from cache_impl.cache.writeback import WriteBehind


class PlacedTier(Protocol):
    """What placement reads of a level's tier (the cache's `tiers.base.Tier`, the sizing model's keys-only one)."""

    @property
    def name(self) -> str: ...
    @property
    def stored_nbytes(self) -> int: ...


TierT = TypeVar("TierT", bound=PlacedTier)


@dataclass
class Level(Generic[BlockKey, TierT]):
    """One tier of the cache and what the cache keeps about it."""

    rank: int
    tier: TierT
    metrics: TierMetrics
    lru: Optional[LRUAccount[BlockKey]]     # None: the tier manages its own capacity
    writer: Optional[WriteBehind]   # None: written at once, under the lock (a memory tier)
    on_store: bool                  # the write policy writes a new block here when it is stored
    min_free_bytes: int = 0         # room to leave free on the medium beneath the tier

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def bit(self) -> int:
        return 1 << self.rank

    @property
    def account(self) -> LRUAccount[BlockKey]:
        """The level's LRU account; ValueError for a level that manages its own capacity (it has none)."""
        if self.lru is None:
            raise ValueError(f"{self.name} tier: manages its own capacity, the cache keeps no account of its blocks")
        return self.lru


class Placement(Generic[BlockKey, TierT]):
    """The index, the pins and the levels' LRU accounts; every method expects the cache's lock held."""

    def __init__(self, levels: Sequence[Level[BlockKey, TierT]]) -> None:
        self.levels = list(levels)
        self.index: BlockIndex[BlockKey] = BlockIndex()
        self.pins: dict[BlockKey, int] = {}

    # -- where blocks are --------------------------------------------------------

    def prefix(self, keys: Sequence[BlockKey], extra: Optional[Mapping[BlockKey, int]] = None) -> list[int]:
        """Level masks of the leading keys held somewhere (`extra`: bits of levels asked just now)."""
        if not extra:
            return self.index.longest_prefix(keys)
        masks = []
        for key in keys:
            mask = self.index.tiers_of(key) | extra.get(key, 0)
            if not mask:
                break
            masks.append(mask)
        return masks

    def best(self, mask: int) -> Level[BlockKey, TierT]:
        """The highest level among a mask's bits (the fastest copy)."""
        return self.levels[(mask & -mask).bit_length() - 1]

    def holds(self, level: Level[BlockKey, TierT], key: BlockKey) -> bool:
        """The level has the block, or its write there is queued."""
        return self.index.has(key, level.rank) or (level.writer is not None and key in level.writer)

    def known(self, key: BlockKey) -> bool:
        """Some accounted level has the block or is about to."""
        return bool(self.index.tiers_of(key)) or any(
            level.writer is not None and level.lru is not None and key in level.writer for level in self.levels)

    def where(self, key: BlockKey) -> list[str]:
        mask = self.index.tiers_of(key)
        return [level.name for level in self.levels if mask & level.bit]

    def lower(self, level: Level[BlockKey, TierT]) -> list[Level[BlockKey, TierT]]:
        """Accounted levels below `level`, nearest first (where an evicted block may go)."""
        return [other for other in self.levels[level.rank + 1:] if other.lru is not None]

    # -- what may move ---------------------------------------------------------------

    def is_protected(self, level: Level[BlockKey, TierT], key: BlockKey) -> bool:
        return key in self.pins or (level.writer is not None and key in level.writer)

    def victims(self, level: Level[BlockKey, TierT], nbytes: int, shortfall: int = 0) -> Optional[list[BlockKey]]:
        """Least recently used unprotected blocks whose eviction makes room for `nbytes`
        (and frees at least `shortfall` bytes of the medium); None when that cannot be done."""
        return level.account.victims(nbytes, lambda key: self.is_protected(level, key), shortfall)

    def unprotected(self, level: Level[BlockKey, TierT]) -> list[BlockKey]:
        return [key for key in level.account if not self.is_protected(level, key)]

    # -- recording moves -----------------------------------------------------------------

    def reserve(self, level: Level[BlockKey, TierT], key: BlockKey) -> None:
        """Account a block whose write to the level is queued (not readable there yet)."""
        level.account.add(key, level.tier.stored_nbytes)

    def publish(self, level: Level[BlockKey, TierT], key: BlockKey) -> None:
        """A reserved block is now whole on the level."""
        self.index.add(key, level.rank)

    def add(self, level: Level[BlockKey, TierT], key: BlockKey) -> None:
        self.reserve(level, key)
        self.publish(level, key)

    def remove(self, level: Level[BlockKey, TierT], key: BlockKey) -> None:
        if level.lru is not None:
            level.lru.remove(key)
        self.index.discard(key, level.rank)

    def touch(self, level: Level[BlockKey, TierT], key: BlockKey) -> None:
        if level.lru is not None:
            level.lru.touch(key)

    def touch_everywhere(self, key: BlockKey) -> None:
        for level in self.levels:
            self.touch(level, key)

    def pin(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            left = self.pins.get(key, 0) - 1
            if left > 0:
                self.pins[key] = left
            else:
                self.pins.pop(key, None)
