"""G3's priming spares a target the primer's first requests its caches would not keep (sizing.g3_inputs.primer_spared):
in the simulation every measured request then meets the same hits, and a real device-only kvgate server ends its
priming holding the same blocks, whatever it held before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gates.config import load_config
from kvcore.g3_analysis import run_seed
from sizing.g3_inputs import primer_spared
from sizing.replay import CacheSimulator, replay
from sizing.sequences import embedded_chat_tokens, requests_block_keys
from sizing.targets import target_inputs
from tests.servers import ADMIN_TOKEN, started_server
from workloads.loadgen.sweep import SweepSettings, describe_replay, prime_targets, primer
from workloads.probes.faults import AdminClient
from workloads.traffic.client import StreamingClient
from workloads.traffic.datasets import build_workload, sizer_for
from workloads.traffic.requests import WorkloadRequest, load_order
from workloads.traffic.target import Target


def _quick():
    """The quick profile's config and G3 workload, as a run builds it."""
    config = load_config(profile="quick")
    workload = build_workload(config.g3.workload, sizer_for("kvgate-byte-v1"), seed=run_seed("spared"))
    return config, workload


def test_the_baseline_is_spared_what_its_device_tier_would_not_keep_and_every_hit_stays_the_same():
    config, workload = _quick()
    inputs = target_inputs(config)[0]
    spared = primer_spared(config.g3, workload, inputs)
    primed = requests_block_keys(load_order(primer(workload)), embedded_chat_tokens, block_tokens=inputs.block_tokens)
    # the candidate's disk keeps every turn: it is sent them all; the baseline's 64-block device tier a few prompts
    assert spared["candidate"] == 0 and 0 < spared["baseline"] < len(primed) - 1
    measured = requests_block_keys(load_order(workload), embedded_chat_tokens, block_tokens=inputs.block_tokens)
    capacities = inputs.capacities()["baseline"]
    after_all = replay(primed + measured, capacities, warmup=len(primed))
    after_tail = replay(primed[spared["baseline"]:] + measured, capacities, warmup=len(primed) - spared["baseline"])
    assert after_tail.hits == after_all.hits and sum(map(sum, after_all.hits)) > 0
    # the shortest such tail: one request fewer and the device tier ends holding other blocks
    ends = []
    for tail in (primed, primed[spared["baseline"]:], primed[spared["baseline"] + 1:]):
        cache = CacheSimulator(capacities)
        for request in tail:
            cache.serve(request)
        ends.append(cache.state())
    assert ends[0] == ends[1] != ends[2]


@pytest.mark.parametrize("change", ["external", "unprimed", "fleet"])
def test_nothing_is_spared_where_the_simulation_is_not_the_targets_own(change):
    config, workload = _quick()
    inputs = target_inputs(config)[0]
    g3 = config.g3
    if change == "external":
        inputs = replace(inputs, embedded=False)
    elif change == "unprimed":
        g3 = g3.model_copy(update={"prime": False})
    else:
        inputs = replace(inputs, baseline_nodes=2, candidate_nodes=2)
    assert primer_spared(g3, workload, inputs) == {"candidate": 0, "baseline": 0}


@pytest.fixture(scope="module")
def device_only(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("device-only"), mode="device-only", admin=True)


def _held(admin: AdminClient, requests: list[WorkloadRequest]) -> set[str]:
    """The prompt blocks of `requests` the server's device tier holds."""
    return {block["key"] for request in requests for block in admin.locate(messages=list(request.messages))
            if "device" in block["tiers"]}


def test_a_device_only_server_primed_with_the_tail_holds_what_the_whole_primer_leaves(device_only, tmp_path):
    """The real cache: primed whole, then filled with other prompts, then primed with the tail alone: its device
    tier holds the same blocks of the primer's prompts, and nothing of the prompts in between."""
    config, workload = _quick()
    spared = primer_spared(config.g3, workload, target_inputs(config)[0])["baseline"]
    target = Target("baseline", f"{device_only.base_url}/v1", "kvgate-tiny")
    admin = AdminClient(device_only.base_url, token=ADMIN_TOKEN)
    turns = list(load_order(primer(workload)))
    whole = prime_targets([target], workload, users=1, out_dir=tmp_path / "whole")
    after_whole = _held(admin, turns)
    others = [WorkloadRequest(f"other-{i}", f"other-{i}", 0,
                              ({"role": "user", "content": f"unrelated {i} " + "filler words " * 300},), 4, 3_600)
              for i in range(8)]
    client = StreamingClient(target.url, target.model, target="other")
    assert all(client.send(request).ok for request in others)
    client.close()
    assert _held(admin, others) and _held(admin, turns) != after_whole     # the other prompts took room
    tail = prime_targets([target], workload, users=1, out_dir=tmp_path / "tail", spared={"baseline": spared})
    assert whole[0]["requests"] == len(turns) and whole[0]["spared"] == 0
    assert (tail[0]["requests"], tail[0]["expected"], tail[0]["spared"], tail[0]["errors"]) == (
        len(turns) - spared, len(turns) - spared, spared, 0)
    assert 0 < len(after_whole) < len({b["key"] for r in turns for b in admin.locate(messages=list(r.messages))})
    assert _held(admin, turns) == after_whole and not _held(admin, others)
    said = describe_replay(workload, SweepSettings(levels=(2,)), True, tail)
    assert f"(baseline: the last {len(turns) - spared} of {len(turns)} turns, as its caches hold no more" in said
