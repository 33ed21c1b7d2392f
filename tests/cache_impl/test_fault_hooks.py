"""I/O faults are a capability of the disk tier, not a proxy around it: unarmed, the cache's disk tier is the
plain `DiskTier` and calls no hook; arming hooks `cache.faults` into it, and clearing (or the fault running
out) takes the hooks away again, leaving the tier as it was."""

from __future__ import annotations

import time

import pytest
import torch

from cache_impl.cache.faults import IO_FAULTS
from cache_impl.cache.tiers.disk import DiskTier


def _disk_only(make_cache):
    """A cache whose blocks, once flushed and evicted from the device, are on disk alone."""
    return make_cache(host_capacity_bytes=0)


def _store_on_disk(cache, layout, first_token: int, n_blocks: int = 3) -> tuple[list[int], list[torch.Tensor]]:
    tokens = list(range(first_token, first_token + n_blocks * layout.block_size))
    blocks = [torch.randn(layout.block_shape) for _ in range(n_blocks)]
    cache.store(tokens, blocks)
    cache.flush()
    cache.evict("device")
    return tokens, blocks


def _written_by(cache):
    """The tier the disk level's write-behind mover writes into."""
    return next(level.writer for level in cache.levels if level.name == "disk").tier


def _disk_counts(cache) -> dict:
    return cache.snapshot()["tiers"]["disk"]


def test_an_unarmed_caches_disk_tier_is_the_plain_tier_and_calls_no_hook(make_cache, layout):
    cache = _disk_only(make_cache)
    disk = cache.tier("disk")
    assert type(disk) is DiskTier                     # no wrapper between the cache and its tier
    assert [type(level.tier) for level in cache.levels][-1] is DiskTier
    assert _written_by(cache) is disk           # the write-behind mover writes the tier itself
    assert disk.faults is None
    tokens, blocks = _store_on_disk(cache, layout, 0)
    prefix = cache.load(tokens)
    assert prefix.sources == ["disk"] * 3 and all(torch.equal(a, b) for a, b in zip(prefix.blocks, blocks))
    assert cache.faults.snapshot() == {"armed": [], "fired": dict.fromkeys(IO_FAULTS, 0)}


def test_arming_hooks_a_read_fault_into_the_tier_and_clearing_restores_plain_reads(make_cache, layout):
    cache = _disk_only(make_cache)
    disk = cache.tier("disk")
    tokens, _ = _store_on_disk(cache, layout, 0)
    cache.faults.arm("read_error")
    assert disk.faults is cache.faults and cache.tier("disk") is disk   # the same tier object, now hooked
    failed = cache.load(tokens)
    assert failed.num_blocks == 0                     # the batch's reads failed: a miss, never wrong KV
    assert _disk_counts(cache)["read_errors"] == 3
    assert cache.faults.snapshot() == {"armed": ["read_error"], "fired": {**dict.fromkeys(IO_FAULTS, 0),
                                                                          "read_error": 3}}
    cache.faults.clear()
    assert disk.faults is None and type(cache.tier("disk")) is DiskTier
    tokens, blocks = _store_on_disk(cache, layout, 0)
    prefix = cache.load(tokens)
    assert prefix.sources == ["disk"] * 3 and all(torch.equal(a, b) for a, b in zip(prefix.blocks, blocks))
    assert _disk_counts(cache)["read_errors"] == 3    # nothing more failed
    assert cache.faults.snapshot()["fired"]["read_error"] == 3


@pytest.mark.parametrize("kind", ["disk_full", "write_error"])
def test_a_write_fault_publishes_nothing_and_writes_go_on_once_cleared(make_cache, layout, kind):
    cache = _disk_only(make_cache)
    disk = cache.tier("disk")
    tokens = list(range(100, 100 + 3 * layout.block_size))
    blocks = [torch.randn(layout.block_shape) for _ in range(3)]
    keys = cache.keys_for(tokens)
    cache.faults.arm(kind)
    cache.store(tokens, blocks)
    cache.flush()                                     # every disk write met the fault
    assert _disk_counts(cache)["write_errors"] == 3
    assert not any(disk.path_for(key).exists() for key in keys)
    assert [cache.where(key) for key in keys] == [["device"]] * 3   # kept above, never published below
    cache.faults.clear(kind)
    assert disk.faults is None
    cache.evict("device")                             # demotes them to disk, now that writes work
    cache.flush()
    assert all(disk.path_for(key).exists() for key in keys)
    prefix = cache.load(tokens)
    assert prefix.sources == ["disk"] * 3 and all(torch.equal(a, b) for a, b in zip(prefix.blocks, blocks))
    assert _disk_counts(cache)["write_errors"] == 3


def test_clearing_one_of_two_faults_keeps_the_hooks_until_the_last_is_cleared(make_cache):
    cache = _disk_only(make_cache)
    disk = cache.tier("disk")
    cache.faults.arm("read_error")
    cache.faults.arm("slow_disk", delay_s=0.01)
    cache.faults.clear("read_error")
    assert disk.faults is cache.faults and cache.faults.armed() == ["slow_disk"]
    cache.faults.clear("slow_disk")
    assert disk.faults is None and cache.faults.armed() == []


def test_a_fault_that_has_run_out_takes_its_hooks_away(make_cache, layout):
    cache = _disk_only(make_cache)
    disk = cache.tier("disk")
    tokens, blocks = _store_on_disk(cache, layout, 200)
    cache.faults.arm("read_error", duration_s=0.05)
    time.sleep(0.1)                                   # past the fault's end
    assert cache.faults.armed() == []
    prefix = cache.load(tokens)                       # the hook meets the ended fault and leaves
    assert prefix.sources == ["disk"] * 3 and all(torch.equal(a, b) for a, b in zip(prefix.blocks, blocks))
    assert disk.faults is None and cache.faults.snapshot()["fired"]["read_error"] == 0


@pytest.mark.parametrize("kind, settings, message", [
    ("meteor", {}, "kind: expected one of disk_full, write_error, read_error, slow_disk, found 'meteor'"),
    ("slow_disk", {}, "delay_s: expected a delay > 0 for slow_disk, found 0.0"),
    ("read_error", {"duration_s": 0}, "duration_s: expected a duration > 0 (or none: until cleared), found 0"),
])
def test_a_bad_fault_is_refused_naming_the_field_and_nothing_is_hooked(make_cache, kind, settings, message):
    cache = _disk_only(make_cache)
    with pytest.raises(ValueError) as refused:
        cache.faults.arm(kind, **settings)
    assert str(refused.value) == message
    assert cache.tier("disk").faults is None and cache.faults.armed() == []


def test_a_cache_without_a_disk_tier_keeps_the_armed_state_and_hooks_nothing(make_cache):
    cache = make_cache(disk=None)
    cache.faults.arm("read_error")
    assert cache.faults.armed() == ["read_error"] and "disk" not in cache.tiers
    assert all(not hasattr(level.tier, "faults") for level in cache.levels)
    cache.faults.clear()
    assert cache.faults.armed() == []

