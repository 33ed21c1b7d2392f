"""TieredKVCache: lookup, load (promote), store, evict (demote), pins.

Tiers are numbered top-down: device (0), host (1), disk (2), remote (3).
The local tiers keep an LRU account each, and the `BlockIndex` says where
their blocks live. The remote tier is a pool shared with other nodes: the
index cannot know what they put, so a load asks the pool about the blocks
after the local prefix, and the store's own eviction manages its capacity. One lock guards
the metadata; bytes move outside it, protected by pins:

- a pinned block is never chosen for eviction, so its bytes stay put;
- blocks are immutable and content-addressed: storing a key that is already
  cached only refreshes its recency, it never overwrites;
- a block being copied into a tier is visible only once the copy completed
  and (for disk) the file was published whole.

Eviction demotes: a block leaving a tier goes to the next tier down unless it
is already there. Disk writes run on background threads; until a file is
published the block is not visible on disk, and its capacity is reserved.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from . import integrity
from .config import CacheConfig, ConfigError
from .index import BlockIndex
from .keys import Fingerprint, Key, block_keys
from .lru import LRUAccount
from .metrics import TierMetrics
from .tiers.device import DeviceTier
from .tiers.disk import DiskTier
from .tiers.host import HostTier
from .tiers.remote import RemoteTier

DEVICE, HOST, DISK, REMOTE = 0, 1, 2, 3
TIER_NAMES = ("device", "host", "disk", "remote")


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


@dataclass
class LoadedPrefix:
    """Device-resident blocks of a prompt's cached prefix, pinned until `release()`.

    `blocks[i]` is the KV of block i, shape [layers, 2, kv_heads, block_size, head_dim];
    copy out what you need before releasing (the slot may be reused afterwards).
    """

    cache: "TieredKVCache"
    keys: list[Key]
    blocks: list[torch.Tensor]
    sources: list[str]
    block_size: int
    _released: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_size

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.cache._unpin(self.keys)

    def __enter__(self) -> "LoadedPrefix":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class _PlannedLoad:
    key: Key
    source: int
    slot: Optional[torch.Tensor]  # None when the block is already on the device


class TieredKVCache:
    """A tiered, verified, content-addressed KV block cache (device -> host -> disk)."""

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
        self._lock = threading.RLock()
        self._drained = threading.Condition(self._lock)
        self._index = BlockIndex()
        self._pins: dict[Key, int] = {}
        self._inflight: dict[Key, threading.Event] = {}
        self._pending_disk: dict[Key, torch.Tensor] = {}
        self._pending_bytes = 0
        self._tiers: list = [DeviceTier(self.layout, config.device_capacity_blocks, self.device), None, None, None]
        self._lru = [LRUAccount(config.device_capacity_blocks * self.layout.block_nbytes), None, None, None]
        if config.host_capacity_bytes >= self.layout.block_nbytes:
            host = HostTier(self.layout, config.host_capacity_bytes, pin_memory=self.device.type == "cuda")
            self._tiers[HOST] = host
            self._lru[HOST] = LRUAccount(host.pool.shape[0] * self.layout.block_nbytes)
        self._writer: ThreadPoolExecutor | None = None
        if config.disk is not None:
            self._tiers[DISK] = DiskTier(config.disk, fingerprint)
            self._lru[DISK] = LRUAccount(config.disk.capacity_bytes)
            self._writer = ThreadPoolExecutor(2, thread_name_prefix="kv-disk-write")
        self._remote_writer: ThreadPoolExecutor | None = None
        self._pending_remote = 0
        if config.remote is not None:
            self._tiers[REMOTE] = RemoteTier(config.remote, fingerprint)
            self._tiers[REMOTE].wait_connected(config.remote.timeout_s)  # a pool that is up serves at once
            self._remote_writer = ThreadPoolExecutor(2, thread_name_prefix="kv-remote-write")
        self.metrics = {name: TierMetrics() for name, tier in zip(TIER_NAMES, self._tiers) if tier is not None}
        self.reindex_removed = 0
        if self._tiers[DISK] is not None:
            self._reindex_disk()

    # -- queries -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def tiers(self) -> list[str]:
        """Names of the enabled tiers, top-down."""
        return [TIER_NAMES[t] for t, tier in enumerate(self._tiers) if tier is not None]

    def keys_for(self, tokens: Sequence[int] | np.ndarray) -> list[Key]:
        return block_keys(tokens, self.fingerprint.digest, self.block_size)

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> PrefixMatch:
        """Longest cached prefix of `tokens` and the best tier of each of its blocks (no side effects)."""
        keys = self.keys_for(tokens)
        with self._lock:
            masks = self._index.longest_prefix(keys)
        return PrefixMatch(keys, [TIER_NAMES[_lowest_bit(m)] for m in masks], self.block_size)

    def tier(self, name: str):
        """The tier object by name ("device", "host", "disk"); KeyError when it is not enabled."""
        tier = self._tiers[TIER_NAMES.index(name)] if name in TIER_NAMES else None
        if tier is None:
            raise KeyError(f"tier {name!r} is not enabled (enabled: {self.tiers})")
        return tier

    def evict(self, tier: str) -> int:
        """Evict every unpinned block of one tier, demoting it as usual; returns how many left.

        Useful to start a measurement from a known placement (e.g. a cold disk read).
        """
        t = TIER_NAMES.index(tier)
        with self._lock:
            protected = self._protected(t)
            victims = [key for key in self._lru[t] if not protected(key)]
            for key in victims:
                self._evict(t, key)
        return len(victims)

    def where(self, key: Key) -> list[str]:
        """Every tier that holds a readable copy of the block."""
        with self._lock:
            mask = self._index.tiers_of(key)
        return [name for t, name in enumerate(TIER_NAMES) if mask & (1 << t)]

    # -- load ----------------------------------------------------------------

    def load(self, tokens: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> LoadedPrefix:
        """Bring the longest cached prefix onto the device and pin it.

        Blocks come from the highest tier that holds them. A block that fails
        verification is removed and counted, and the prefix ends before it.
        """
        keys = self.keys_for(tokens)
        if max_blocks is not None:
            keys = keys[:max_blocks]
        plan, cached = self._plan_load(keys)
        failures = self._copy_in(plan)
        # The prefix ends on a miss when a block was not cached anywhere or failed verification
        # (not when the device pool had no unpinned slot left).
        ended_on_miss = bool(failures) or (len(plan) == cached < len(keys))
        return self._finish_load(plan, failures, ended_on_miss)

    def _plan_load(self, keys: list[Key]) -> tuple[list[_PlannedLoad], int]:
        """Pin the cached prefix and reserve device slots for blocks not yet there; also the cached length."""
        while True:
            self._discover_shared_disk(keys)
            in_pool = self._remote_extension(keys)
            with self._lock:
                masks = self._index.longest_prefix(keys)
                for key in keys[len(masks):]:  # the pool continues the local prefix
                    if key not in in_pool:
                        break
                    masks.append(1 << REMOTE)
                busy = next((self._inflight[k] for k in keys[: len(masks)] if k in self._inflight), None)
                if busy is None:
                    return self._reserve_plan(keys, masks), len(masks)
            busy.wait()  # another thread is loading one of our blocks; plan again once it is there

    def _discover_shared_disk(self, keys: list[Key]) -> None:
        """On a shared disk directory, index the block files other nodes wrote after the local prefix.

        Only their existence is checked here; the read verifies them like any other block.
        """
        disk: DiskTier | None = self._tiers[DISK]
        if disk is None or not disk.config.shared:
            return
        with self._lock:
            local = len(self._index.longest_prefix(keys))
        found = []
        for key in keys[local:]:
            if not disk.contains(key):
                break
            found.append(key)
        with self._lock:
            for key in found:
                if self._index.has(key, DISK) or key in self._pending_disk:
                    continue
                if not self._make_room(DISK, disk.stored_nbytes):
                    break
                self._lru[DISK].add(key, disk.stored_nbytes)
                self._index.add(key, DISK)

    def _remote_extension(self, keys: list[Key]) -> set[Key]:
        """The leading keys after the local prefix that the shared pool holds (asked outside the lock)."""
        remote: RemoteTier | None = self._tiers[REMOTE]
        if remote is None:
            return set()
        with self._lock:
            local = len(self._index.longest_prefix(keys))
        rest = keys[local:]
        found = remote.contains(rest)
        held = next((i for i, there in enumerate(found) if not there), len(found))
        return set(rest[:held])

    def _reserve_plan(self, keys: list[Key], masks: list[int]) -> list[_PlannedLoad]:
        plan = []
        device: DeviceTier = self._tiers[DEVICE]
        matched = keys[: self._loadable_blocks(keys, masks)]
        for key in matched:  # pin all first, so making room never evicts a block of this prefix
            self._pin(key)
        for i, (key, mask) in enumerate(zip(matched, masks)):
            source = _lowest_bit(mask)
            if source == DEVICE:
                plan.append(_PlannedLoad(key, DEVICE, None))
                continue
            if not self._make_room(DEVICE, device.stored_nbytes):
                self._unpin(matched[i:])
                break
            slot = device.reserve(key)
            self._lru[DEVICE].add(key, device.stored_nbytes)
            self._inflight[key] = threading.Event()
            plan.append(_PlannedLoad(key, source, slot))
        return plan

    def _loadable_blocks(self, keys: list[Key], masks: list[int]) -> int:
        """How many leading cached blocks fit on the device at once, given the slots others have pinned."""
        device: DeviceTier = self._tiers[DEVICE]
        spare = device.free_slots + sum(1 for key in self._lru[DEVICE] if not self._is_pinned(key))
        needed = 0
        for i, (key, mask) in enumerate(zip(keys, masks)):
            if not mask & (1 << DEVICE):
                needed += 1
            elif not self._is_pinned(key):
                spare -= 1  # already there and about to be pinned: not a slot to evict any more
            if needed > spare:
                return i
        return len(masks)

    def _copy_in(self, plan: list[_PlannedLoad]) -> dict[Key, tuple[int, str]]:
        """Copy planned blocks into their device slots, one batch per source tier; failures by key."""
        failures: dict[Key, tuple[int, str]] = {}
        for source in (HOST, DISK, REMOTE):
            batch = [p for p in plan if p.source == source]
            if not batch:
                continue
            start = time.perf_counter()
            reasons = self._tiers[source].read_into([p.key for p in batch], [p.slot for p in batch])
            ok = sum(r is None for r in reasons)
            self.metrics[TIER_NAMES[source]].observe_load(time.perf_counter() - start, ok * self.layout.block_nbytes)
            failures.update({p.key: (source, r) for p, r in zip(batch, reasons) if r is not None})
        return failures

    def _finish_load(self, plan: list[_PlannedLoad], failures: dict[Key, tuple[int, str]], ended_on_miss: bool) -> LoadedPrefix:
        """Commit the blocks before the first failure; release the rest and refuse the failed ones."""
        device: DeviceTier = self._tiers[DEVICE]
        good = next((i for i, p in enumerate(plan) if p.key in failures), len(plan))
        with self._lock:
            for i, p in enumerate(plan):
                if p.key in failures:
                    self._refuse(p.key, *failures[p.key])
                if p.slot is not None:
                    if i < good:
                        self._index.add(p.key, DEVICE)
                        if self._lru[p.source] is not None:
                            self._lru[p.source].touch(p.key)
                    else:
                        device.delete(p.key)
                        self._lru[DEVICE].remove(p.key)
                    self._inflight.pop(p.key).set()
                if i < good:
                    self._lru[DEVICE].touch(p.key)
                else:
                    self._unpin([p.key])
            kept = plan[:good]
            self._count_lookup(kept, ended_on_miss)
            return LoadedPrefix(
                self, [p.key for p in kept], [device.view(p.key) for p in kept],
                [TIER_NAMES[p.source] for p in kept], self.block_size,
            )

    def _refuse(self, key: Key, tier: int, reason: str) -> None:
        """A stored block could not be read or failed verification: remove it from that tier and count it."""
        if reason == integrity.IO_ERROR:
            self.metrics[TIER_NAMES[tier]].add("read_errors")
        else:
            self.metrics[TIER_NAMES[tier]].corrupt(reason)
        self._drop(tier, key)

    # -- store ---------------------------------------------------------------

    def store(
        self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[torch.Tensor], first_block: int = 0
    ) -> int:
        """Cache the KV of full blocks of `tokens`: `blocks[j]` is block `first_block + j`.

        Blocks already cached are only touched. Returns how many blocks were newly stored.
        Extra blocks beyond the prompt's full blocks are ignored.
        """
        keys = self.keys_for(tokens)[first_block:]
        self._wait_for_write_room()
        stored = 0
        for key, block in zip(keys, blocks):
            with self._lock:
                stored += self._store_one(key, block)
        return stored

    def _store_one(self, key: Key, block: torch.Tensor) -> int:
        if self._index.tiers_of(key) or key in self._pending_disk or key in self._inflight:
            for t in range(3):
                if self._lru[t] is not None:
                    self._lru[t].touch(key)
            return 0
        stored = self._put(DEVICE, key, block)
        if self.config.write_policy == "write-through" or not stored:
            if self._tiers[HOST] is not None:
                stored |= self._put(HOST, key, block)
            if self._tiers[DISK] is not None:
                stored |= self._put(DISK, key, block)
        if self._tiers[REMOTE] is not None:  # published at once, whatever the policy: other nodes may need it
            stored |= self._put(REMOTE, key, block)
        return int(stored)

    def _put(self, tier: int, key: Key, block: torch.Tensor) -> bool:
        """Place a block on one tier (making room first); False when it cannot fit now."""
        if tier == DISK:
            return self._enqueue_disk_write(key, block)
        if tier == REMOTE:
            return self._enqueue_remote_write(key, block)
        nbytes = self._tiers[tier].stored_nbytes
        if not self._make_room(tier, nbytes):
            return False
        self._tiers[tier].write(key, block)
        self._lru[tier].add(key, nbytes)
        self._index.add(key, tier)
        self.metrics[TIER_NAMES[tier]].add("bytes_written", self.layout.block_nbytes)
        self.metrics[TIER_NAMES[tier]].add("blocks_written")
        return True

    def _enqueue_disk_write(self, key: Key, block: torch.Tensor) -> bool:
        """Queue a disk write of a private CPU copy (the source slot may be reused before it runs)."""
        disk: DiskTier = self._tiers[DISK]
        if key in self._pending_disk or self._index.has(key, DISK):
            return True
        if not self._make_room(DISK, disk.stored_nbytes):
            return False
        cpu_block = block.detach().to("cpu", copy=True)
        self._lru[DISK].add(key, disk.stored_nbytes)  # reserves capacity; pending keys are protected
        self._pending_disk[key] = cpu_block
        self._pending_bytes += self.layout.block_nbytes
        self._writer.submit(self._write_to_disk, key, cpu_block)
        return True

    def _write_to_disk(self, key: Key, cpu_block: torch.Tensor) -> None:
        error = None
        try:
            self._tiers[DISK].write(key, cpu_block)
        except Exception as exc:  # ENOSPC, EIO, ...: the block is simply not on disk
            error = exc
        with self._lock:
            self._pending_disk.pop(key, None)
            self._pending_bytes -= self.layout.block_nbytes
            metrics = self.metrics["disk"]
            if error is None and key in self._lru[DISK]:
                self._index.add(key, DISK)
                metrics.add("bytes_written", self.layout.block_nbytes)
                metrics.add("blocks_written")
            else:
                self._lru[DISK].remove(key)
                metrics.add("write_errors")
            self._drained.notify_all()

    def _enqueue_remote_write(self, key: Key, block: torch.Tensor) -> bool:
        """Queue a put of a private CPU copy into the shared pool (skipped while the pool is unavailable)."""
        remote: RemoteTier = self._tiers[REMOTE]
        if not remote.available:
            self.metrics["remote"].add("write_errors")
            return False
        cpu_block = block.detach().to("cpu", copy=True)
        self._pending_remote += 1
        self._remote_writer.submit(self._write_to_remote, key, cpu_block)
        return True

    def _write_to_remote(self, key: Key, cpu_block: torch.Tensor) -> None:
        metrics = self.metrics["remote"]
        try:
            self._tiers[REMOTE].write(key, cpu_block)
            metrics.add("bytes_written", self.layout.block_nbytes)
            metrics.add("blocks_written")
        except Exception:  # unavailable, timed out, full: the block is simply not in the pool
            metrics.add("write_errors")
        finally:
            with self._lock:
                self._pending_remote -= 1
                self._drained.notify_all()

    def _wait_for_write_room(self) -> None:
        with self._drained:
            self._drained.wait_for(lambda: self._pending_bytes <= self.config.max_pending_write_bytes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued disk write and pool put is published (or failed); False on timeout."""
        with self._drained:
            return self._drained.wait_for(lambda: not self._pending_disk and not self._pending_remote, timeout)

    # -- eviction and demotion -----------------------------------------------

    def _is_pinned(self, key: Key) -> bool:
        return key in self._pins

    def _is_pinned_or_pending(self, key: Key) -> bool:
        """On disk a queued write also reserves its place until it is published or fails."""
        return key in self._pins or key in self._pending_disk

    def _protected(self, tier: int):
        return self._is_pinned_or_pending if tier == DISK else self._is_pinned

    def _make_room(self, tier: int, nbytes: int) -> bool:
        victims = self._lru[tier].victims(nbytes, self._protected(tier))
        if victims is None:
            return False
        for key in victims:
            self._evict(tier, key)
        return True

    def _evict(self, tier: int, key: Key) -> None:
        """Remove a block from a tier, first demoting it to the nearest lower tier that has or takes it."""
        self.metrics[TIER_NAMES[tier]].add("evictions")
        for lower in range(tier + 1, REMOTE):  # the pool already got the block when it was stored
            if self._tiers[lower] is None:
                continue
            if self._index.has(key, lower) or key in self._pending_disk:
                break
            if self._put(lower, key, self._demotion_source(tier, key)):
                self.metrics[TIER_NAMES[tier]].add("demotions")
                break
        self._drop(tier, key)

    def _demotion_source(self, tier: int, key: Key) -> torch.Tensor:
        """The block's bytes in its slot; `_put` copies them before the slot can be reused."""
        return self._tiers[tier].view(key)

    def _drop(self, tier: int, key: Key) -> None:
        self._tiers[tier].delete(key)
        if self._lru[tier] is not None:
            self._lru[tier].remove(key)
        self._index.discard(key, tier)

    # -- pins ----------------------------------------------------------------

    def _pin(self, key: Key) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, keys: Sequence[Key]) -> None:
        with self._lock:
            for key in keys:
                left = self._pins.get(key, 0) - 1
                if left > 0:
                    self._pins[key] = left
                else:
                    self._pins.pop(key, None)

    # -- metrics, start-up, shutdown -----------------------------------------

    def _count_lookup(self, plan: list[_PlannedLoad], ended_on_miss: bool) -> None:
        enabled = [t for t, tier in enumerate(self._tiers) if tier is not None]
        for p in plan:
            for t in enabled:
                if t < p.source:
                    self.metrics[TIER_NAMES[t]].add("misses")
                elif t == p.source:
                    self.metrics[TIER_NAMES[t]].add("hits")
        if ended_on_miss:
            for t in enabled:
                self.metrics[TIER_NAMES[t]].add("misses")

    def snapshot(self) -> dict:
        """Per-tier counters and occupancy, plus index size and queued writes."""
        with self._lock:
            tiers = {}
            for t, name in enumerate(TIER_NAMES):
                if self._tiers[t] is None:
                    continue
                lru = self._lru[t]  # the shared pool's occupancy is the store's to report
                tiers[name] = {
                    **self.metrics[name].snapshot(),
                    "blocks": len(lru) if lru is not None else 0,
                    "used_bytes": lru.used_bytes if lru is not None else 0,
                    "capacity_bytes": lru.capacity_bytes if lru is not None else 0,
                }
            return {
                "tiers": tiers,
                "indexed_blocks": len(self._index),
                "pinned_blocks": len(self._pins),
                "pending_disk_writes": len(self._pending_disk),
                "reindex_removed": self.reindex_removed,
                "faults": self._tiers[DISK].faults.snapshot() if self._tiers[DISK] is not None else None,
                "remote": self._tiers[REMOTE].snapshot() if self._tiers[REMOTE] is not None else None,
            }

    def _reindex_disk(self) -> None:
        disk: DiskTier = self._tiers[DISK]
        found = []
        for key, reason, mtime in disk.scan():
            if reason:
                self.metrics["disk"].corrupt(reason)
                self.reindex_removed += 1
            else:
                found.append((mtime, key))
        for _, key in sorted(found):  # oldest first, so recency survives a restart
            if not self._make_room(DISK, disk.stored_nbytes):
                disk.delete(key)
                continue
            self._lru[DISK].add(key, disk.stored_nbytes)
            self._index.add(key, DISK)

    def persist(self) -> int:
        """Queue a disk write for every cached block not on disk yet (write-back keeps some only above).

        Returns how many writes were queued; `flush()` waits for them.
        """
        if self._tiers[DISK] is None:
            return 0
        queued = 0
        with self._lock:
            for tier in (HOST, DEVICE):
                if self._tiers[tier] is None:
                    continue
                for key in self._lru[tier]:
                    if self._index.has(key, tier) and not self._index.has(key, DISK) and key not in self._pending_disk:
                        queued += self._put(DISK, key, self._demotion_source(tier, key))
        return queued

    def close(self) -> None:
        """Persist what only the upper tiers hold, publish queued writes and stop background threads."""
        self.persist()
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._remote_writer is not None:
            self._remote_writer.shutdown(wait=True)
        for tier in (DISK, REMOTE):
            if self._tiers[tier] is not None:
                self._tiers[tier].close()

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1
