"""A damaged, missing or foreign block is a miss (removed and counted), never wrong data."""

import errno
import os
import shutil
from dataclasses import replace

import pytest
import torch

from cache_impl.cache import blockfiles, integrity
from cache_impl.cache.faults import delete, flip_byte, truncate
from cache_impl.cache.tiers.base import write_block
from tests.blocks import BLOCK, blocks_for, files_below, plant_links_and_strays


def _disk_only(make_cache, **settings):
    """A cache whose blocks end up on disk alone (no device reuse, no host tier)."""
    return make_cache(host_capacity_bytes=0, **settings)


def test_the_disk_tier_is_had_as_one_and_none_without_it(make_cache):
    cache = make_cache()
    assert cache.disk_tier() is cache.tier("disk")
    assert make_cache(disk=None).disk_tier() is None


def _stored_on_disk(cache, layout, n_blocks=3):
    tokens = list(range(n_blocks * BLOCK))
    blocks = blocks_for(layout, tokens)
    cache.store(tokens, blocks)
    cache.flush()
    cache.evict("device")
    paths = [cache.tier("disk").path_for(k) for k in cache.keys_for(tokens)]
    assert all(p.exists() for p in paths)
    return tokens, blocks, paths


DAMAGE = {
    "payload-byte-flipped": (lambda p: flip_byte(p, integrity.HEADER_BYTES + 17), integrity.BAD_CHECKSUM),
    "header-byte-flipped": (lambda p: flip_byte(p, 40), integrity.BAD_HEADER),
    "truncated": (truncate, integrity.SHORT_READ),
    "deleted": (delete, integrity.MISSING),
}


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_block_is_a_counted_miss_and_the_prefix_ends_before_it(make_cache, layout, damage, io_mode):
    cache = _disk_only(make_cache, disk_io_mode=io_mode)
    tokens, blocks, paths = _stored_on_disk(cache, layout)
    harm, reason = DAMAGE[damage]
    harm(paths[1])
    prefix = cache.load(tokens)
    assert prefix.sources == ["disk"]            # block 0 was really read from disk
    assert torch.equal(prefix.blocks[0], blocks[0])
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["corrupt_blocks"] == 1 and disk["corrupt_by_reason"] == {reason: 1}
    assert not paths[1].exists()
    assert cache.lookup(tokens).num_blocks == 1      # removed from the index too
    assert cache.where(cache.keys_for(tokens)[2]) == ["disk"]  # later blocks stay, just unreachable now


def test_another_blocks_file_under_this_key_is_refused(make_cache, layout):
    """Valid checksum, wrong key: the bytes belong to another prefix."""
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout)
    shutil.copyfile(paths[2], paths[0])
    prefix = cache.load(tokens)
    assert prefix.num_blocks == 0
    assert cache.snapshot()["tiers"]["disk"]["corrupt_by_reason"] == {integrity.WRONG_KEY: 1}


def test_a_block_written_under_another_fingerprint_is_refused(make_cache, layout, fingerprint, tmp_path):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout)
    other = _disk_only(make_cache, fp=replace(fingerprint, weights_digest="seed-1"))
    foreign = other.tier("disk")
    write_block(foreign, cache.keys_for(tokens)[0], blocks[0])   # same key, other model's header
    shutil.copyfile(foreign.path_for(cache.keys_for(tokens)[0]), paths[0])
    prefix = cache.load(tokens)
    assert prefix.num_blocks == 0
    assert cache.snapshot()["tiers"]["disk"]["corrupt_by_reason"] == {integrity.WRONG_FINGERPRINT: 1}


def test_fingerprint_change_makes_every_older_block_unreachable(make_cache, layout, fingerprint):
    cache = make_cache()
    tokens, blocks, _ = _stored_on_disk(cache, layout)
    cache.close()
    for change in ({"weights_digest": "seed-1"}, {"tenant_salt": "tenant-b"}, {"format_version": 2}):
        fresh = make_cache(fp=replace(fingerprint, **change))
        assert fresh.lookup(tokens).num_blocks == 0
        prefix = fresh.load(tokens)
        assert prefix.num_blocks == 0
    same = make_cache()
    assert same.lookup(tokens).tiers == ["disk"] * 3   # the old model still finds its own blocks


def test_restart_reindexes_verified_blocks_and_removes_temp_files_and_bad_blocks(make_cache, layout):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout, n_blocks=4)
    cache.close()
    temp = paths[0].with_name(blockfiles.temp_name(paths[0].name))
    temp.write_bytes(b"half a block")                # a store that was killed mid-write
    flip_byte(paths[3], integrity.HEADER_BYTES + 5)  # silent corruption while stopped
    restarted = _disk_only(make_cache)
    assert not temp.exists() and not paths[3].exists()
    assert restarted.reindex_removed == 1
    assert restarted.lookup(tokens).tiers == ["disk"] * 3
    prefix = restarted.load(tokens)
    assert prefix.sources == ["disk"] * 3
    assert all(torch.equal(g, w) for g, w in zip(prefix.blocks, blocks))


def test_the_disk_tiers_temp_files_are_counted_in_its_snapshot_and_a_published_write_leaves_none(make_cache,
                                                                                                   layout):
    """G4 trends the disk tier's temp files: a write that never ended (here one left by hand) stays counted."""
    cache = _disk_only(make_cache)
    tokens, _, paths = _stored_on_disk(cache, layout, n_blocks=3)
    assert cache.snapshot()["tiers"]["disk"]["state"]["temp_files"] == 0      # every write published
    for path in paths[:2]:
        path.with_name(blockfiles.temp_name(path.name)).write_bytes(b"half a block")
    (paths[2].parent / "not-ours.tmp").write_bytes(b"x")                     # not a temp name of the tier's
    assert cache.snapshot()["tiers"]["disk"]["state"]["temp_files"] == 2


def test_restart_follows_no_link_and_removes_only_the_tiers_own_files(make_cache, layout, tmp_path):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout, n_blocks=4)
    cache.close()
    outside = tmp_path / "outside"
    strays = plant_links_and_strays(paths[0].parent.parent, outside)
    before, strays_before = files_below(outside), {s: s.read_bytes() for s in strays}
    flip_byte(paths[3], integrity.HEADER_BYTES + 5)  # one bad block of ours: the re-index still removes those
    restarted = _disk_only(make_cache)
    assert files_below(outside) == before             # temp- and block-named files outside stay as they were
    assert {s: s.read_bytes() for s in strays} == strays_before
    assert restarted.reindex_removed == 1 and not paths[3].exists()
    assert restarted.snapshot()["indexed_blocks"] == 3
    assert restarted.lookup(tokens).tiers == ["disk"] * 3


def _swap_for_link(directory, outside):
    """Move a key directory of the tier outside and leave a link to it in its place."""
    directory.rename(outside)
    directory.symlink_to(outside, target_is_directory=True)
    return files_below(outside)


def test_eviction_and_reads_never_go_through_a_link_swapped_in_for_a_directory(make_cache, layout, tmp_path):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout)
    outside = tmp_path / "outside"
    before = _swap_for_link(paths[0].parent, outside)   # block 0's file now lies outside, whole and valid
    prefix = cache.load(tokens)
    assert prefix.num_blocks == 0                    # not read through the link: a miss
    assert cache.snapshot()["tiers"]["disk"]["read_errors"] == 1
    cache.evict("disk")                                  # deletes every block file it indexed
    assert files_below(outside) == before
    assert not paths[1].exists() and not paths[2].exists()


def test_a_store_never_writes_through_a_link_swapped_in_for_a_directory(make_cache, layout, tmp_path):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout, n_blocks=1)
    cache.evict("disk")
    outside = tmp_path / "outside"
    before = _swap_for_link(paths[0].parent, outside)
    cache.store(tokens, blocks)
    cache.flush()
    assert cache.snapshot()["tiers"]["disk"]["write_errors"] == 1
    assert files_below(outside) == before and "disk" not in cache.where(cache.keys_for(tokens)[0])


def test_a_failed_disk_store_is_never_visible(make_cache, layout, monkeypatch):
    """Unit test of the publish path: a write that fails half-way (ENOSPC) leaves no file behind."""
    cache = _disk_only(make_cache)
    real_write_all = integrity.write_all

    def half_then_enospc(fd, buffers):
        os.write(fd, bytes(buffers[0])[:1000])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(integrity, "write_all", half_then_enospc)
    tokens = list(range(2 * BLOCK))
    cache.store(tokens, blocks_for(layout, tokens))
    cache.flush()
    monkeypatch.setattr(integrity, "write_all", real_write_all)
    assert cache.snapshot()["tiers"]["disk"]["write_errors"] == 2
    assert not list(cache.tier("disk").root.rglob("*.kvb")) and not list(cache.tier("disk").root.rglob("*.tmp"))
    assert all("disk" not in cache.where(k) for k in cache.keys_for(tokens))
    assert cache.snapshot()["tiers"]["disk"]["used_bytes"] == 0


def test_a_block_that_cannot_be_read_is_a_miss_counted_as_a_read_error(make_cache, layout):
    cache = _disk_only(make_cache)
    tokens, blocks, paths = _stored_on_disk(cache, layout)
    os.unlink(paths[1])
    paths[1].mkdir()                 # reading it now fails with EISDIR
    prefix = cache.load(tokens)
    assert prefix.num_blocks == 1
    disk = cache.snapshot()["tiers"]["disk"]
    assert disk["read_errors"] == 1 and disk["corrupt_blocks"] == 0
    assert cache.lookup(tokens).num_blocks == 1
