"""LRU eviction demotes down the tiers, in recency order, and never exceeds a capacity."""

import torch

from tests.conftest import BLOCK, blocks_for


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
    cache.load(_prompt(0)).release()          # 0 becomes most recent on the device
    k2 = _store(cache, layout, 2)             # evicts 1 (LRU), not 0
    assert cache.where(k1) == ["host"] and cache.where(k0) == ["device"] and cache.where(k2) == ["device"]
    _store(cache, layout, 3)                  # evicts 0 -> host
    _store(cache, layout, 4)                  # evicts 2 -> host, host full: evicts 1 -> disk
    cache.flush()
    assert cache.where(k1) == ["disk"]
    assert cache.where(k0) == ["host"] and cache.where(k2) == ["host"]
    snap = cache.snapshot()["tiers"]
    assert snap["device"]["demotions"] == 3 and snap["host"]["demotions"] == 1
    with cache.load(_prompt(1)) as prefix:    # the disk copy is the original block
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


def test_a_load_promotes_to_the_device_and_keeps_lower_copies(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=1, host_capacity_bytes=layout.block_nbytes)
    k0 = _store(cache, layout, 0)
    _store(cache, layout, 1)
    _store(cache, layout, 2)
    cache.flush()
    assert cache.where(k0) == ["disk"]
    cache.load(_prompt(0)).release()
    assert cache.where(k0) == ["device", "disk"]


def test_capacities_are_never_exceeded(make_cache, layout):
    cache = make_cache(
        write_policy="write-back", device_capacity_blocks=3, host_capacity_bytes=5 * layout.block_nbytes,
        disk_capacity_bytes=7 * (layout.block_nbytes + 8192),
    )
    for n in range(40):
        _store(cache, layout, n)
        if n % 3 == 0:
            cache.load(_prompt(n // 2)).release()
        snap = cache.snapshot()["tiers"]
        for tier in snap.values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]
    cache.flush()
    snap = cache.snapshot()["tiers"]
    assert snap["device"]["blocks"] == 3 and snap["host"]["blocks"] == 5 and snap["disk"]["blocks"] == 7
    assert snap["disk"]["evictions"] > 0
    files = list(cache.tier("disk").root.rglob("*.kvb"))
    assert len(files) == 7


def test_pinned_blocks_are_not_evicted_and_a_full_pool_shortens_the_prefix(make_cache, layout):
    cache = make_cache(write_policy="write-back", device_capacity_blocks=2)
    tokens = list(range(3 * BLOCK))
    blocks = blocks_for(layout, tokens)
    cache.store(tokens, blocks)   # block 0 is demoted to host by block 2
    with cache.load(tokens[:BLOCK]) as held:
        assert held.sources == ["host"]
        with cache.load(tokens) as prefix:
            # two slots and three blocks: the pool cannot hold the whole prefix at once
            assert 1 <= prefix.num_blocks < 3
            assert all(torch.equal(g, w) for g, w in zip(prefix.blocks, blocks))
        assert torch.equal(held.blocks[0], blocks[0])
        assert cache.where(cache.keys_for(tokens)[0])[0] == "device"
    # a prefix cut short by pinned slots is not a miss
    assert cache.snapshot()["tiers"]["host"]["misses"] == 0


def test_eviction_skips_a_full_lower_tier_and_demotes_further_down(make_cache, layout):
    """With the host full of pinned blocks, a device eviction goes to disk instead of being dropped."""
    cache = make_cache(write_policy="write-back", device_capacity_blocks=3, host_capacity_bytes=3 * layout.block_nbytes)
    long_prompt = list(range(4 * BLOCK))
    cache.store(long_prompt, blocks_for(layout, long_prompt))   # blocks 0..3: 1,2,3 on device, 0 on host
    evicted = [_store(cache, layout, n) for n in (100, 101)]      # push blocks 1 and 2 to the host
    with cache.load(long_prompt[: 3 * BLOCK]) as prefix:          # pins 0,1,2 (all of the host)
        assert prefix.sources == ["host"] * 3
    cache.flush()
    for key in evicted + [cache.keys_for(long_prompt)[3]]:
        assert cache.where(key), "an evicted block was dropped instead of demoted"
    assert cache.where(evicted[0]) == ["disk"]
