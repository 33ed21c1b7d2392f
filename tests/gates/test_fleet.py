"""A multi-node embedded run's defaults (gates/fleet.py) against hand arithmetic, and equal fleets (gates/targets.py).

The quick profile's G3 workload by hand (the byte tokenizer: one token per character; the chat
template adds <|bos|>, a role token and <|end|> per message, and <|assistant|> at the end; 256-token
blocks). Round 0 is bos + system (1 + 256 + 1) + user (1 + 1536 + 32 + 1) + assistant = 1,830 tokens:
7 whole blocks. Rounds 1-3 add (1 + 64 + 1) + (1 + 32 + 1) = 100 tokens each: 1,930, 2,030, 2,130
tokens, 7, 7 and 8 whole blocks, every round's blocks a prefix of the next round's. 16 output tokens
fill no further whole block ((2,130 + 15) // 256 = 8). Block 0 holds the bos, the system role and
254 of the system prompt's tokens, the same for every user; the other 7 blocks carry the user's
document. So a workload of U users has W = 1 + 7 × U distinct blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gates.config import load_config
from gates.fleet import fleet_sizing, fleet_users, working_set_blocks
from gates.targets import endpoints_from_json, endpoints_to_json, engine_settings, external_endpoints, fleet_plan
from kvcore.settings import ConfigError, parse_size

MIB = 2**20
FILE = 4096 + MIB          # a disk block file of the small preset: 4 KiB header + 1 MiB payload
QUICK_HOST = parse_size(load_config(None).targets.embedded.host_capacity)   # the quick profile's host tier


def _config(tmp_path, **sections):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump(sections))
    return load_config(path)


def _fleet(tmp_path, nodes: int, pool: str = "redis", **sections):
    embedded = {"candidate_nodes": nodes, "pool": pool, **sections.pop("embedded", {})}
    return _config(tmp_path, targets={"embedded": embedded}, **sections)


def test_the_working_set_of_the_quick_workload_is_one_shared_block_and_seven_per_user():
    workload = load_config(None).g3.workload
    assert workload.users == 16
    assert working_set_blocks(workload) == 1 + 7 * 16 == 113
    assert working_set_blocks(workload.model_copy(update={"users": 33})) == 1 + 7 * 33 == 232


@pytest.mark.parametrize("single, nodes, fleet", [(16, 2, 33), (16, 3, 49), (16, 4, 65), (5, 3, 16), (7, 2, 15)])
def test_fleet_users_are_the_first_count_from_nodes_times_users_that_shares_no_factor_with_the_nodes(
        single, nodes, fleet):
    # 32 = 2 × 16 is even: 33; 48 = 3 × 16 is a multiple of 3: 49; 64 is even: 65; 15 = 3 × 5: 16; 14: 15
    assert fleet_users(single, nodes) == fleet


def test_two_nodes_scale_the_users_and_levels_and_shrink_each_nodes_local_tiers_below_the_working_set(tmp_path):
    config = _fleet(tmp_path, 2)
    embedded = config.targets.embedded
    # U = 33, W = 1 + 7 × 33 = 232 blocks of 1 MiB, S = ⌈232 / 2⌉ = 116
    assert config.g3.workload.users == 33 and config.g3.levels == [4, 8, 16]
    assert parse_size(embedded.disk_capacity) == min(8192 * MIB, 116 * FILE) == 122_109_952
    # ⌈116 / 2⌉ = 58 blocks, or the quick profile's host tier (48 MiB: below G3's working set) when less
    assert parse_size(embedded.host_capacity) == min(QUICK_HOST, 58 * MIB) == 48 * MIB
    assert embedded.device_capacity_blocks == min(64, 29) == 29                             # ⌈116 / 4⌉
    assert parse_size(embedded.pool_capacity) == max(512 * MIB, 2 * 232 * MIB) == 512 * MIB
    sizing = fleet_sizing(config)
    assert (sizing.working_set_blocks, sizing.node_share_blocks) == (232, 116)
    assert (sizing.device_blocks, sizing.host_blocks, sizing.disk_blocks, sizing.pool_blocks) == (29, 48, 116, 512)
    assert sizing.device_blocks < sizing.host_blocks < sizing.disk_blocks < sizing.working_set_blocks


def test_three_nodes_grow_the_pool_past_its_default_when_twice_the_working_set_needs_it(tmp_path):
    config = _fleet(tmp_path, 3, pool="mooncake")
    embedded = config.targets.embedded
    # U = 49, W = 1 + 7 × 49 = 344, S = ⌈344 / 3⌉ = 115; pool 2 × 344 MiB = 688 MiB > 512 MiB
    assert config.g3.workload.users == 49 and config.g3.levels == [6, 12, 24]
    assert parse_size(embedded.disk_capacity) == 115 * FILE
    assert parse_size(embedded.host_capacity) == min(QUICK_HOST, 58 * MIB) and embedded.device_capacity_blocks == 29
    assert parse_size(embedded.pool_capacity) == 688 * MIB


def test_explicit_settings_win_and_the_rest_is_sized_from_the_users_own_workload(tmp_path):
    workload = {**load_config(None).g3.workload.model_dump(exclude_none=True), "users": 5}
    config = _fleet(tmp_path, 2, embedded={"host_capacity": "2GiB", "pool_capacity": "256MiB"},
                    g3={"workload": workload, "levels": [2, 4]})
    embedded = config.targets.embedded
    assert config.g3.workload.model_dump(exclude_none=True) == workload and config.g3.levels == [2, 4]  # untouched
    assert embedded.host_capacity == "2GiB" and embedded.pool_capacity == "256MiB"
    # W = 1 + 7 × 5 = 36, S = 18: the disk not set in the file holds 18 blocks, the device ⌈18 / 4⌉ = 5
    assert embedded.device_capacity_blocks == min(64, 5) == 5
    assert parse_size(embedded.disk_capacity) == 18 * FILE


def test_one_node_or_an_external_target_keeps_the_profiles_defaults(tmp_path):
    single = _fleet(tmp_path, 1)
    assert single.g3.workload.users == 16 and single.g3.levels == [2, 4, 8]
    assert single.targets.embedded.host_capacity == "48MiB" and single.targets.embedded.disk_capacity == "8GiB"
    assert fleet_sizing(single) is None
    external = _config(tmp_path, targets={"kind": "external", "candidate_nodes": ["http://127.0.0.1:9/v1"],
                                          "baseline": {"url": "http://127.0.0.1:8/v1", "model": "m"},
                                          "candidate": {"url": "http://127.0.0.1:7/v1", "model": "m"}})
    assert external.g3.workload.users == 16 and fleet_sizing(external) is None


def test_a_workload_without_a_whole_block_keeps_the_tiers_and_a_bad_one_is_named_under_g3(tmp_path):
    short = {**load_config(None).g3.workload.model_dump(exclude_none=True), "system_prompt_tokens": 0,
             "document_tokens": 100, "rounds": 1}
    config = _fleet(tmp_path, 2, g3={"workload": short})   # 1 + 1 + 100 + 32 + 1 + 1 = 136 tokens: no whole block
    assert working_set_blocks(short) == 0 and config.g3.levels == [4, 8, 16]
    assert config.targets.embedded.device_capacity_blocks == 64 and config.targets.embedded.host_capacity == "48MiB"
    trace = tmp_path / "trace.jsonl"                        # fewer requests than its warm-up
    trace.write_text("".join(f'{{"timestamp": {i}, "input_length": 600, "output_length": 4, "hash_ids": [{i}]}}\n'
                             for i in range(3)))
    with pytest.raises(ConfigError, match=r"^g3\.workload\.warmup_requests: expected fewer"):
        _fleet(tmp_path, 2, g3={"workload": {"kind": "trace", "path": str(trace), "warmup_requests": 5}})


def test_the_resolved_config_a_run_stores_reloads_to_the_same_fleet(tmp_path):
    config = _fleet(tmp_path, 2)
    stored = tmp_path / "config.yaml"        # what `kvgate run` writes and its gate suites (and --resume) load
    stored.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    again = load_config(stored)
    assert again.g3.workload.users == 33 and again.g3.levels == [4, 8, 16]       # not scaled twice
    assert again.targets.embedded == config.targets.embedded


def test_the_baseline_fleet_is_the_candidates_node_count_on_one_engine_setting_without_the_pool(tmp_path):
    config = _fleet(tmp_path, 3)
    embedded = config.targets.embedded
    plan = fleet_plan(config)
    by_role = {role: [n for n in plan if n.role == role] for role in ("recompute", "baseline", "candidate")}
    assert [len(by_role[r]) for r in ("recompute", "baseline", "candidate")] == [1, 3, 3]
    assert [n.name for n in by_role["baseline"]] == ["device-only-0", "device-only-1", "device-only-2"]
    assert [n.pooled for n in plan] == [False, False, False, False, True, True, True]
    settings = engine_settings(embedded)["cache"]       # the one file every node reads: the device tier per node
    assert settings["device_capacity_blocks"] == 29 and settings["host_capacity_bytes"] == embedded.host_capacity
    storage = Path(config.storage.path).resolve()       # each node's disk directory is decided once, in the plan
    assert [n.cache_dir for n in by_role["candidate"]] == [storage / f"kv-tiered-{i}" for i in range(3)]
    assert len({n.cache_dir for n in plan}) == len(plan) and "path" not in settings["disk"]
    assert [n.name for n in fleet_plan(_fleet(tmp_path, 1, pool="none"))] == \
        ["recompute", "device-only", "tiered"]


def test_an_external_targets_endpoint_is_made_once_from_its_settings_and_survives_the_trip_to_the_suites(tmp_path):
    settings = {"url": "http://127.0.0.1:9/v1/", "model": "m", "api": "completions", "cache_dir": "kv",
                "tokenizer": "kvgate-byte-v1"}
    config = _config(tmp_path, targets={"kind": "external", "candidate": settings,
                                        "baseline": {**settings, "cache_dir": None},
                                        "candidate_nodes": ["http://127.0.0.1:10/v1"]})
    endpoints = external_endpoints(config)
    candidate = endpoints["candidate"]
    assert (candidate.url, candidate.api, candidate.tokenizer, candidate.admin) == \
        ("http://127.0.0.1:9/v1", "completions", "kvgate-byte-v1", False)
    assert candidate.cache_dir == str(config.targets.candidate.cache_dir) and Path(candidate.cache_dir).is_absolute()
    assert candidate.nodes == ("http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1") and endpoints["baseline"].nodes == ()
    assert endpoints["baseline"].cache_dir is None and "recompute" not in endpoints
    assert endpoints_from_json(json.loads(json.dumps(endpoints_to_json(endpoints)))) == endpoints
