"""Blocks come back bitwise equal from every tier, and the longest-prefix rules hold."""

import pytest
import torch

from cache_impl import Fingerprint, KVLayout
from tests.blocks import BLOCK, block_for, blocks_for


def _only_on(cache, tier):
    """Evict the tiers above `tier`, so that it is the highest one holding the blocks (write-through)."""
    cache.flush()
    for above in ("device", "host")[: ("device", "host", "disk").index(tier)]:
        cache.evict(above)


@pytest.mark.parametrize(
    "tier, disk_settings",
    [
        ("device", {}),
        ("host", {}),
        ("disk", {}),
        ("disk", {"disk_io_mode": "direct"}),
        ("disk", {"disk_cold_reads": True}),
    ],
    ids=["device", "host", "disk-buffered", "disk-direct", "disk-cold"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise_equal_through_every_tier(make_cache, tier, disk_settings, dtype):
    layout = KVLayout(2, 2, 8, dtype, BLOCK)
    cache = make_cache(Fingerprint("seed-0", "test-tokenizer", layout), **disk_settings)
    tokens = list(range(3 * BLOCK))
    blocks = blocks_for(layout, tokens)
    assert cache.store(tokens, blocks) == 3
    _only_on(cache, tier)
    assert cache.lookup(tokens).tiers == [tier] * 3
    prefix = cache.load(tokens)
    assert prefix.sources == [tier] * 3
    for got, want in zip(prefix.blocks, blocks):
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert cache.snapshot()["tiers"][tier]["hits"] == 3


def test_lookup_stops_where_prompts_diverge_mid_block(make_cache, layout):
    cache = make_cache()
    stored = list(range(4 * BLOCK))
    cache.store(stored, blocks_for(layout, stored))
    diverging = stored[: 2 * BLOCK + 1] + [999] + stored[2 * BLOCK + 2 :]
    match = cache.lookup(diverging)
    assert match.num_blocks == 2 and match.num_tokens == 2 * BLOCK
    prefix = cache.load(diverging)
    assert prefix.num_tokens == 2 * BLOCK
    assert torch.equal(prefix.blocks[1], block_for(layout, stored, 1))


def test_partial_last_block_is_neither_stored_nor_matched(make_cache, layout):
    cache = make_cache()
    tokens = list(range(2 * BLOCK + 3))
    assert cache.store(tokens, blocks_for(layout, tokens) + [torch.zeros(layout.block_shape)]) == 2
    assert cache.lookup(tokens + [7]).num_tokens == 2 * BLOCK
    assert cache.lookup(tokens[:BLOCK]).num_tokens == BLOCK
    assert cache.lookup(tokens[: BLOCK - 1]).num_tokens == 0


def test_a_different_first_block_shares_nothing_even_with_equal_later_tokens(make_cache, layout):
    cache = make_cache()
    tokens = list(range(3 * BLOCK))
    cache.store(tokens, blocks_for(layout, tokens))
    assert cache.lookup([777] + tokens[1:]).num_blocks == 0
    assert cache.snapshot()["tiers"]["device"]["hits"] == 0


def test_storing_an_existing_block_never_overwrites_it(make_cache, layout):
    cache = make_cache()
    tokens = list(range(BLOCK))
    original = block_for(layout, tokens, 0)
    cache.store(tokens, [original])
    assert cache.store(tokens, [torch.zeros(layout.block_shape)]) == 0
    prefix = cache.load(tokens)
    assert torch.equal(prefix.blocks[0], original)


def test_store_with_first_block_offset_appends_after_a_loaded_prefix(make_cache, layout):
    cache = make_cache()
    tokens = list(range(4 * BLOCK))
    blocks = blocks_for(layout, tokens)
    cache.store(tokens[: 2 * BLOCK], blocks[:2])
    prefix = cache.load(tokens)
    assert prefix.num_blocks == 2
    assert cache.store(tokens, blocks[2:], first_block=2) == 2
    prefix = cache.load(tokens)
    assert all(torch.equal(g, w) for g, w in zip(prefix.blocks, blocks))
