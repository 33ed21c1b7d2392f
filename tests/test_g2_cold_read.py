"""G2's cold read judged side by side: hand-made pairs through the verdict, and real rounds of a tiny
embedded server's disk tier alternating with real fio on the same directory."""

from __future__ import annotations

import shutil

import pytest

from gates.g2_baseline.cold_read import (MIN_PAIRS, Pair, FioRegions, Reading, TierColdLoad, disk_counters,
                                         measure_pairs, paired_ratio)
from gates.verdict import FAIL, INCONCLUSIVE, PASS, judge
from tests.servers import TINY_MODEL, distinct_prompt, started_server
from workloads.client import StreamingClient
from workloads.faults import AdminClient
from workloads.requests import WorkloadRequest

RULE = {"metric": "cold_read_vs_storage_best", "op": ">=", "value": 0.8}
# what one fio job gave on this disk within minutes (GB/s): a single one of them decides nothing
STORAGE = [1.3, 3.5, 2.1, 1.6, 2.9]
# one 256-token block of the tiny preset's float32 KV: 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 256
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


def _pairs(ratios: list[float], storage: list[float] = STORAGE) -> list[Pair]:
    """Pairs whose fio side swings with the storage and whose tier side is `ratio` of it in the same round."""
    gb = 1e9
    return [Pair(i, Reading(gb, 1 / (r * s)), Reading(gb, 1 / s)) for i, (r, s) in enumerate(zip(ratios, storage))]


def _judge(pairs: list[Pair]):
    judged = paired_ratio(pairs)
    return judge("g2", "cold read", "G2 cold read", judged.value, RULE, **judged.verdict_options())


def test_pairs_clearly_above_the_threshold_pass_however_much_the_storage_swings():
    verdict = _judge(_pairs([0.92, 0.95, 0.9, 0.94, 0.93]))
    assert verdict.status == PASS, verdict.reason
    assert 0.85 < verdict.value < 0.97 and 0.8 < verdict.interval[0] <= verdict.interval[1] < 1


def test_pairs_clearly_below_the_threshold_fail():
    verdict = _judge(_pairs([0.55, 0.6, 0.52, 0.58, 0.57]))
    assert verdict.status == FAIL, verdict.reason
    assert verdict.interval[1] < 0.8


def test_pairs_straddling_the_threshold_are_inconclusive():
    verdict = _judge(_pairs([0.65, 0.95, 0.7, 0.9, 0.82]))
    assert verdict.status == INCONCLUSIVE, verdict.reason
    assert verdict.interval[0] < 0.8 < verdict.interval[1] and "straddles" in verdict.reason


def test_fewer_than_five_pairs_are_never_judged():
    verdict = _judge(_pairs([0.95, 0.95, 0.95, 0.95]))
    assert verdict.status == INCONCLUSIVE
    assert f"4 side-by-side pairs, at least {MIN_PAIRS} needed" in verdict.reason
    assert _judge([]).status == INCONCLUSIVE


def test_the_pairs_alternate_the_tier_and_fio_and_fio_reads_as_many_bytes_as_the_tier():
    calls = []

    def tier(i):
        calls.append(("tier", i))
        return Reading(1000 + i, 1.0)

    def fio(i, nbytes):
        calls.append(("fio", i, nbytes))
        return Reading(nbytes, 0.5)

    pairs = measure_pairs(tier, fio, 2, warmup=1)
    assert calls == [("tier", 0), ("fio", 0, 1000), ("tier", 1), ("fio", 1, 1001), ("tier", 2), ("fio", 2, 1002)]
    assert [p.round for p in pairs] == [1, 2]            # the warm-up pair is measured, not kept
    assert [p.ratio for p in pairs] == [0.5, 0.5]
    assert pairs[1].context("tier") == {"round": 2, "tier_gbps": 1.002e-06, "fio_gbps": 2.004e-06, "tier_bytes": 1002,
                                  "tier_seconds": 1.0, "fio_bytes": 1002, "fio_seconds": 0.5}


def test_fio_reads_a_fresh_region_each_round_in_the_tiers_io_mode_and_parallelism(tmp_path):
    direct = FioRegions(tmp_path, rounds=5, direct=True, parallel=16, region=32 << 20)
    argv = direct.read_job(3).argv()
    assert {"--rw=read", "--bs=1048576", "--direct=1", "--ioengine=libaio", "--iodepth=16", "--numjobs=1",
            f"--size={32 << 20}", f"--offset={3 * (32 << 20)}", f"--filesize={5 * (32 << 20)}"} <= set(argv)
    buffered = FioRegions(tmp_path, rounds=5, direct=False, parallel=16)
    buffered._size_regions(30e6)  # 29 requests of 1 MiB: 16 jobs of 2 MiB each
    argv = buffered.read_job(1).argv()
    assert buffered.region == 32 << 20
    assert {"--direct=0", "--ioengine=psync", "--numjobs=16", f"--size={2 << 20}", f"--offset={32 << 20}",
            f"--offset_increment={2 << 20}"} <= set(argv)


# -- real rounds -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = {"cache": {"device_capacity_blocks": 32, "host_capacity_bytes": "16MiB",
                        "disk": {"path": "unused", "io_mode": "direct", "read_workers": 4}}}
    yield from started_server(tmp_path_factory.mktemp("g2-cold"), admin=True, engine=engine)


@pytest.fixture
def client(server):
    """A streaming client of the candidate server, closed at the end of the test."""
    client = StreamingClient(server.base_url + "/v1", TINY_MODEL, "completions", target="candidate")
    yield client
    client.close()


def _four_block_request(tag: str) -> WorkloadRequest:
    """A fresh prompt of 4 full tiny-preset blocks (1100 tokens), asked for one token."""
    text = distinct_prompt(f"g2 cold read {tag}", 1100)
    return WorkloadRequest(tag, tag, 0, ({"role": "user", "content": text},), 1, 1100)


@needs_fio
def test_real_pairs_read_the_disk_tier_each_round_and_fio_beside_it(server, client, tmp_path):
    admin = AdminClient(server.base_url)
    moved = []

    def request_for(i: int) -> WorkloadRequest:
        moved.append(disk_counters(admin).nbytes)
        return _four_block_request(f"cold-{i}")

    tier = TierColdLoad(admin, client, request_for)
    with FioRegions(tmp_path / "fio", rounds=MIN_PAIRS, direct=True, parallel=4) as fio:
        pairs = measure_pairs(tier, fio, MIN_PAIRS)
        assert fio.path.exists()
    assert not (tmp_path / "fio").exists()                   # its file and the directory it made are gone
    assert [p.round for p in pairs] == list(range(MIN_PAIRS))
    for pair in pairs:
        assert pair.subject.gbps > 0 and pair.fio.gbps > 0
        assert pair.subject.nbytes == 4 * TINY_BLOCK_BYTES       # 4 tiny-preset blocks, all from the disk tier
        assert pair.fio.nbytes == 1 << 20                     # the same bytes, in whole 1 MiB requests
    final = disk_counters(admin).nbytes
    # the server's disk bytes read moved by each round's cold load, not before it
    assert [b - a for a, b in zip(moved, moved[1:] + [final])] == [4 * TINY_BLOCK_BYTES] * MIN_PAIRS
    judged = paired_ratio(pairs)
    assert judged.valid and judged.value > 0 and judged.interval[0] <= judged.value <= judged.interval[1]


@needs_fio
def test_a_round_of_several_prefixes_reads_them_all_from_the_disk_tier(server, client):
    admin = AdminClient(server.base_url)
    asked = []

    def request_for(i: int) -> WorkloadRequest:
        asked.append(i)
        return _four_block_request(f"several-{i}")

    tier = TierColdLoad(admin, client, request_for, prefixes=3)
    readings = [tier(0), tier(1)]
    assert asked == [0, 1, 2, 3, 4, 5]                        # fresh prefixes each round
    assert [r.nbytes for r in readings] == [3 * 4 * TINY_BLOCK_BYTES] * 2

