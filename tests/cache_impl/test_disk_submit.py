"""The disk tier's O_DIRECT reads through Linux's native AIO: one thread, `read_workers` reads in flight."""

import os
import threading

import pytest
import torch

from cache_impl.cache import integrity
from cache_impl.cache.config import DiskTierConfig
from cache_impl.cache.faults import flip_byte
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.tiers import disk_submit
from cache_impl.cache.tiers.base import write_block
from cache_impl.cache.tiers.disk import DiskTier
from cache_impl.platform import kernel_aio
from cache_impl.platform.buffers import aligned_empty, byte_spans

pytestmark = pytest.mark.skipif(not kernel_aio.supported(), reason="native AIO needs Linux on x86_64 or aarch64")

# innermost runs of 4 KiB: a block of a request's KV takes O_DIRECT reads straight into its view
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16)


def _tier(tmp_path, read_engine="auto", read_workers=32):
    config = DiskTierConfig(path=tmp_path / "disk", io_mode="direct", read_engine=read_engine,
                            read_workers=read_workers)
    return DiskTier(config, Fingerprint("seed-0", "test-tokenizer", LAYOUT))


def _stored(tier, n):
    generator = torch.Generator().manual_seed(1)
    blocks = [torch.randn(LAYOUT.block_shape, generator=generator) for _ in range(n)]
    keys = [i.to_bytes(2, "big") * 8 for i in range(n)]
    for key, block in zip(keys, blocks):
        write_block(tier, key, block)
    return keys, blocks


def _views(n):
    """Block views of one request's KV [layers, 2, kv_heads, positions, head_dim], filled with -7."""
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n * LAYOUT.block_size, LAYOUT.head_dim)
    kv = aligned_empty(shape, torch.float32, "cpu").fill_(-7.0)
    return [kv[:, :, :, i * LAYOUT.block_size:(i + 1) * LAYOUT.block_size] for i in range(n)]


@pytest.fixture
def submits(monkeypatch):
    """Every read handed to the kernel, as (slot, number of buffers)."""
    seen = []
    real = kernel_aio.AioContext.submit_preadv

    def counted(self, slot, fd, regions, offset=0):
        seen.append((slot, len(regions)))
        return real(self, slot, fd, regions, offset)

    monkeypatch.setattr(kernel_aio.AioContext, "submit_preadv", counted)
    return seen


def test_direct_reads_are_handed_to_the_kernel_one_submit_a_block_and_fill_each_view(tmp_path, submits):
    tier = _tier(tmp_path)
    keys, blocks = _stored(tier, 3)
    views = _views(3)
    assert tier.read_into(keys, views) == [None, None, None]
    assert all(torch.equal(v, b) for v, b in zip(views, blocks))
    spans = len(byte_spans(views[0]).regions)
    assert submits == [(slot, 1 + spans) for slot, _ in submits] and len(submits) == 3  # header + the view's runs
    assert tier.snapshot()["read_engine"] == "aio"
    tier.close()


def test_more_blocks_than_the_queue_depth_are_read_as_slots_free_and_bad_ones_are_refused(tmp_path, submits):
    tier = _tier(tmp_path, read_workers=2)
    keys, blocks = _stored(tier, 9)
    flip_byte(tier.path_for(keys[4]), integrity.HEADER_BYTES + 5)
    tier.delete(keys[6])
    views = _views(9)
    reasons = tier.read_into(keys, views)
    assert reasons == [None] * 4 + [integrity.BAD_CHECKSUM, None, integrity.MISSING, None, None]
    assert all(torch.equal(views[i], blocks[i]) for i in (0, 1, 2, 3, 5, 7, 8))
    assert len(submits) == 8 and {slot for slot, _ in submits} == {0, 1}  # a missing file is never submitted
    tier.close()


def test_a_link_or_a_short_file_at_a_blocks_place_is_refused(tmp_path, submits):
    tier = _tier(tmp_path)
    keys, _ = _stored(tier, 3)
    path = tier.path_for(keys[0])
    path.unlink()
    path.symlink_to(tier.path_for(keys[1]))                    # a link is never followed
    os.truncate(tier.path_for(keys[2]), integrity.HEADER_BYTES + 4096)
    assert tier.read_into(keys, _views(3)) == [integrity.IO_ERROR, None, integrity.SHORT_READ]
    assert len(submits) == 2
    tier.close()


def test_outs_an_aio_read_cannot_land_in_are_left_to_the_threads_and_every_block_arrives(tmp_path, submits):
    tier = _tier(tmp_path)
    keys, blocks = _stored(tier, 4)
    aligned = _views(4)
    shape = aligned[0].shape
    misaligned = aligned_empty((aligned[0].numel() + 1,), torch.float32, "cpu")[1:].view(shape)  # 4 bytes past a page
    outs = [aligned[0], misaligned, aligned[2], aligned[3]]
    assert not byte_spans(misaligned).aligned
    assert tier.read_into(keys, outs) == [None] * 4
    assert all(torch.equal(out, block) for out, block in zip(outs, blocks))
    assert len(submits) == 3                                          # the misaligned one went through staging
    tier.close()


def test_read_engine_threads_reads_the_same_bytes_without_the_kernels_aio(tmp_path, submits):
    tier = _tier(tmp_path, read_engine="threads")
    keys, blocks = _stored(tier, 3)
    views = _views(3)
    assert tier.read_into(keys, views) == [None, None, None]
    assert all(torch.equal(v, b) for v, b in zip(views, blocks))
    assert submits == [] and tier.snapshot()["read_engine"] == "threads"
    tier.close()


def test_each_reading_thread_has_its_own_context_and_close_destroys_them_all(tmp_path):
    tier = _tier(tmp_path)
    keys, blocks = _stored(tier, 4)
    results = {}

    def read(name, part):
        views = _views(2)
        results[name] = (tier.read_into(keys[part], views), views)

    threads = [threading.Thread(target=read, args=(n, slice(2 * n, 2 * n + 2))) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n in range(2):
        reasons, views = results[n]
        assert reasons == [None, None] and all(torch.equal(v, b) for v, b in zip(views, blocks[2 * n:2 * n + 2]))
    contexts = [reads.context for reads in tier._submitters]
    assert len(contexts) == 2
    tier.close()
    assert tier._submitters == [] and all(context._handle == 0 for context in contexts)


def test_an_error_while_checking_a_read_waits_for_every_read_in_flight_and_closes_their_files(tmp_path):
    tier = _tier(tmp_path)
    keys, _ = _stored(tier, 6)
    views = _views(6)
    reads = disk_submit.SubmittedReads(depth=8)
    open_fds = len(os.listdir("/proc/self/fd"))
    checked = []

    def check(key, header, payload, got):
        checked.append(key)
        raise RuntimeError("the check failed")

    with pytest.raises(RuntimeError, match="the check failed"):
        disk_submit.read_submitted(reads, tier._open_direct, keys, lambda i: byte_spans(views[i]), check,
                                   [None] * len(keys))
    assert len(checked) == 1 and len(os.listdir("/proc/self/fd")) == open_fds   # the other five reaped and closed
    reads.close()
    tier.close()


def test_a_context_reads_a_file_into_several_regions_and_a_read_past_its_end_gives_what_is_there(tmp_path):
    path = tmp_path / "data"
    data = os.urandom(3 * 4096)
    path.write_bytes(data)
    buffer = aligned_empty((4 * 4096,), torch.uint8, "cpu").zero_()
    base = buffer.data_ptr()
    context = kernel_aio.AioContext(depth=2, max_iovecs=4)
    fd = os.open(path, os.O_RDONLY)
    try:
        context.submit_preadv(0, fd, [(base + 2 * 4096, 4096), (base, 4096)])          # two regions, out of order
        context.submit_preadv(1, fd, [(base + 3 * 4096, 4096)], offset=3 * 4096)        # at the file's end
        done = []
        while len(done) < 2:
            done += context.reap()
    finally:
        os.close(fd)
        context.close()
    assert sorted((c.tag, c.result) for c in done) == [(0, 2 * 4096), (1, 0)]
    got = buffer.numpy().tobytes()
    assert got[2 * 4096:3 * 4096] == data[:4096] and got[:4096] == data[4096:2 * 4096]


def test_a_read_the_kernel_refuses_at_submit_is_an_oserror_naming_the_call(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x" * 4096)
    buffer = aligned_empty((4096,), torch.uint8, "cpu")
    context = kernel_aio.AioContext(depth=1, max_iovecs=1)
    fd = os.open(path, os.O_WRONLY)                     # not open for reading: EBADF
    try:
        with pytest.raises(OSError, match="io_submit"):
            context.submit_preadv(0, fd, [(buffer.data_ptr(), 4096)])
    finally:
        os.close(fd)
        context.close()


def test_read_engine_aio_on_a_machine_without_native_aio_is_a_config_error_naming_the_field(monkeypatch, tmp_path):
    from cache_impl.cache.config import CacheConfig
    from kvcore.settings import ConfigError

    monkeypatch.setattr(kernel_aio, "supported", lambda: False)
    with pytest.raises(ConfigError, match=r"cache\.disk\.read_engine: expected auto or threads on this machine"):
        CacheConfig.from_dict({"disk": {"path": str(tmp_path), "read_engine": "aio"}})
    assert CacheConfig.from_dict({"disk": {"path": str(tmp_path), "read_engine": "auto"}}).disk.read_engine == "auto"


def test_a_forked_child_reads_through_a_context_of_its_own(tmp_path):
    tier = _tier(tmp_path)
    keys, blocks = _stored(tier, 3)
    assert tier.read_into(keys, _views(3)) == [None] * 3          # the parent's context, set up in this thread
    pid = os.fork()
    if pid == 0:                                                   # the child: only this thread, no pytest after it
        views = _views(3)
        ok = tier.read_into(keys, views) == [None] * 3 and all(torch.equal(v, b) for v, b in zip(views, blocks))
        tier.close()
        os._exit(0 if ok and len(tier._submitters) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.read_into(keys, _views(3)) == [None] * 3          # the parent's still works
    tier.close()
