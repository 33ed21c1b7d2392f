"""TieredKVCache: lookup, load, store, promote, evict (demote).

How it works: docs/methods/cache-and-engines.md (cache_impl/cache/manager.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from cache_impl.cache import integrity
from cache_impl.cache.config import CacheConfig, ConfigError
from cache_impl.cache.disk_room import DiskRoom
from cache_impl.cache.faults import FaultPoints
from cache_impl.cache.keys import Fingerprint, Key, block_keys
from cache_impl.cache.lru import LRUAccount
from cache_impl.cache.metrics import TierMetrics
from cache_impl.cache.placement import Level, Placement
from cache_impl.cache.tiers.base import Tier, write_block
from cache_impl.cache.tiers.device import DeviceTier
from cache_impl.cache.tiers.disk import DiskTier
from cache_impl.cache.tiers.host import HostTier
from cache_impl.cache.tiers.remote import RemoteTier
from cache_impl.cache.writeback import WriteBehind
from cache_impl.platform.buffers import aligned_empty

CacheLevel = Level[Key, Tier]     # a level of the cache: its tier and what placement keeps of it, by block key


def resolve_device(setting: str) -> torch.device:
    """"auto" means CUDA when present, the CPU otherwise."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cache.device: expected a device that exists, found 'cuda' (no CUDA device here)")
    return torch.device(setting)


@dataclass(frozen=True)
class PrefixMatch:
    """The result of a lookup: the prompt's block keys and where each cached leading block lives."""

    keys: list[Key]
    tiers: list[str]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_tokens(self) -> int:
        return len(self.tiers) * self.block_size


@dataclass(frozen=True)
class LoadResult:
    """What a load copied: the leading blocks' keys and the tier each came from."""

    keys: list[Key]
    sources: list[str]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_size


@dataclass(frozen=True)
class LoadedPrefix(LoadResult):
    """A load into fresh tensors: `blocks[i]` is block i, [layers, 2, kv_heads, block_size, head_dim]."""

    blocks: list[torch.Tensor] = field(default_factory=list)


BlockOut = Callable[[int], torch.Tensor]  # block index -> where its KV goes


class TieredKVCache:
    """A tiered, verified, content-addressed KV block cache (device -> host -> disk -> shared pool)."""

    def __init__(self, config: CacheConfig, fingerprint: Fingerprint, device: torch.device | None = None) -> None:
        if config.block_size != fingerprint.layout.block_size:
            raise ConfigError(
                f"cache.block_size: expected the KV layout's block size {fingerprint.layout.block_size}, "
                f"found {config.block_size}"
            )
        self.config = config
        self.fingerprint = fingerprint
        self.layout = fingerprint.layout
        self.device = device or resolve_device(config.device)
        self._lock = threading.Condition(threading.RLock())
        self.levels = self._build_levels()
        self._by_name = {level.name: level for level in self.levels}
        # Nothing armed unless a test or the admin route arms it; only then does the disk tier call its hooks.
        self.faults = FaultPoints(self._by_name["disk"].tier if "disk" in self._by_name else None)
        self.placement = Placement(self.levels)
        self.reindex_removed = 0
        for level in self.levels:
            if level.lru is not None:
                self._reindex(level)

    def _build_levels(self) -> list[CacheLevel]:
        config, layout = self.config, self.layout
        through = config.write_policy == "write-through"
        tiers: list[tuple[Tier, int, bool, bool, int]] = []  # tier, capacity (-1: its own), on store, behind, reserve
        if config.device_capacity_blocks:
            tiers.append((DeviceTier(layout, config.device_capacity_blocks, self.device),
                          config.device_capacity_blocks * layout.block_nbytes, True, False, 0))
        if config.host_capacity_bytes >= layout.block_nbytes:
            host = HostTier(layout, config.host_capacity_bytes, pin_memory=self.device.type == "cuda")
            tiers.append((host, host.num_slots * layout.block_nbytes, through or not tiers, False, 0))
        if config.disk is not None:
            disk = DiskTier(config.disk, self.fingerprint)
            tiers.append((disk, config.disk.capacity_bytes, through, True, config.disk.min_free_bytes))
        if config.remote is not None:  # published at once, whatever the policy: other nodes may need it
            remote = RemoteTier(config.remote, self.fingerprint)
            remote.wait_connected(config.remote.timeout_s)  # a pool that is up serves at once
            tiers.append((remote, -1, True, True, 0))
        levels = []
        for rank, (tier, capacity, on_store, behind, reserve) in enumerate(tiers):
            lru: Optional[LRUAccount[Key]] = LRUAccount(capacity) if capacity >= 0 else None
            level = Level(rank, tier, TierMetrics(), lru, None, on_store, reserve)
            if behind:
                level.writer = WriteBehind(tier, self._lock, self._on_written(level), self._room_when_full(level))
            levels.append(level)
        return levels

    # -- queries -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def tiers(self) -> list[str]:
        """Names of the enabled tiers, top-down."""
        return [level.name for level in self.levels]

    def tier(self, name: str) -> Tier:
        """The tier object by name ("device", "host", "disk", "remote"); KeyError when it is not enabled."""
        if name not in self._by_name:
            raise KeyError(f"tier {name!r} is not enabled (enabled: {self.tiers})")
        return self._by_name[name].tier

    def disk_tier(self) -> Optional[DiskTier]:
        """The disk tier as what it is (its block files' paths, its probe); None when it is not enabled."""
        level = self._by_name.get("disk")
        if level is None:
            return None
        if not isinstance(level.tier, DiskTier):
            raise TypeError(f"the disk level holds a {type(level.tier).__name__}, not a DiskTier")
        return level.tier

    def keys_for(self, tokens: Sequence[int] | np.ndarray) -> list[Key]:
        return block_keys(tokens, self.fingerprint.digest, self.block_size)

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> PrefixMatch:
        """Longest locally indexed prefix of `tokens` and the best tier of each of its blocks (no side effects)."""
        keys = self.keys_for(tokens)
        return PrefixMatch(keys, self.lookup_keys(keys), self.block_size)

    def lookup_keys(self, keys: Sequence[Key]) -> list[str]:
        """The best tier of each leading block of `keys` the cache holds (a chain of block keys, e.g. from
        `keys_for` or another process that computed them with this cache's fingerprint)."""
        with self._lock:
            return [self.placement.best(m).name for m in self.placement.prefix(list(keys))]

    def where(self, key: Key) -> list[str]:
        """Every tier that holds a readable copy of the block (the shared pool is not asked)."""
        with self._lock:
            return self.placement.where(key)

    # -- load ----------------------------------------------------------------

    def load_into(self, tokens: Sequence[int] | np.ndarray, out: BlockOut,
                  max_blocks: int | None = None) -> LoadResult:
        """Copy the longest cached prefix of `tokens` into `out(i)` for each block i, from the
        highest tier that holds each block.

        A block that fails verification is removed and counted, and the prefix ends before it.
        `out(i)` may be any tensor of the block's shape on any device (e.g. a view of the
        request's KV); blocks after the returned prefix may have been written too.
        """
        return self.load_keys_into(self.keys_for(tokens)[:max_blocks], out)

    def load_keys_into(self, keys: Sequence[Key], out: BlockOut) -> LoadResult:
        """`load_into` by block keys (a chain, as `keys_for` makes them, from any block of it on: an engine that
        holds the blocks before it, or scopes its keys itself, e.g. by a request's cache salt): `out(j)`
        receives the block of `keys[j]`."""
        return self._load(list(keys), lambda planned: out)

    def load(self, tokens: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> LoadedPrefix:
        """`load_into` fresh tensors on the cache's device; returns them with the prefix."""
        made: list[torch.Tensor] = []

        def fresh(planned: int) -> BlockOut:
            made.append(aligned_empty((planned, *self.layout.block_shape), self.layout.torch_dtype, self.device))
            return made[0].__getitem__

        result = self._load(self.keys_for(tokens)[:max_blocks], fresh)
        return LoadedPrefix(result.keys, result.sources, result.block_size, list(made[0][: result.num_blocks]))

    def _load(self, keys: list[Key], destination: Callable[[int], BlockOut]) -> LoadResult:
        """Plan (pinned), read into `destination(number of planned blocks)`, then commit what was good."""
        plan = self._plan_load(keys)
        failures: dict[Key, tuple[CacheLevel, str]] = {}
        try:
            failures = self._read(plan, destination(len(plan)))
        finally:
            kept = self._finish_load(plan, failures, ended_on_miss=bool(failures) or len(plan) < len(keys))
        return LoadResult([key for key, _ in kept], [level.name for _, level in kept], self.block_size)

    def _plan_load(self, keys: list[Key]) -> list[tuple[Key, CacheLevel]]:
        """Pin the cached prefix; each block with the level to read it from."""
        extra = self._ask_shared_levels(keys)
        with self._lock:
            masks = self.placement.prefix(keys, extra)
            plan = [(key, self.placement.best(mask)) for key, mask in zip(keys, masks)]
            self.placement.pin([key for key, _ in plan])
        return plan

    def _ask_shared_levels(self, keys: list[Key]) -> dict[Key, int]:
        """Ask each tier other nodes write into (a shared disk, the pool) which blocks after the
        prefix known here it holds; index what an accounted one holds, return the others' bits.

        Asked outside the lock (a pool is a network call); the read verifies the blocks as usual.
        """
        extra: dict[Key, int] = {}
        for level in self.levels:
            if not level.tier.shared:
                continue
            with self._lock:
                rest = keys[len(self.placement.prefix(keys, extra)):]
            held = rest[: _leading_true(level.tier.contains(rest))]
            if level.lru is None:
                for key in held:
                    extra[key] = extra.get(key, 0) | level.bit
                continue
            with self._lock:
                for key in held:
                    if self.placement.holds(level, key):
                        continue
                    if not self._make_room(level, new_bytes=False):  # the file is there already
                        break
                    self.placement.add(level, key)
        return extra

    def _read(self, plan: list[tuple[Key, CacheLevel]], out: BlockOut) -> dict[Key, tuple[CacheLevel, str]]:
        """Copy planned blocks into the caller's memory, one batch per source level; failures by key."""
        failures: dict[Key, tuple[CacheLevel, str]] = {}
        for level in self.levels:
            batch = [(i, key) for i, (key, source) in enumerate(plan) if source is level]
            if not batch:
                continue
            start = time.perf_counter()
            reasons = level.tier.read_into([key for _, key in batch], [out(i) for i, _ in batch])
            ok = sum(reason is None for reason in reasons)
            level.metrics.observe_load(time.perf_counter() - start, ok * self.layout.block_nbytes)
            failures.update({key: (level, r) for (_, key), r in zip(batch, reasons) if r is not None})
        return failures

    def _finish_load(self, plan: list[tuple[Key, CacheLevel]], failures: dict[Key, tuple[CacheLevel, str]],
                     ended_on_miss: bool) -> list[tuple[Key, CacheLevel]]:
        """Refuse failed blocks, unpin, refresh recency and count; the blocks before the first failure."""
        good = next((i for i, (key, _) in enumerate(plan) if key in failures), len(plan))
        with self._lock:
            for key, (level, reason) in failures.items():
                self._refuse(level, key, reason)
            for key, level in plan[:good]:
                self.placement.touch(level, key)
            self.placement.unpin([key for key, _ in plan])
            self._count_lookup(plan[:good], ended_on_miss)
        return plan[:good]

    def _refuse(self, level: CacheLevel, key: Key, reason: str) -> None:
        """A stored block could not be read or failed verification: remove it from that level and count it."""
        if reason == integrity.IO_ERROR:
            level.metrics.add("read_errors")
        else:
            level.metrics.corrupt(reason)
        self._drop(level, key)

    def _count_lookup(self, kept: list[tuple[Key, CacheLevel]], ended_on_miss: bool) -> None:
        for _, source in kept:
            for level in self.levels[: source.rank]:
                level.metrics.add("misses")
            source.metrics.add("hits")
        if ended_on_miss:
            for level in self.levels:
                level.metrics.add("misses")

    # -- store and promote -----------------------------------------------------

    def store(self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[torch.Tensor], first_block: int = 0) -> int:
        """Cache the KV of full blocks of `tokens`: `blocks[j]` is block `first_block + j`.

        Blocks already cached are only touched. Returns how many blocks were newly stored.
        Extra blocks beyond the prompt's full blocks are ignored.
        """
        return self.store_keys(self.keys_for(tokens)[first_block:], blocks)

    def store_keys(self, keys: Sequence[Key], blocks: Sequence[torch.Tensor]) -> int:
        """`store` by block keys (see `load_keys_into`): `blocks[j]` is the block of `keys[j]`."""
        self._wait_for_write_room()
        stored = 0
        for key, block in zip(keys, blocks):
            with self._lock:
                stored += self._store_one(key, block)
        return stored

    def _store_one(self, key: Key, block: torch.Tensor) -> int:
        if self.placement.known(key):
            self.placement.touch_everywhere(key)
            return 0
        top, lower = self.levels[0], self.levels[1:]
        stored = self._put(top, key, block)
        fallback = not stored  # a block the device cannot take goes below at once, whatever the policy
        for level in lower:
            if level.on_store or (fallback and level.lru is not None):
                stored |= self._put(level, key, block)
        return int(stored)

    def promote(self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[torch.Tensor], first_block: int = 0) -> int:
        """Keep a copy of just-loaded blocks (`blocks[j]` is block `first_block + j`) on every
        accounted level the write policy stores to that lacks it (the device, at least).

        Call it once the request no longer waits (e.g. after its first token). Returns how many
        copies were placed. The shared pool is never written: the blocks came from the cache.
        """
        keys = self.keys_for(tokens)[first_block:]
        placed = 0
        for key, block in zip(keys, blocks):
            with self._lock:
                for level in self.levels:
                    if level.on_store and level.lru is not None and not self.placement.holds(level, key):
                        placed += self._put(level, key, block)
                self.placement.touch_everywhere(key)
        return placed

    def _put(self, level: CacheLevel, key: Key, block: torch.Tensor) -> bool:
        """Place a block on one level (making room first); False, counted, when it cannot fit now."""
        if level.lru is not None and not self._make_room(level):
            level.metrics.add("stores_refused")
            return False
        if level.writer is not None:
            if level.lru is not None:
                self.placement.reserve(level, key)  # a queued write holds its place; it is protected
            level.writer.submit(key, block)
            return True
        write_block(level.tier, key, block)
        self.placement.add(level, key)
        self._count_written(level)
        return True

    def _count_written(self, level: CacheLevel) -> None:
        level.metrics.add("bytes_written", self.layout.block_nbytes)
        level.metrics.add("blocks_written")

    def _on_written(self, level: CacheLevel) -> Callable[[Key, Optional[BaseException]], None]:
        def done(key: Key, error: Optional[BaseException]) -> None:  # called by the writer, lock held
            lru = level.lru  # None: not accounted
            if error is None and (lru is None or key in lru):
                if lru is not None:
                    self.placement.publish(level, key)
                self._count_written(level)
                return
            if error is None:
                level.tier.delete(key)  # forgotten while queued: its bytes must not linger unindexed
            elif lru is not None:
                self.placement.remove(level, key)
            level.metrics.add("write_errors")
        return done

    def _wait_for_write_room(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._pending_bytes() <= self.config.max_pending_write_bytes)

    def _pending_bytes(self) -> int:
        return sum(level.writer.pending_bytes for level in self.levels if level.writer is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is published (or failed); False on timeout."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not any(level.writer for level in self.levels if level.writer is not None), timeout)

    # -- room, eviction and demotion -----------------------------------------------

    def _make_room(self, level: CacheLevel, new_bytes: bool = True) -> bool:
        """Evict until one more block fits the level (and, when its bytes are still to be written,
        the medium beneath); False when it cannot."""
        shortfall = self._medium_shortfall(level) if new_bytes else 0
        return self._evict_for(level, level.tier.stored_nbytes, shortfall) is not None

    def _evict_for(self, level: CacheLevel, nbytes: int, shortfall: int) -> Optional[list[Key]]:
        """Evict the victims placement picks for `nbytes` and `shortfall` (see `Placement.victims`)."""
        victims = self.placement.victims(level, nbytes, shortfall)
        for key in victims or ():
            self._evict(level, key)
        return victims

    def _medium_shortfall(self, level: CacheLevel, at_least: int = 0) -> int:
        """Bytes to free on the medium beneath the level so that one more block, the writes
        queued and the configured reserve fit in what the filesystem really has."""
        free = level.tier.free_bytes()
        if free is None:
            return 0
        queued = level.writer.pending_bytes if level.writer is not None else 0
        return max(at_least, level.min_free_bytes + level.tier.stored_nbytes + queued - free)

    def _room_when_full(self, level: CacheLevel) -> Callable[[Key], bool]:
        def make_room(key: Key) -> bool:  # called by the writer after ENOSPC, lock not held
            with self._lock:
                if level.lru is None:
                    return False
                victims = self._evict_for(level, 0, self._medium_shortfall(level, level.tier.stored_nbytes))
                if not victims:
                    return False
                level.metrics.add("evictions_for_space", len(victims))
                return True
        return make_room

    def evict(self, tier: str) -> int:
        """Evict every unprotected block of one tier, demoting it as usual; returns how many left.

        Useful to start a measurement from a known placement (e.g. a cold disk read).
        """
        level = self._by_name[tier]
        with self._lock:
            victims = self.placement.unprotected(level)
            for key in victims:
                self._evict(level, key)
        return len(victims)

    def _evict(self, level: CacheLevel, key: Key) -> None:
        """Remove a block from a level, first demoting it to the nearest lower level that has or takes it."""
        level.metrics.add("evictions")
        source = level.tier.view(key)
        for lower in self.placement.lower(level):
            if source is None or self.placement.holds(lower, key):
                break
            if self._put(lower, key, source):
                level.metrics.add("demotions")
                break
        self._drop(level, key)

    def _drop(self, level: CacheLevel, key: Key) -> None:
        level.tier.delete(key)
        self.placement.remove(level, key)

    def drop_page_cache(self) -> None:
        """Make the next reads of every tier cold (writes still queued are not waited for: `flush` first)."""
        for level in self.levels:
            level.tier.drop_page_cache()

    # -- metrics, start-up, shutdown -----------------------------------------

    def disk_room(self) -> Optional[DiskRoom]:
        """The disk tier's room now (what its filesystem leaves it); None without a disk tier."""
        with self._lock:
            return self._room(self._by_name.get("disk"))

    def _room(self, level: Optional[CacheLevel]) -> Optional[DiskRoom]:
        """The room on the filesystem beneath the disk level; None for any other level."""
        if level is None or level.name != "disk" or self.config.disk is None:
            return None
        queued = level.writer.pending_bytes if level.writer is not None else 0
        lru, free = level.account, level.tier.free_bytes()
        if free is None:
            raise ValueError("disk tier: the free room of its filesystem is unknown (a disk tier always knows it)")
        return DiskRoom(str(self.config.disk.path), lru.capacity_bytes, lru.used_bytes - queued, free,
                        level.min_free_bytes, level.tier.stored_nbytes)

    def snapshot(self) -> dict:
        """Per-tier counters, occupancy and state, plus index size and queued writes. A tier's capacity is
        what it can really fill: the disk tier's, what its filesystem leaves it (`disk_room`). Each tier's own
        state is read before the lock is taken (the disk tier's counts its temp files on the filesystem: a
        scrape must not hold up loads and stores meanwhile)."""
        states = {level.name: level.tier.snapshot() for level in self.levels}
        with self._lock:
            tiers = {}
            for level in self.levels:
                lru = level.lru  # the shared pool's occupancy is the store's to report
                room = self._room(level)
                capacity = lru.capacity_bytes if lru is not None else 0
                tiers[level.name] = {
                    **level.metrics.snapshot(),
                    "blocks": len(lru) if lru is not None else 0,
                    "used_bytes": lru.used_bytes if lru is not None else 0,
                    "capacity_bytes": room.usable_bytes if room is not None else capacity,
                    "pending_writes": len(level.writer) if level.writer is not None else 0,
                    "state": states[level.name],
                }
            return {
                "tiers": tiers,
                "indexed_blocks": len(self.placement.index),
                "pinned_blocks": len(self.placement.pins),
                "reindex_removed": self.reindex_removed,
                "faults": self.faults.snapshot(),
            }

    def _reindex(self, level: CacheLevel) -> None:
        """Index what a tier already holds (blocks a previous run left), oldest first so recency survives."""
        found = []
        for key, reason, mtime in level.tier.discover():
            if reason:
                level.metrics.corrupt(reason)
                self.reindex_removed += 1
            elif key is None:
                raise ValueError(f"{level.name} tier: found a block with neither a key nor a reason it was removed")
            else:
                found.append((mtime, key))
        with self._lock:
            for _, key in sorted(found):
                if not self._make_room(level, new_bytes=False):
                    level.tier.delete(key)
                    continue
                self.placement.add(level, key)

    def persist(self) -> int:
        """Queue a write to every write-behind level for each block only the levels above it hold
        (write-back keeps some only above). Returns how many writes were queued; `flush()` waits."""
        queued = 0
        with self._lock:
            for lower in self.levels:
                if lower.writer is None or lower.lru is None:
                    continue
                for upper in self.levels[: lower.rank]:
                    for key in upper.account:  # accounted: only the shared pool, the lowest level, is not
                        source = upper.tier.view(key)
                        if source is not None and self.placement.index.has(key, upper.rank) \
                                and not self.placement.holds(lower, key):
                            queued += self._put(lower, key, source)
        return queued

    def close(self) -> None:
        """Persist what only the upper tiers hold, publish queued writes and stop background threads."""
        self.persist()
        self.flush()
        for level in self.levels:
            if level.writer is not None:
                level.writer.close()
            level.tier.close()

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _leading_true(flags: Sequence[bool]) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))
