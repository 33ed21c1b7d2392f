"""G2's cold read judged side by side with the storage's best: hand-made pairs through the verdict, the
sequential stopping, and real rounds of a tiny embedded server's disk tier alternating with real fio on
the same directory."""

from __future__ import annotations

import math
import shutil

import pytest

from gates.g2_baseline.cold_read import (
    MIN_PAIRS,
    FioRegions,
    Pair,
    Pairing,
    Reading,
    TierColdLoad,
    disk_counters,
    measure_pairs,
    own_pattern,
    paired_ratio,
)
from gates.side_by_side import FasterOf
from kvcore.rules import Threshold
from kvcore.verdict import FAIL, INCONCLUSIVE, PASS, judge
from tests.servers import TINY_MODEL, distinct_prompt, started_server
from workloads.probes.faults import AdminClient
from workloads.storage.fio_sweep import FioShape
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest

RULE = Threshold("cold_read_vs_storage_best", ">=", 0.8)
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


def test_fewer_than_three_pairs_are_never_judged():
    verdict = _judge(_pairs([0.95, 0.95]))
    assert verdict.status == INCONCLUSIVE
    assert f"2 side-by-side pairs, at least {MIN_PAIRS} needed" in verdict.reason
    assert _judge([]).status == INCONCLUSIVE


def test_the_judged_ratio_divides_by_the_best_job_not_by_fio_in_the_tiers_own_pattern():
    # a serial tier: as fast as fio at its own queue depth 1, half of what the storage's best job reads
    gb = 1e9
    swings = [1.0, 1.2, 0.9, 1.1, 1.0]            # the storage's seconds per GB, round by round
    pairs = [Pair(i, Reading(gb, 1.0), Reading(gb, 0.5 * s), Reading(gb, s)) for i, s in enumerate(swings)]
    judged = paired_ratio(pairs)
    verdict = judge("g2", "cold read", "G2 cold read", judged.value, RULE, **judged.verdict_options())
    assert verdict.status == FAIL, verdict.reason
    assert judged.value == pytest.approx(0.5 * math.prod(swings) ** (1 / len(swings)))   # geometric mean of s / 2
    assert judged.interval[1] < 0.8                                  # the best job decides it
    assert judged.same_pattern_ratio == pytest.approx(2 * judged.value)   # at its own pattern ~1: shown only
    assert "diagnostic, not judged" in judged.diagnostic()


def test_the_pairs_alternate_the_tier_the_best_job_and_fio_in_the_tiers_pattern_on_as_many_bytes():
    calls = []

    def tier(i):
        calls.append(("tier", i))
        return Reading(1000 + i, 1.0)

    def best(i, nbytes):
        calls.append(("best", i, nbytes))
        return Reading(nbytes, 0.5)

    def own(i, nbytes):
        calls.append(("own", i, nbytes))
        return Reading(nbytes, 1.0)

    pairs, stopping = measure_pairs(tier, best, Pairing(min=3, max=3, budget_s=60), [RULE], warmup=1,
                                    same_pattern=own)
    assert calls[:6] == [("tier", 0), ("best", 0, 1000), ("own", 0, 1000), ("tier", 1), ("best", 1, 1001),
                         ("own", 1, 1001)]
    assert [p.round for p in pairs] == [1, 2, 3]            # the warm-up pair is measured, not kept
    assert [p.ratio for p in pairs] == [0.5, 0.5, 0.5]
    assert pairs[1].context("tier") == {"round": 2, "tier_gbps": 1.002e-06, "fio_gbps": 2.004e-06, "tier_bytes": 1002,
                                        "tier_seconds": 1.0, "fio_bytes": 1002, "fio_seconds": 0.5,
                                        "same_pattern_gbps": 1.002e-06, "same_pattern_ratio": 1.0}
    assert stopping.pairs == 3 and stopping.decided      # 0.5 every pair: below 0.8 with no doubt


def _steady(ratios):
    """A subject whose pair i reads at ratios[i % len] of a steady best job."""
    taken = []

    def subject(i):
        taken.append(i)
        return Reading(1e9 * ratios[i % len(ratios)], 1.0)

    return subject, (lambda i, nbytes: Reading(1e9, 1.0)), taken


def test_sampling_stops_at_the_minimum_once_the_interval_clears_the_rule():
    subject, best, taken = _steady([0.95, 0.97, 0.96, 0.94])
    pairs, stopping = measure_pairs(subject, best, Pairing(min=4, max=20, budget_s=600), [RULE])
    assert stopping.decided and stopping.pairs == 4 == len(pairs) == len(taken)
    verdict = judge("g2", "cold read", "G2", paired_ratio(pairs, stopping).value, RULE,
                    **paired_ratio(pairs, stopping).verdict_options())
    assert verdict.status == PASS, verdict.reason
    assert "decided after 4 pairs" in paired_ratio(pairs, stopping).describe()


def test_sampling_runs_to_the_maximum_when_the_ratio_sits_on_the_threshold():
    subject, best, taken = _steady([0.7, 0.9, 0.75, 0.88])
    pairs, stopping = measure_pairs(subject, best, Pairing(min=3, max=9, budget_s=600), [RULE])
    assert not stopping.decided and stopping.pairs == 9 == len(taken)
    assert "the most allowed" in stopping.why
    judged = paired_ratio(pairs, stopping)
    assert judge("g2", "cold read", "G2", judged.value, RULE, **judged.verdict_options()).status == INCONCLUSIVE


def test_fio_reads_a_fresh_region_each_round_in_the_given_shape(tmp_path):
    direct = FioRegions(tmp_path, rounds=5, shape=own_pattern(True, 16), region=32 << 20)
    argv = direct.read_job(3).argv()
    assert {"--rw=read", "--bs=1048576", "--direct=1", "--ioengine=libaio", "--iodepth=16", "--numjobs=1",
            f"--size={32 << 20}", f"--offset={3 * (32 << 20)}", f"--filesize={5 * (32 << 20)}"} <= set(argv)
    buffered = FioRegions(tmp_path, rounds=5, shape=own_pattern(False, 16))
    buffered._size_regions(30e6)  # 29 requests of 1 MiB: 16 jobs of 2 MiB each
    argv = buffered.read_job(1).argv()
    assert buffered.region == 32 << 20
    assert {"--direct=0", "--ioengine=psync", "--numjobs=16", f"--size={2 << 20}", f"--offset={32 << 20}",
            f"--offset_increment={2 << 20}"} <= set(argv)
    best = FioRegions(tmp_path, rounds=5, shape=FioShape(True, "io_uring", 32, 4, "16M"))
    best._size_regions(30e6)      # at least as many bytes: 4 jobs of one 16 MiB request each
    assert best.region == 64 << 20
    assert {"--bs=16M", "--ioengine=io_uring", "--iodepth=32", "--numjobs=4", f"--size={16 << 20}"} <= set(
        best.read_job(0).argv())
    floor = FioRegions(tmp_path, rounds=2, shape=FioShape(False, "psync", 1, 4, "1M"), min_bytes=128 << 20)
    floor._size_regions(62e6)      # a short read shows fio's start: the yardstick reads at least min_bytes
    assert floor.region == 128 << 20 and f"--size={32 << 20}" in floor.read_job(1).argv()
    laid_out = best.layout_job().argv()              # every region written once, at the first round
    assert {"--rw=write", f"--size={5 * (64 << 20)}", "--end_fsync=1", "--direct=0"} <= set(laid_out)
    assert f"--offset={(7 % 5) * (64 << 20)}" in best.read_job(7 % 5).argv()  # round 7 reads region 2


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
def test_real_pairs_reload_the_stored_sets_from_the_disk_tier_and_the_best_job_beside_it(server, client, tmp_path):
    admin = AdminClient(server.base_url)
    asked, moved = [], []
    stored = TierColdLoad(admin, client, lambda i: asked.append(i) or _four_block_request(f"cold-{i}"), sets=2)

    def tier(index: int) -> Reading:            # the server's disk bytes read, counted around each round
        before = disk_counters(admin).nbytes
        reading = stored(index)
        moved.append(disk_counters(admin).nbytes - before)
        return reading

    best_shape = FioShape(True, "libaio", 8, 2, "256k")
    with FioRegions(tmp_path / "fio", rounds=2, shape=best_shape, name="best") as best, \
            FioRegions(tmp_path / "fio", rounds=2, shape=own_pattern(True, 4), name="own") as own:
        # equal draws: two loads a round (the yardstick of G2 runs two jobs), the faster counted
        pairs, stopping = measure_pairs(tier, best, Pairing(min=MIN_PAIRS, max=MIN_PAIRS, budget_s=600), [RULE],
                                        same_pattern=own, draws=2)
        assert best.path.exists() and own.path.exists()
        assert best.path.stat().st_size == 2 * best.region   # two regions, laid out once, read in turn
    assert not (tmp_path / "fio").exists()                   # their files and the directory they made are gone
    assert [p.round for p in pairs] == list(range(MIN_PAIRS)) and stopping.pairs == MIN_PAIRS
    assert asked == [0, 1]                                   # both sets stored at the first round, never again
    for pair in pairs:
        assert pair.subject.gbps > 0 and pair.fio.gbps > 0 and pair.same_pattern.gbps > 0
        assert len(pair.subject_draws) == 2 and pair.subject == max(pair.subject_draws, key=lambda r: r.gbps)
        assert pair.context("tier")["tier_draws_gbps"] == [float(f"{r.gbps:.4g}") for r in pair.subject_draws]
        assert pair.subject.nbytes == 4 * TINY_BLOCK_BYTES       # 4 tiny-preset blocks, all from the disk tier
        assert pair.fio.nbytes == 512 << 10                   # at least the same bytes: 2 jobs x one 256 KiB request
        assert pair.same_pattern.nbytes == 1 << 20            # the tier's pattern: whole 1 MiB requests
    # every load read its set from disk again (evicted above it, pages dropped): a reload, not a hit above
    assert moved == [4 * TINY_BLOCK_BYTES] * 2 * MIN_PAIRS
    assert stored.loads == 2 * MIN_PAIRS                      # the draws took the two sets in turn
    judged = paired_ratio(pairs, stopping)
    assert judged.valid and judged.value > 0 and judged.interval[0] <= judged.value <= judged.interval[1]
    assert judged.same_pattern_ratio > 0


@needs_fio
def test_a_round_of_several_prefixes_reads_them_all_from_the_disk_tier(server, client):
    admin = AdminClient(server.base_url)
    asked = []

    def request_for(i: int) -> WorkloadRequest:
        asked.append(i)
        return _four_block_request(f"several-{i}")

    tier = TierColdLoad(admin, client, request_for, prefixes=3, sets=2)
    readings = [tier(0), tier(1), tier(2)]
    assert asked == [0, 1, 2, 3, 4, 5]                        # two sets of three, stored once
    assert [r.nbytes for r in readings] == [3 * 4 * TINY_BLOCK_BYTES] * 3


# -- equal draws -------------------------------------------------------------------------------


def test_a_round_of_equal_draws_runs_the_subject_as_often_as_asked_and_counts_the_faster():
    speeds = iter([1.0, 3.0, 2.0, 0.5])
    best = lambda index, nbytes: Reading(nbytes, nbytes / 1e9)   # noqa: E731  (1 GB/s)
    pairs, _ = measure_pairs(lambda index: Reading(1e9, 1 / next(speeds)), best, Pairing(min=2, max=2, budget_s=60),
                             draws=2)
    assert [round(p.subject.gbps, 6) for p in pairs] == [3.0, 2.0]
    assert [[round(r.gbps, 6) for r in p.subject_draws] for p in pairs] == [[1.0, 3.0], [2.0, 0.5]]
    assert measure_pairs(lambda index: Reading(1e9, 1.0), best, Pairing(min=1, max=1))[0][0].subject_draws == ()
    with pytest.raises(ValueError, match="draws: expected an integer >= 1, found 0"):
        measure_pairs(lambda index: Reading(1, 1), best, Pairing(min=1, max=1), draws=0)


def _stalling(rng, stall_share: float = 0.25, stall: float = 0.4):
    """One run of a side on a storage that stalls now and then: 2 GB/s, or `stall` of it in `stall_share` of runs."""
    def run(index: int, nbytes: float = 1e9) -> Reading:
        gbps = 2.0 * (stall if rng.random() < stall_share else 1.0) * math.exp(rng.gauss(0, 0.05))
        return Reading(nbytes, nbytes / (gbps * 1e9))
    return run


def test_a_subject_as_fast_as_the_storage_comes_out_at_one_only_with_as_many_draws_as_the_yardstick():
    """A/A by simulation: the subject reads exactly as the storage does. Against the faster of two jobs a round, a
    subject run once is judged slower than the storage (it meets a stall the yardstick's second job skips): its
    interval excludes 1, a false decision. With two draws of its own, the interval holds 1."""
    import random

    rng = random.Random(7)
    yardstick = FasterOf({"direct": _stalling(rng), "buffered": _stalling(rng)})
    pairing = Pairing(min=400, max=400, budget_s=1e9)
    single = paired_ratio(measure_pairs(_stalling(rng), yardstick, pairing)[0])
    equal = paired_ratio(measure_pairs(_stalling(rng), yardstick, pairing, draws=2)[0])
    assert single.value < 0.9 and single.interval[1] < 1
    assert 0.95 < equal.value < 1.05 and equal.interval[0] < 1 < equal.interval[1]
