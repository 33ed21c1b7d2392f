"""The disk tier reads a block straight into the caller's memory: strided views, O_DIRECT, staging when it must."""

import pytest
import torch
import xxhash

from cache_impl.cache import integrity
from cache_impl.cache.config import DiskTierConfig
from cache_impl.cache.faults import flip_byte, truncate
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.tiers.base import write_block
from cache_impl.cache.tiers.disk import DiskTier
from cache_impl.platform.buffers import aligned_empty, byte_spans

# A block's innermost run (block_size * head_dim * 4 bytes) is 4 KiB here: O_DIRECT can read into a view.
ALIGNED = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16)
# 128-byte runs: O_DIRECT has to go through the staging buffer.
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
# More runs than one preadv takes (IOV_MAX is 1024 on Linux).
MANY_RUNS = KVLayout(num_layers=300, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
N_BLOCKS = 3


def _tier(tmp_path, layout, io_mode):
    config = DiskTierConfig(path=tmp_path / "disk", io_mode=io_mode, cold_reads=io_mode == "buffered")
    return DiskTier(config, Fingerprint("seed-0", "test-tokenizer", layout))


def _stored(tier, layout):
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(layout.block_shape, generator=generator) for _ in range(N_BLOCKS)]
    keys = [bytes([i]) * 16 for i in range(N_BLOCKS)]
    for key, block in zip(keys, blocks):
        write_block(tier, key, block)
    return keys, blocks


def _request_kv(layout, fill=-7.0, offset_elems=0):
    """A request's KV [layers, 2, kv_heads, total, head_dim] (its data `offset_elems` past an aligned start)."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, N_BLOCKS * layout.block_size, layout.head_dim)
    count = torch.Size(shape).numel()
    raw = aligned_empty((count + offset_elems,), layout.torch_dtype, "cpu")
    kv = raw[offset_elems:].view(shape)
    kv.fill_(fill)
    return kv


def _block_views(kv, layout):
    bs = layout.block_size
    return [kv[:, :, :, i * bs : (i + 1) * bs] for i in range(N_BLOCKS)]


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
@pytest.mark.parametrize("layout", [ALIGNED, SMALL, MANY_RUNS], ids=["aligned-runs", "small-runs", "many-runs"])
def test_a_strided_view_of_a_request_kv_receives_exactly_each_blocks_bytes(tmp_path, layout, io_mode):
    tier = _tier(tmp_path, layout, io_mode)
    keys, blocks = _stored(tier, layout)
    kv = _request_kv(layout)
    views = _block_views(kv, layout)
    assert tier.read_into(keys[1:], views[1:]) == [None, None]
    assert torch.equal(views[1], blocks[1]) and torch.equal(views[2], blocks[2])
    assert bool((views[0] == -7.0).all())               # nothing written outside the blocks read
    tier.close()


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_a_misaligned_destination_falls_back_to_staging_and_still_gets_the_bytes(tmp_path, io_mode):
    tier = _tier(tmp_path, ALIGNED, io_mode)
    keys, blocks = _stored(tier, ALIGNED)
    kv = _request_kv(ALIGNED, offset_elems=1)        # 4 bytes past a page: O_DIRECT into it would fail (EINVAL)
    views = _block_views(kv, ALIGNED)
    assert not byte_spans(views[0]).aligned
    assert tier.read_into(keys, views) == [None] * N_BLOCKS
    assert all(torch.equal(v, b) for v, b in zip(views, blocks))
    tier.close()


def test_a_destination_whose_innermost_dim_is_strided_gets_the_bytes_through_staging(tmp_path):
    tier = _tier(tmp_path, SMALL, "buffered")
    keys, blocks = _stored(tier, SMALL)
    out = torch.zeros((*SMALL.block_shape[:-1], 2 * SMALL.head_dim))[..., ::2]
    assert byte_spans(out) is None
    assert tier.read_into(keys[:1], [out]) == [None]
    assert torch.equal(out, blocks[0])
    tier.close()


DAMAGE = {
    "payload-byte-flipped": (lambda p: flip_byte(p, integrity.HEADER_BYTES + 4096 + 3), integrity.BAD_CHECKSUM),
    "last-payload-byte-flipped": (lambda p: flip_byte(p, integrity.HEADER_BYTES + ALIGNED.block_nbytes - 1),
                                  integrity.BAD_CHECKSUM),
    "header-byte-flipped": (lambda p: flip_byte(p, 40), integrity.BAD_HEADER),
    "truncated": (truncate, integrity.SHORT_READ),
}


@pytest.mark.parametrize("offset_elems", [0, 1], ids=["into-the-view", "through-staging"])
@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_block_read_into_a_view_is_refused_and_its_neighbours_are_not(tmp_path, damage, io_mode,
                                                                                 offset_elems):
    tier = _tier(tmp_path, ALIGNED, io_mode)
    keys, blocks = _stored(tier, ALIGNED)
    harm, reason = DAMAGE[damage]
    harm(tier.path_for(keys[1]))
    views = _block_views(_request_kv(ALIGNED, offset_elems=offset_elems), ALIGNED)
    assert tier.read_into(keys, views) == [None, reason, None]
    assert torch.equal(views[0], blocks[0]) and torch.equal(views[2], blocks[2])
    assert tier.verify(keys[1]) == reason and tier.verify(keys[0]) is None
    tier.close()


def test_byte_spans_lists_a_block_views_runs_in_logical_order():
    kv = aligned_empty((4, 2, 2, 64, 64), torch.bfloat16, "cpu")
    kv.copy_(torch.randn(kv.shape))
    assert kv.data_ptr() % 4096 == 0
    view = kv[:, :, :, 16:32]
    spans = byte_spans(view)
    assert len(spans.views) == 4 * 2 * 2 and spans.nbytes == view.numel() * 2
    assert b"".join(bytes(s) for s in spans.views) == view.contiguous().view(torch.uint8).numpy().tobytes()
    assert byte_spans(view, align=2048).aligned         # 16 tokens * 64 * 2 bytes = 2 KiB runs at 2 KiB offsets ...
    assert not spans.aligned                            # ... not 4 KiB ones (the default)
    whole = byte_spans(kv)
    assert len(whole.views) == 1 and whole.aligned      # a contiguous tensor is one run


def test_the_checksum_over_spans_is_the_checksum_of_their_concatenation():
    data = bytes(range(256)) * 300
    spans = [memoryview(data)[i : i + 1000] for i in range(0, len(data), 1000)]
    assert integrity.checksum_spans(spans) == xxhash.xxh3_128_digest(data) == integrity.checksum(data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_a_cuda_destination_is_filled_through_a_pinned_staging_buffer(tmp_path, io_mode):
    tier = _tier(tmp_path, ALIGNED, io_mode)
    keys, blocks = _stored(tier, ALIGNED)
    kv = _request_kv(ALIGNED).cuda()
    views = _block_views(kv, ALIGNED)
    assert tier.read_into(keys, views) == [None] * N_BLOCKS
    assert all(torch.equal(v.cpu(), b) for v, b in zip(views, blocks))
    assert tier._scratch(pinned=True)[0].is_pinned()
    tier.close()


def test_large_host_buffers_start_on_a_huge_page_and_keep_their_bytes_while_views_live():
    from cache_impl.platform.buffers import HUGE_PAGE

    big = aligned_empty((4, HUGE_PAGE // 4), torch.float32, "cpu")             # 8 MiB: huge-page backed
    assert big.data_ptr() % HUGE_PAGE == 0 and big.is_contiguous() and big.shape == (4, HUGE_PAGE // 4)
    view = big[2]
    del big                                                                     # the mapping lives on in the view
    view.fill_(1.5)
    assert float(view.sum()) == 1.5 * HUGE_PAGE // 4
    small = aligned_empty((1024,), torch.float32, "cpu")                        # below 2 MiB: torch's allocator
    assert small.data_ptr() % 4096 == 0


def test_a_huge_page_buffer_too_large_for_this_host_is_a_memory_error_that_says_so():
    with pytest.raises(MemoryError, match="can't allocate memory: you tried to allocate"):
        aligned_empty((2**62,), torch.uint8, "cpu")
