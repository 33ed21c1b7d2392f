"""The replay of block keys through tier capacities gives the real `TieredKVCache`'s hits, tier by tier.

The real cache is driven as the embedded engine drives it (load_into the longest cached prefix,
store the missing prompt blocks, promote the hits after the first token, store the blocks the
output fills), one request after another, its background writes flushed before the next.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from cache_impl.cache import integrity, lru, placement
from cache_impl.cache.config import CacheConfig
from cache_impl.cache.keys import block_keys
from cache_impl.cache.metrics import TierMetrics
from cache_impl.engine.tokenizer import ASSISTANT, BOS, END, SYSTEM, USER
from gates.config import profile_defaults
from kvcore.settings import ConfigError
from sizing.replay import CacheSimulator, KeysOnlyTier, RequestKeys, TierCapacity, replay, tier_capacities
from sizing.sequences import (
    SIZING_DIGEST,
    embedded_chat_tokens,
    embedded_completion_tokens,
    load_order,
    trace_block_keys,
    workload_block_keys,
)
from tests.blocks import BLOCK
from tests.cache_requests import conversations, request_keys, serve_request
from workloads.traffic.datasets import ByteSizer, TraceRecord, build_workload, read_trace

MOONCAKE_TRACE = Path("/work/shared/data/mooncake-traces/conversation_trace.jsonl")
MIB, GIB = 2**20, 2**30


# --------------------------------------------------------------------------- against the real cache


@pytest.mark.parametrize("write_policy, device, host, demoting", [
    ("write-back", 6, 14, ("device", "host")),   # an evicted block goes down, tier by tier
    ("write-through", 6, 14, ()),                # the host already holds what the device evicts
    ("write-through", 10, 5, ("device",)),       # a smaller host lost some of it: demoted there again
])
def test_the_replay_gives_the_real_caches_hits_per_tier_request_by_request(make_cache, layout, write_policy,
                                                                            device, host, demoting):
    file_nbytes = integrity.file_nbytes(layout.block_nbytes)
    cache = make_cache(write_policy=write_policy, device_capacity_blocks=device,
                       host_capacity_bytes=host * layout.block_nbytes, disk_capacity_bytes=64 * file_nbytes,
                       disk_min_free_bytes=0)
    requests = conversations(400, seed=11)
    sources = [serve_request(cache, layout, prompt, generated) for prompt, generated in requests]

    capacities = [TierCapacity("device", device), TierCapacity("host", host), TierCapacity("disk", 64)]
    assert capacities == tier_capacities(cache.config, layout.block_nbytes)
    result = replay([request_keys(cache, p, g) for p, g in requests], capacities, write_policy)

    assert result.tiers == tuple(cache.tiers) == ("device", "host", "disk")
    for n, (row, real) in enumerate(zip(result.hits, sources)):
        assert row == tuple(real.count(name) for name in result.tiers), f"request {n}"
    snap = cache.snapshot()["tiers"]
    assert result.total_hits == {name: snap[name]["hits"] for name in result.tiers}
    assert result.evictions == {name: snap[name]["evictions"] for name in result.tiers}
    assert result.demotions == {name: snap[name]["demotions"] for name in result.tiers}
    # enough pressure that every rule ran: hits from every tier, evictions everywhere, demotions
    assert all(hits > 0 for hits in result.total_hits.values()), result.total_hits
    assert all(n > 0 for n in result.evictions.values()), result.evictions
    assert tuple(name for name, n in result.demotions.items() if n > 0) == demoting, result.demotions
    assert 0 < result.overall_hit_ratio < result.infinite_cache_bound < 1


@pytest.mark.parametrize("write_policy, device, host", [("write-back", 6, 14), ("write-through", 10, 5)])
def test_the_simulator_copies_as_many_blocks_into_each_tier_as_the_real_cache(make_cache, layout, write_policy,
                                                                            device, host):
    """What the engine's thread copies (stores, promotes after hits, demotions) is what G3's simulation charges
    it for: the simulator's blocks written per tier are the real cache's, every store, promote and demotion."""
    file_nbytes = integrity.file_nbytes(layout.block_nbytes)
    cache = make_cache(write_policy=write_policy, device_capacity_blocks=device,
                       host_capacity_bytes=host * layout.block_nbytes, disk_capacity_bytes=64 * file_nbytes,
                       disk_min_free_bytes=0)
    simulator = CacheSimulator(tier_capacities(cache.config, layout.block_nbytes), write_policy)
    for prompt, generated in conversations(400, seed=11):
        serve_request(cache, layout, prompt, generated)
        simulator.serve(request_keys(cache, prompt, generated))

    written = {name: cache.snapshot()["tiers"][name]["blocks_written"] for name in simulator.names}
    assert {level.name: level.metrics.counters["blocks_written"] for level in simulator.levels} == written
    assert simulator.blocks_written == sum(written.values())
    # promotes and demotions ran: more blocks written than the requests' stores alone put on the device
    assert cache.snapshot()["tiers"]["host"]["hits"] > 0 and all(n > 0 for n in written.values()), written


def test_a_pool_below_the_disk_serves_what_the_local_tiers_lost(make_cache, layout, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it; see the README)")
    from workloads.servers.stores import RedisServer

    with RedisServer(tmp_path / "redis") as pool:
        cache = make_cache(device_capacity_blocks=4, host_capacity_bytes=6 * layout.block_nbytes,
                           disk_capacity_bytes=64 * integrity.file_nbytes(layout.block_nbytes), disk_min_free_bytes=0,
                           remote={"backend": "redis", "url": pool.url})
        requests = conversations(400, seed=5)
        sources = [serve_request(cache, layout, prompt, generated) for prompt, generated in requests]
        capacities = tier_capacities(cache.config, layout.block_nbytes)
        result = replay([request_keys(cache, p, g) for p, g in requests], capacities, "write-through")
        snap = cache.snapshot()["tiers"]
    assert result.tiers == tuple(cache.tiers) == ("device", "host", "disk", "remote")
    for n, (row, real) in enumerate(zip(result.hits, sources)):
        assert row == tuple(real.count(name) for name in result.tiers), f"request {n}"
    assert result.total_hits == {name: snap[name]["hits"] for name in result.tiers}
    assert result.total_hits["remote"] > 0
    # an unbounded pool holds every block stored: the cache hits all it has seen
    assert result.overall_hit_ratio == pytest.approx(result.infinite_cache_bound)


def test_the_replays_placement_is_the_caches_own():
    # no mirror: the replay decides with cache_impl's Placement and LRUAccount objects, over keys-only tiers
    sim = CacheSimulator(
        [TierCapacity("device", 2), TierCapacity("host", 3), TierCapacity("remote", 4, accounted=False)]
    )
    assert type(sim.placement) is placement.Placement
    assert all(type(level) is placement.Level for level in sim.levels)
    assert [type(level.lru) for level in sim.levels] == [lru.LRUAccount, lru.LRUAccount, type(None)]
    assert [level.lru.capacity_bytes for level in sim.levels[:2]] == [2, 3]     # one block = one unit
    assert all(type(level.tier) is KeysOnlyTier for level in sim.levels)
    sim.store(["a", "b", "c"])
    assert sim.placement.where("a") == ["host"] and sim.placement.where("c") == ["device", "host"]
    assert list(sim.levels[0].lru) == ["b", "c"] and sim.levels[0].metrics.counters["evictions"] == 1


def test_a_keys_only_pool_keeps_its_own_capacity_least_recently_put_or_read_first():
    metrics = TierMetrics()
    pool = KeysOnlyTier("remote", accounted=False, blocks=2, metrics=metrics)
    assert pool.shared and pool.put("a") and pool.put("b")
    pool.read("a")                                   # a read refreshes; a lookup does not
    assert pool.contains(["b", "x"]) == [True, False]
    assert pool.put("c") and pool.contains(["a", "b", "c"]) == [True, False, True]
    assert pool.put("a") and metrics.counters["evictions"] == 1     # a put of a held key only refreshes it
    assert not KeysOnlyTier("remote", accounted=False, blocks=0).put("a")


# --------------------------------------------------------------------------- the simulator's own figures


def _random_requests(seed: int, n: int = 300) -> list[RequestKeys]:
    return [RequestKeys(tuple(block_keys(p, SIZING_DIGEST, BLOCK)), ()) for p, _ in conversations(n, seed)]


def test_a_hand_worked_write_back_sequence():
    # device, host and disk of one block each; write-back stores a new block on the device only
    sim = CacheSimulator(_one_block_each(), "write-back")
    sim.store(["a"])
    sim.store(["b"])                            # a is demoted to the host
    sim.store(["c"])                            # b to the host, a from there to the disk
    assert [sim.holders(k) for k in "abc"] == [["disk"], ["host"], ["device"]]
    assert sim.load(["a", "x"]) == [0, 0, 1]     # a from the disk; the prefix ends at x
    sim.store(["x"])                            # c -> host, b -> disk, the disk's a leaves the cache
    assert [sim.holders(k) for k in "abcx"] == [[], ["disk"], ["host"], ["device"]]
    sim.promote(["a"])                          # a onto the device: x -> host, c -> disk, b leaves
    assert [sim.holders(k) for k in "abcx"] == [["device"], [], ["disk"], ["host"]]
    assert sim.load(["b"]) == [0, 0, 0]          # gone
    # the same requests replayed as the engine makes them: load, store the rest, promote the hits
    result = replay([["a"], ["b"], ["c"], ["a", "x"], ["c"], ["x"], ["c"]], _one_block_each(), "write-back")
    # [c]: from the disk; its promotion demotes a to the host and x to the disk (evicting c's copy there)
    # [x]: from the disk; promoted: c -> host, a -> disk.  [c]: from the host
    assert result.hits == ((0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 1), (0, 0, 1), (0, 0, 1), (0, 1, 0))
    assert result.prompt_blocks == (1, 1, 1, 2, 1, 1, 1)
    assert result.total_hits == {"device": 0, "host": 1, "disk": 3}
    assert result.hit_ratio == {"device": 0, "host": 1 / 8, "disk": 3 / 8}
    assert result.infinite_cache_bound == 4 / 8       # a, c, x and c had all been stored before
    assert result.evictions == {"device": 7, "host": 6, "disk": 5}    # every promotion moves the whole chain down
    assert result.demotions == {"device": 7, "host": 6, "disk": 0}


def _one_block_each() -> list[TierCapacity]:
    return [TierCapacity("device", 1), TierCapacity("host", 1), TierCapacity("disk", 1)]


def test_write_through_puts_a_new_block_on_every_tier_and_a_hit_is_read_from_the_highest():
    sim = CacheSimulator([TierCapacity("device", 2), TierCapacity("host", 3), TierCapacity("disk", 5)])
    assert sim.store(["a", "b", "c"]) == 3
    assert sim.holders("a") == ["host", "disk"] and sim.holders("c") == ["device", "host", "disk"]
    assert sim.load(["b", "a", "z"]) == [1, 1, 0]     # b from the device, a from the host, z: the prefix ends
    assert sim.promote(["a"]) == 1 and sim.holders("a") == ["device", "host", "disk"]
    assert sim.holders("b") == ["device", "host", "disk"] and sim.holders("c") == ["host", "disk"]


def test_an_unbounded_cache_hits_exactly_the_infinite_bound():
    requests = _random_requests(3)
    result = replay(requests, [TierCapacity("device", None)])
    assert result.total_hits["device"] == sum(result.seen_blocks) > 0
    assert result.overall_hit_ratio == result.infinite_cache_bound


@pytest.mark.parametrize("write_policy", ["write-through", "write-back"])
def test_the_infinite_bound_is_at_least_any_capacitys_hit_ratio(write_policy):
    requests = _random_requests(4)
    rng = random.Random(1)
    bounds = set()
    for _ in range(20):
        capacities = [TierCapacity("device", rng.randint(0, 20)), TierCapacity("host", rng.randint(0, 40)),
                      TierCapacity("disk", rng.randint(0, 200))]
        result = replay(requests, capacities, write_policy)
        bounds.add(result.infinite_cache_bound)
        assert sum(result.total_hits.values()) <= sum(result.seen_blocks)
        assert result.overall_hit_ratio <= result.infinite_cache_bound
        assert result.overall_hit_ratio == pytest.approx(sum(result.hit_ratio.values()))
    assert len(bounds) == 1  # the bound does not depend on the capacities


def test_no_capacity_anywhere_means_no_hits():
    requests = _random_requests(5)
    result = replay(requests, [TierCapacity("device", 0), TierCapacity("host", 0), TierCapacity("disk", 0)])
    assert result.total_hits == {"device": 0, "host": 0, "disk": 0} and result.overall_hit_ratio == 0
    assert result.evictions == {"device": 0, "host": 0, "disk": 0}
    assert result.infinite_cache_bound > 0


def test_a_block_the_device_cannot_take_goes_below_at_once_whatever_the_policy():
    result = replay([["a"], ["a"]], [TierCapacity("device", 0), TierCapacity("host", 1)], "write-back")
    assert result.total_hits == {"device": 0, "host": 1}


def test_warm_up_requests_fill_the_cache_but_are_not_counted():
    result = replay([["a", "b"], ["a", "b", "c"]], [TierCapacity("device", 8)], warmup=1)
    assert result.requests == 1 and result.prompt_blocks == (3,) and result.hits == ((2,),)
    assert result.infinite_cache_bound == pytest.approx(2 / 3)


@pytest.mark.parametrize("capacities, write_policy, message", [
    ([TierCapacity("device", 4)], "write-around", "write_policy: expected one of write-through, write-back"),
    ([], "write-back", "tiers: expected at least one tier"),
    ([TierCapacity("device", 4), TierCapacity("device", 4)], "write-back", "tiers: expected distinct names"),
    ([TierCapacity("remote", None, accounted=False), TierCapacity("device", 4)], "write-back",
     "tiers.remote.accounted: expected the top tier"),
    ([TierCapacity("device", 4), TierCapacity("remote", None, accounted=False), TierCapacity("disk", 4)],
     "write-back", "tiers.remote.accounted: expected only the last tier"),
])
def test_bad_levels_are_config_errors_naming_the_field(capacities, write_policy, message):
    with pytest.raises(ConfigError, match=message):
        replay([["a"]], capacities, write_policy)


def test_a_negative_capacity_names_the_tier():
    with pytest.raises(ConfigError, match=r"^tiers.host.blocks: expected an integer >= 0 or None \(unbounded\), "
                                          r"found -1"):
        TierCapacity("host", -1)


def test_tier_capacities_mirror_the_caches_levels():
    # the embedded defaults for the small preset (1 MiB blocks): device 64 slots, host 1 GiB, disk 8 GiB
    config = CacheConfig.from_dict({"device_capacity_blocks": 64, "host_capacity_bytes": "1GiB",
                                    "disk": {"path": "unused", "capacity_bytes": "8GiB"}})
    assert tier_capacities(config, MIB) == [
        TierCapacity("device", 64), TierCapacity("host", 1024),
        TierCapacity("disk", 8 * GIB // (4096 + MIB))]          # a block file: 4 KiB header + the payload
    assert 8 * GIB // (4096 + MIB) == 8160
    small_host = config.replace(host_capacity_bytes=MIB - 1, disk=None)
    assert tier_capacities(small_host, MIB) == [TierCapacity("device", 64)]   # no host tier below one block


# --------------------------------------------------------------------------- key sequences


def test_workload_keys_are_the_embedded_engines_block_keys():
    spec = profile_defaults("quick")["g3"]["workload"]          # 16 users x 4 rounds, system 256, document 1536, ...
    keyed = workload_block_keys(spec)
    workload = build_workload(spec, ByteSizer(), 0)
    order = load_order(workload)
    assert len(keyed) == len(order) == 64
    first = order[0]
    system, user = (m["content"] for m in first.messages)
    # the chat template: BOS, then <|role|> content <|end|> per message, then <|assistant|>
    tokens = [BOS, SYSTEM, *system.encode(), END, USER, *user.encode(), END, ASSISTANT]
    assert len(tokens) == 1 + (1 + 256 + 1) + (1 + 1536 + 32 + 1) + 1 == 1830
    assert keyed[0].prompt == tuple(block_keys(tokens, SIZING_DIGEST, 256)) and len(keyed[0].prompt) == 7
    assert embedded_chat_tokens(first) == tokens
    assert embedded_completion_tokens(first) == [BOS, *f"{system}\n\n{user}".encode()]   # the completions route
    # 16 output tokens: (1830 + 15) // 256 - 1830 // 256 = 7 - 7, no block filled by the output
    assert keyed[0].output == ()
    # every user's prompt opens with the same system prompt: block 0 is shared, block 1 is not
    assert keyed[1].prompt[0] == keyed[0].prompt[0] and keyed[1].prompt[1] != keyed[0].prompt[1]
    # round 1 of user 0 (the 17th request) continues round 0's prompt: its first 7 blocks are round 0's
    assert order[16].request_id == "user-0/round-1"
    assert keyed[16].prompt[:7] == keyed[0].prompt


def test_output_blocks_are_the_ones_generated_tokens_fill():
    spec = {"kind": "shared_prefix", "groups": 1, "prompts_per_group": 2, "prefix_tokens": 500,
            "suffix_tokens": 8, "output_tokens": 300}
    keyed = workload_block_keys(spec)
    # prompt: BOS USER 508 END ASSISTANT = 512 tokens, 2 blocks; + 299 computed outputs = 811 -> 3 blocks
    assert [len(k.prompt) for k in keyed] == [2, 2] and [len(k.output) for k in keyed] == [1, 1]
    assert keyed[0].output != keyed[1].output                                  # different prompts
    again = workload_block_keys(spec, passes=2)
    assert again[2] == keyed[0] and len(again) == 4                            # the same prompt: the same output
    assert all(k.output == () for k in workload_block_keys(spec, outputs=False))


def test_bad_key_sequence_settings_are_config_errors():
    with pytest.raises(ConfigError, match="^passes: expected an integer >= 1, found 0"):
        workload_block_keys({"kind": "random", "requests": 1, "input_tokens": {"distribution": "fixed", "mean": 8},
                             "output_tokens": {"distribution": "fixed", "mean": 1}}, passes=0)
    with pytest.raises(ConfigError, match="^block_tokens: expected an integer >= 1, found 0"):
        trace_block_keys([], 0)


def test_load_order_takes_turns_round_robin_when_interleaved():
    spec = {"kind": "multi_round_qa", "users": 3, "rounds": 2, "document_tokens": 4, "question_tokens": 2,
            "answer_tokens": 2}
    workload = build_workload(spec, ByteSizer(), 0)
    assert [r.request_id for r in load_order(workload, passes=2)] == [
        "user-0/round-0", "user-1/round-0", "user-2/round-0", "user-0/round-1", "user-1/round-1", "user-2/round-1",
    ] * 2
    sequential = build_workload({**spec, "order": "sequential"}, ByteSizer(), 0)
    assert [r.request_id for r in load_order(sequential)] == [
        "user-0/round-0", "user-0/round-1", "user-1/round-0", "user-1/round-1", "user-2/round-0", "user-2/round-1"]


def test_a_trace_workload_sends_its_warm_up_first_and_reuses_its_blocks_through_the_chat_template(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
            {"timestamp": 5, "input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 2]},
            {"timestamp": 9, "input_length": 1024, "output_length": 4, "hash_ids": [0, 3]}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workload = build_workload({"kind": "trace", "path": str(trace), "warmup_requests": 1}, ByteSizer(), 0)
    assert [r.request_id for r in load_order(workload)] == ["trace-0", "trace-1", "trace-2"]
    keyed = workload_block_keys(workload)
    # BOS <|user|> text <|end|> <|assistant|>: (2 + 1024 + 2) // 256 and (2 + 1536 + 2) // 256 blocks
    assert [len(k.prompt) for k in keyed] == [4, 6, 4]
    result = replay(keyed, [TierCapacity("device", 64)], warmup=len(workload.warmup))
    # trace-1 shares trace-0's first 2 + 1024 tokens (4 whole blocks), trace-2 its first 2 + 512 (2 blocks)
    assert result.hits == ((4,), (2,))


def test_trace_keys_cut_hash_ids_into_cache_blocks():
    records = [TraceRecord(0, 1300, 10, (0, 1, 2)), TraceRecord(1, 1100, 300, (0, 1, 3)),
               TraceRecord(2, 1500, 1, (7,))]
    keyed = trace_block_keys(records, 256)
    # 1300 tokens: 5 whole blocks of 256, ending at 256, 512 (id 0), 768, 1024 (id 1), 1280 (id 2)
    assert keyed[0].prompt == ((0, 256), (0, 512), (1, 256), (1, 512), (2, 256))
    assert keyed[1].prompt == ((0, 256), (0, 512), (1, 256), (1, 512))     # 1100 tokens: 4 blocks, all shared
    assert keyed[2].prompt[:2] == ((7, 256), (7, 512)) and keyed[2].prompt[2] == ("own", 2, 768)  # past the ids
    assert len(keyed[2].prompt) == 5
    # outputs: (1300 + 9) // 256 - 5 = 0; (1100 + 299) // 256 - 4 = 1
    assert [len(k.output) for k in keyed] == [0, 1, 0]
    whole = trace_block_keys(records)                                         # one block per hash id
    assert whole[0].prompt == ((0, 512), (1, 512)) and whole[1].prompt == ((0, 512), (1, 512))
    result = replay(keyed, [TierCapacity("device", 100)])
    assert result.hits[1] == (4,) and result.infinite_cache_bound == pytest.approx(4 / 14)


def test_the_mooncake_trace_replays_with_its_reuse():
    if not MOONCAKE_TRACE.is_file():
        pytest.skip(f"the Mooncake conversation trace is not at {MOONCAKE_TRACE} (it is not part of the repository)")
    records = read_trace(MOONCAKE_TRACE)
    # the keys rely on Mooncake's hash ids naming whole prefixes: an id always follows the same id
    parent: dict[int, int] = {}
    for record in records:
        for before, after in zip((None, *record.hash_ids), record.hash_ids):
            assert parent.setdefault(after, before) == before, f"hash id {after} follows {before} and {parent[after]}"
    keyed = trace_block_keys(records, 256)
    embedded = [TierCapacity("device", 64), TierCapacity("host", 1024), TierCapacity("disk", 8160)]
    result = replay(keyed, embedded)
    device_only = replay(keyed, embedded[:1])
    assert result.total_prompt_blocks == sum(r.input_length // 256 for r in records)
    assert device_only.overall_hit_ratio < result.overall_hit_ratio <= result.infinite_cache_bound
    assert all(result.total_hits[name] > 0 for name in result.tiers)


def test_the_replay_gives_the_embedded_engines_hits_on_a_workload(tmp_path):
    """The whole chain: workload -> the engine's chat tokens -> block keys -> replay, against the engine itself."""
    from cache_impl.cache.keys import KVLayout
    from cache_impl.engine.engine import Engine, EngineConfig

    block = 256
    nbytes = KVLayout(2, 2, 16, "float32", block).block_nbytes                # the tiny preset: 128 KiB a block
    config = EngineConfig.from_dict({"preset": "tiny", "mode": "tiered", "cache": {
        "device": "cpu", "write_policy": "write-back", "device_capacity_blocks": 3, "host_capacity_bytes": 5 * nbytes,
        "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": 20 * integrity.file_nbytes(nbytes),
                 "min_free_bytes": 0}}})
    spec = {"kind": "multi_round_qa", "users": 6, "rounds": 3, "system_prompt_tokens": 300, "document_tokens": 600,
            "question_tokens": 40, "answer_tokens": 100, "output_tokens": 64}
    order = load_order(build_workload(spec, ByteSizer(), 0), passes=2)
    engine = Engine(config).start()
    try:
        assert engine.layout.block_nbytes == nbytes
        finished, keyed = [], []
        for request in order:
            tokens = embedded_chat_tokens(request)
            done = engine.generate(tokens, request.max_tokens)
            engine.cache.flush()
            finished.append(done.finish)
            # the engine stores the full blocks of the positions it computed: the last token's KV is
            # computed only when generation stopped on the end-of-text token
            computed = len(tokens) + len(done.token_ids) - (done.finish.finish_reason == "length")
            every = block_keys(tokens + done.token_ids, SIZING_DIGEST, block)
            full_prompt = len(tokens) // block
            keyed.append(RequestKeys(tuple(every[:full_prompt]), tuple(every[full_prompt: computed // block])))
        snap = engine.cache.snapshot()["tiers"]
    finally:
        engine.stop()
    result = replay(keyed, tier_capacities(config.cache, nbytes), "write-back")
    assert [f.cached_tokens for f in finished] == [block * sum(row) for row in result.hits]
    assert result.total_hits == {name: snap[name]["hits"] for name in result.tiers}
    assert result.evictions == {name: snap[name]["evictions"] for name in result.tiers}
    assert result.demotions == {name: snap[name]["demotions"] for name in result.tiers}
    assert all(result.total_hits[name] > 0 for name in result.tiers), result.total_hits
    assert all(result.evictions[name] > 0 for name in result.tiers), result.evictions
    assert sum(len(k.output) for k in keyed) > 0
    # every request ran to max_tokens (the seeded model), so the keys made from the spec alone (the
    # output's blocks counted from max_tokens) replay to the same figures
    assert {f.finish_reason for f in finished} == {"length"}
    from_spec = replay(workload_block_keys(spec, passes=2), tier_capacities(config.cache, nbytes), "write-back")
    assert from_spec == result
