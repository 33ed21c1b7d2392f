"""LRU eviction demotes down the tiers, in recency order, and never exceeds a capacity."""

import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from cache_impl.cache.metrics import TierMetrics
from cache_impl.cache.placement import Level, Placement
from tests.blocks import BLOCK, blocks_for


def _prompt(n: int) -> list[int]:
    """A one-block prompt distinct for every n."""
    return [n] * BLOCK


def _store(cache, layout, n):
    tokens = _prompt(n)
    assert cache.store(tokens, blocks_for(layout, tokens)) == 1
    return cache.keys_for(tokens)[0]


def test_write_back_evicts_least_recently_used_and_demotes_it_one_tier_down(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=2, host_capacity_bytes=2 * layout.block_nbytes)
    k0, k1 = _store(cache, layout, 0), _store(cache, layout, 1)
    assert cache.where(k0) == ["device"] and cache.where(k1) == ["device"]
    cache.load(_prompt(0))          # 0 becomes most recent on the device
    k2 = _store(cache, layout, 2)             # evicts 1 (LRU), not 0
    assert cache.where(k1) == ["host"] and cache.where(k0) == ["device"] and cache.where(k2) == ["device"]
    _store(cache, layout, 3)                  # evicts 0 -> host
    _store(cache, layout, 4)                  # evicts 2 -> host, host full: evicts 1 -> disk
    cache.flush()
    assert cache.where(k1) == ["disk"]
    assert cache.where(k0) == ["host"] and cache.where(k2) == ["host"]
    snap = cache.snapshot()["tiers"]
    assert snap["device"]["demotions"] == 3 and snap["host"]["demotions"] == 1
    prefix = cache.load(_prompt(1))    # the disk copy is the original block
    assert prefix.sources == ["disk"]
    assert torch.equal(prefix.blocks[0], blocks_for(layout, _prompt(1))[0])


def test_write_through_puts_new_blocks_in_every_tier_and_eviction_only_drops_copies(make_cache, layout):
    cache = make_cache(write_policy="write-through", device_capacity_blocks=1)
    k0 = _store(cache, layout, 0)
    cache.flush()
    assert cache.where(k0) == ["device", "host", "disk"]
    _store(cache, layout, 1)
    cache.flush()
    assert cache.where(k0) == ["host", "disk"]
    assert cache.snapshot()["tiers"]["device"]["demotions"] == 0


def test_a_load_leaves_placement_alone_and_promote_puts_the_block_back_on_the_device(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=1, host_capacity_bytes=layout.block_nbytes)
    k0 = _store(cache, layout, 0)
    _store(cache, layout, 1)
    _store(cache, layout, 2)
    cache.flush()
    assert cache.where(k0) == ["disk"]
    prefix = cache.load(_prompt(0))
    assert prefix.sources == ["disk"] and cache.where(k0) == ["disk"]  # copied straight into the caller's tensor
    assert cache.promote(_prompt(0), prefix.blocks) == 1
    assert cache.where(k0) == ["device", "disk"]
    assert cache.promote(_prompt(0), prefix.blocks) == 0             # already there: nothing placed twice


def test_capacities_are_never_exceeded(make_cache, layout):
    cache = make_cache(
        write_policy="write-back", device_capacity_blocks=3, host_capacity_bytes=5 * layout.block_nbytes,
        disk_capacity_bytes=7 * (layout.block_nbytes + 8192),
    )
    for n in range(40):
        _store(cache, layout, n)
        if n % 3 == 0:
            cache.load(_prompt(n // 2))
        snap = cache.snapshot()["tiers"]
        for tier in snap.values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]
    cache.flush()
    snap = cache.snapshot()["tiers"]
    assert snap["device"]["blocks"] == 3 and snap["host"]["blocks"] == 5 and snap["disk"]["blocks"] == 7
    assert snap["disk"]["evictions"] > 0
    files = list(cache.tier("disk").root.rglob("*.kvb"))
    assert len(files) == 7


@contextmanager
def _load_in_progress(cache, tokens, blocks_pinned: int):
    """A load of `tokens` on another thread, held before it copies anything until the block exits.

    Yields once the load has pinned `blocks_pinned` blocks; the block's result is in the list yielded.
    """
    proceed, result = threading.Event(), []
    destination = torch.empty((len(tokens) // BLOCK, *cache.layout.block_shape), dtype=cache.layout.torch_dtype)

    def out(i):
        proceed.wait(30)
        return destination[i]

    loader = threading.Thread(target=lambda: result.append((cache.load_into(tokens, out), destination)))
    loader.start()
    deadline = time.monotonic() + 30
    while cache.snapshot()["pinned_blocks"] < blocks_pinned:
        assert time.monotonic() < deadline, "the load never pinned its blocks"
        time.sleep(0.01)
    try:
        yield result
    finally:
        proceed.set()
        loader.join(30)


def test_blocks_a_load_is_reading_are_never_evicted(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=2)
    tokens = list(range(3 * BLOCK))
    blocks = blocks_for(layout, tokens)
    cache.store(tokens, blocks)   # block 0 is demoted to host by block 2
    with _load_in_progress(cache, tokens, blocks_pinned=3) as result:
        assert cache.evict("device") == 0 and cache.evict("host") == 0   # all three are pinned
        for n in range(100, 104):
            _store(cache, layout, n)                                      # cannot push them out either
        assert [cache.where(k)[0] for k in cache.keys_for(tokens)] == ["host", "device", "device"]
    prefix, destination = result[0]
    assert prefix.sources == ["host", "device", "device"]
    assert all(torch.equal(destination[i], blocks[i]) for i in range(3))
    assert cache.snapshot()["pinned_blocks"] == 0
    assert cache.evict("device") == 2                                     # released: evictable again


def test_a_prefix_longer_than_the_device_tier_loads_whole(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=2, host_capacity_bytes=8 * layout.block_nbytes)
    tokens = list(range(5 * BLOCK))
    blocks = blocks_for(layout, tokens)
    cache.store(tokens, blocks)
    prefix = cache.load(tokens)
    assert prefix.sources == ["host"] * 3 + ["device"] * 2
    assert all(torch.equal(got, want) for got, want in zip(prefix.blocks, blocks))
    assert cache.snapshot()["tiers"]["host"]["misses"] == 0


def test_eviction_skips_a_full_lower_tier_and_demotes_further_down(make_cache, layout):
    """With the host full of pinned blocks, a device eviction goes to disk instead of being dropped."""
    cache = make_cache(write_policy="write-back", device_capacity_blocks=3, host_capacity_bytes=3 * layout.block_nbytes)
    long_prompt = list(range(6 * BLOCK))
    cache.store(long_prompt, blocks_for(layout, long_prompt))   # blocks 3,4,5 on the device, 0,1,2 on the host
    with _load_in_progress(cache, long_prompt[: 3 * BLOCK], blocks_pinned=3):   # pins 0,1,2: all of the host
        evicted = [_store(cache, layout, n) for n in (100, 101)]                # push blocks 3 and 4 out
        cache.flush()
        for key in cache.keys_for(long_prompt)[3:5]:
            assert cache.where(key) == ["disk"], "an evicted block was dropped instead of demoted past the host"
    assert all(cache.where(key) == ["device"] for key in evicted)


def test_a_tier_that_keeps_its_own_capacity_has_no_blocks_to_evict_and_says_so():
    pool = Level(0, SimpleNamespace(name="remote"), TierMetrics(), None, None, True)
    with pytest.raises(ValueError, match="remote tier: manages its own capacity"):
        Placement([pool]).unprotected(pool)
