"""Where each block lives: one dict from key to a bit set of tiers.

Keys chain their parents, so the longest cached prefix of a prompt is the
longest run of its keys, from the first, that are present in some tier.
"""

from __future__ import annotations

from typing import Generic, Sequence

from cache_impl.cache.keys import BlockKey


class BlockIndex(Generic[BlockKey]):
    """A block's key -> bit set of tier numbers (bit t set: tier t holds a readable copy)."""

    def __init__(self) -> None:
        self._where: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._where

    def add(self, key: BlockKey, tier: int) -> None:
        self._where[key] = self._where.get(key, 0) | (1 << tier)

    def discard(self, key: BlockKey, tier: int) -> None:
        mask = self._where.get(key, 0) & ~(1 << tier)
        if mask:
            self._where[key] = mask
        else:
            self._where.pop(key, None)

    def has(self, key: BlockKey, tier: int) -> bool:
        return bool(self._where.get(key, 0) & (1 << tier))

    def tiers_of(self, key: BlockKey) -> int:
        return self._where.get(key, 0)

    def longest_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Tier masks of the leading keys that are present anywhere (stops at the first absent one)."""
        where = self._where
        masks: list[int] = []
        for key in keys:
            mask = where.get(key, 0)
            if not mask:
                break
            masks.append(mask)
        return masks
