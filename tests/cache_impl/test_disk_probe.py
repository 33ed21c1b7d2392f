"""`io_mode: auto`: the disk tier times its own cold reads both ways at start and reads in the faster."""

import errno

import pytest
import torch

from cache_impl.cache.config import DiskTierConfig
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.tiers import disk_probe
from cache_impl.cache.tiers.base import write_block
from cache_impl.cache.tiers.disk import DiskTier

# 64 KiB blocks (a multiple of 4 KiB: O_DIRECT reads straight into them)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=64)


def _auto_tier(tmp_path, **config):
    return DiskTier(DiskTierConfig(path=tmp_path / "disk", io_mode="auto", **config),
                    Fingerprint("seed-0", "test-tokenizer", LAYOUT))


def test_auto_reads_the_probe_blocks_both_ways_keeps_the_faster_and_leaves_no_probe_file(tmp_path, monkeypatch):
    small = 2 * LAYOUT.block_nbytes                             # a quick probe: 2 blocks
    monkeypatch.setattr(disk_probe, "PROBE_BYTES", small)
    reads = []
    real_read = DiskTier.read_into

    def counting_read(self, keys, outs):
        reads.append((self.io_mode, len(keys)))
        return real_read(self, keys, outs)

    monkeypatch.setattr(DiskTier, "read_into", counting_read)
    tier = _auto_tier(tmp_path)
    probe = tier.probe
    # the probe really read: every round both modes, alternating which goes first, all its blocks each time
    assert reads == [("buffered", 2), ("direct", 2), ("direct", 2), ("buffered", 2), ("buffered", 2), ("direct", 2)]
    assert probe.blocks == 2 and probe.nbytes == small and probe.error is None
    assert all(len(probe.gbps[mode]) == 3 and min(probe.gbps[mode]) > 0 for mode in ("buffered", "direct"))
    faster = "direct" if probe.median("direct") > probe.median("buffered") else "buffered"
    assert probe.chosen == tier.io_mode == faster
    snapshot = tier.snapshot()
    assert snapshot["io_mode"] == faster and snapshot["io_probe"]["median_gbps"][faster] == probe.median(faster)
    assert list(tier._dir.walk()) == []                          # the probe blocks are gone
    block = torch.randn(LAYOUT.block_shape)                      # and the tier reads in the chosen mode
    write_block(tier, b"k" * 16, block)
    out = torch.empty(LAYOUT.block_shape)
    reads.clear()
    assert tier.read_into([b"k" * 16], [out]) == [None] and torch.equal(out, block)
    assert reads == [(faster, 1)]
    tier.close()


@pytest.mark.parametrize(
    "direct, buffered, chosen",
    [([3, 1, 3], [2, 2, 2], "direct"), ([1, 9, 1], [2, 2, 2], "buffered"), ([2, 2, 2], [2, 2, 2], "buffered")],
)
def test_the_probe_keeps_the_mode_with_the_higher_median_and_buffered_on_a_tie(tmp_path, monkeypatch, direct,
                                                                               buffered, chosen):
    monkeypatch.setattr(disk_probe, "PROBE_BYTES", LAYOUT.block_nbytes)
    figures = {"direct": iter(direct), "buffered": iter(buffered)}
    monkeypatch.setattr(disk_probe, "_cold_read_gbps", lambda tier, mode, keys, outs: next(figures[mode]))
    tier = _auto_tier(tmp_path)
    assert tier.io_mode == chosen and tier.probe.gbps == {"direct": direct, "buffered": buffered}
    tier.close()


def test_a_probe_that_cannot_write_leaves_the_tier_buffered_and_says_why(tmp_path, monkeypatch):
    def full(tier, key, block):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_probe, "write_block", full)
    tier = _auto_tier(tmp_path)
    assert tier.io_mode == "buffered" and "No space left on device" in tier.probe.error
    assert tier.snapshot()["io_probe"]["error"] == tier.probe.error
    tier.close()


def test_a_probe_read_that_is_refused_leaves_the_tier_buffered_and_removes_the_probe_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_probe, "PROBE_BYTES", 2 * LAYOUT.block_nbytes)
    monkeypatch.setattr(DiskTier, "read_into", lambda self, keys, outs: ["checksum"] * len(keys))
    tier = _auto_tier(tmp_path)
    assert tier.io_mode == "buffered"
    assert "2 of 2 probe blocks refused on a buffered read (checksum)" in tier.probe.error
    assert list(tier._dir.walk()) == []
    tier.close()


def test_a_fixed_io_mode_runs_no_probe(tmp_path):
    tier = DiskTier(DiskTierConfig(path=tmp_path / "disk", io_mode="direct"), Fingerprint("s", "t", LAYOUT))
    assert tier.probe is None and tier.snapshot() == {"io_mode": "direct", "temp_files": 0, "read_engine": "aio"}
    tier.close()
