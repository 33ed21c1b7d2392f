"""The host and device tiers copy a run of consecutive slots into one contiguous destination with one copy."""

import torch

from cache_impl.cache.keys import KVLayout
from cache_impl.cache.tiers import slots as slots_module
from cache_impl.cache.tiers.host import HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def _stored(n):
    tier = HostTier(LAYOUT, n * LAYOUT.block_nbytes, pin_memory=False)
    blocks = [torch.full(LAYOUT.block_shape, float(i)) for i in range(n)]
    keys = [bytes([i]) * 16 for i in range(n)]
    for key, block in zip(keys, blocks):
        tier.stage(key, block)
    return tier, keys, blocks


def _recording(monkeypatch):
    runs = []
    real = slots_module.SlotPool._copy_run

    def copy_run(self, slot, count, first_out):
        runs.append((slot, count))
        real(self, slot, count, first_out)

    monkeypatch.setattr(slots_module.SlotPool, "_copy_run", copy_run)
    return runs


def test_a_prefix_loaded_into_one_tensor_is_one_copy_with_every_blocks_bytes(monkeypatch):
    tier, keys, blocks = _stored(6)
    runs = _recording(monkeypatch)
    dest = torch.zeros((6, *LAYOUT.block_shape))
    assert tier.read_into(keys, list(dest)) == [None] * 6
    assert runs == [(0, 6)]
    assert all(torch.equal(dest[i], blocks[i]) for i in range(6))


def test_runs_break_where_slots_or_destinations_do_not_follow_on(monkeypatch):
    tier, keys, blocks = _stored(6)
    tier.delete(keys[2])                                   # free slot 2, then put block 2 back at the end
    keys[2] = b"x" * 16
    tier.stage(keys[2], blocks[2])                         # it takes the freed slot 2 again: order kept
    runs = _recording(monkeypatch)
    dest = torch.zeros((7, *LAYOUT.block_shape))
    outs = [dest[0], dest[1], dest[2], dest[4], dest[5], dest[6]]   # a gap in the destination after block 2
    order = [0, 1, 2, 3, 5, 4]                                      # and slots 5 and 4 swapped at the end
    assert tier.read_into([keys[i] for i in order], outs) == [None] * 6
    assert runs == [(0, 3), (3, 1), (5, 1), (4, 1)]
    for out, i in zip(outs, order):
        assert torch.equal(out, blocks[i])
    assert torch.equal(dest[3], torch.zeros(LAYOUT.block_shape))    # the gap was not written


def test_strided_views_of_a_request_kv_are_copied_block_by_block(monkeypatch):
    tier, keys, blocks = _stored(3)
    runs = _recording(monkeypatch)
    bs = LAYOUT.block_size
    kv = torch.zeros((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 3 * bs, LAYOUT.head_dim))
    views = [kv[:, :, :, i * bs:(i + 1) * bs] for i in range(3)]
    assert tier.read_into(keys, views) == [None] * 3
    assert runs == [(0, 1), (1, 1), (2, 1)]
    assert all(torch.equal(views[i], blocks[i]) for i in range(3))


def test_a_pools_resident_bytes_are_the_slots_touched_and_stay_through_eviction():
    """G4 subtracts the pools' resident bytes from the server's RSS: an eviction frees slots, not pages, so the
    bytes in use would read each eviction as memory outside the cache."""
    tier = HostTier(LAYOUT, 8 * LAYOUT.block_nbytes, pin_memory=False)
    assert tier.snapshot() == {"resident_bytes": 0}
    keys = [bytes([k]) * 16 for k in range(3)]
    for key in keys:
        tier.stage(key, torch.ones(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype))
    assert tier.snapshot()["resident_bytes"] == 3 * LAYOUT.block_nbytes
    for key in keys:
        tier.delete(key)                                    # evicted: the slots are free, their pages resident
    assert tier.snapshot()["resident_bytes"] == 3 * LAYOUT.block_nbytes
    tier.stage(keys[0], torch.ones(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype))    # a freed slot taken again
    assert tier.snapshot()["resident_bytes"] == 3 * LAYOUT.block_nbytes
