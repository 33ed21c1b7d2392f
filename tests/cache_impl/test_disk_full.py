"""A full filesystem is room to make, not a dead tier: on a real 48 MiB tmpfs, far smaller than the
tier's configured capacity, the disk tier evicts its oldest blocks and goes on storing.

Needs the right to mount a tmpfs (root); skipped, saying so, where that is refused.
"""

from __future__ import annotations

import os

import pytest
import torch

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache

# 1 MiB blocks (the small preset's size): 48 of them would fill the filesystem.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", block_size=256)
FS_MIB = 48


@pytest.fixture
def small_fs(small_tmpfs):
    return small_tmpfs(FS_MIB)


def _cache(path, **disk) -> TieredKVCache:
    config = CacheConfig.from_dict({
        "block_size": LAYOUT.block_size, "device": "cpu", "device_capacity_blocks": 2, "host_capacity_bytes": 0,
        "disk": {"path": str(path), "capacity_bytes": "1GiB", **disk},   # the filesystem is far smaller
    })
    return TieredKVCache(config, Fingerprint("disk-full", "t", LAYOUT))


def _store_prompts(cache: TieredKVCache, count: int) -> list[tuple[list[int], torch.Tensor]]:
    stored = []
    for n in range(count):
        tokens = [n] * LAYOUT.block_size
        block = torch.full(LAYOUT.block_shape, float(n))
        cache.store(tokens, [block])
        cache.flush()
        stored.append((tokens, block))
    return stored


def _free(path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def _fill(path, name: str = "foreign.bin") -> None:
    """Another writer takes every byte the filesystem has left."""
    with open(path / name, "wb") as f:
        try:
            while True:
                f.write(bytes(2**20))
                f.flush()
        except OSError:
            pass


def test_enospc_evicts_the_oldest_blocks_and_the_write_is_retried(small_fs):
    cache = _cache(small_fs, min_free_bytes=0)       # no reserve: the tier may fill the filesystem
    old = _store_prompts(cache, FS_MIB // 2)         # published, evictable
    cache.faults.arm("slow_disk", delay_s=0.3)       # each write waits 0.3 s between its data and its publish
    new = [([1000 + n] * LAYOUT.block_size, torch.full(LAYOUT.block_shape, 1000.0 + n)) for n in range(8)]
    for tokens, block in new:                        # queued while there is room...
        cache.store(tokens, [block])
    _fill(small_fs)                                  # ...then someone else fills the disk before they are written
    cache.flush()
    cache.faults.clear()
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["evictions_for_space"] > 0          # ENOSPC made room: the oldest blocks went
    assert disk["write_errors"] == 0                # and every write got in on its retry
    assert cache.load(old[0][0]).num_blocks == 0
    cache.evict("device")
    for tokens, block in new:                        # the new blocks are on disk, whole
        prefix = cache.load(tokens)
        assert prefix.sources == ["disk"] and torch.equal(prefix.blocks[0], block)
    cache.close()


def test_capacity_is_what_the_filesystem_has_not_the_configured_gigabyte(small_fs):
    cache = _cache(small_fs, min_free_bytes=0)
    stored = _store_prompts(cache, 3 * FS_MIB)       # three times what fits
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["write_errors"] == 0 and disk["evictions"] > 0
    assert disk["used_bytes"] <= FS_MIB * 2**20
    cache.evict("device")
    tokens, block = stored[-1]
    prefix = cache.load(tokens)                      # the newest is on disk; the oldest made the room
    assert prefix.sources == ["disk"] and torch.equal(prefix.blocks[0], block)
    assert cache.load(stored[0][0]).num_blocks == 0
    cache.close()


def test_the_tier_keeps_its_reserve_free_by_evicting_before_it_writes(small_fs):
    reserve = 16 * 2**20
    cache = _cache(small_fs, min_free_bytes=reserve)
    _store_prompts(cache, 2 * FS_MIB)
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["evictions"] > 0 and disk["write_errors"] == 0
    assert disk["evictions_for_space"] == 0          # no write ever hit ENOSPC
    assert _free(small_fs) >= reserve - cache.tier("disk").stored_nbytes
    assert disk["blocks"] < (FS_MIB * 2**20 - reserve) // cache.tier("disk").stored_nbytes + 1
    cache.close()


def test_a_block_the_tier_has_no_room_for_is_counted_as_refused_and_capacity_is_what_is_usable(small_fs):
    """Before: such a block was dropped without a count, and capacity_bytes said the configured gigabyte."""
    reserve = 16 * 2**20
    cache = _cache(small_fs, min_free_bytes=reserve)
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["capacity_bytes"] == _free(small_fs) - reserve         # what the filesystem leaves, not 1 GiB
    _fill(small_fs)                                                      # another writer takes every byte
    _store_prompts(cache, 5)                                             # the device tier holds 2 of them
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["blocks"] == 0 and disk["write_errors"] == 0 and disk["capacity_bytes"] == 0
    assert disk["stores_refused"] == 5 + 3             # each store, and the 3 blocks the device demoted on eviction
    assert cache.disk_room().warning() is not None
    cache.close()
