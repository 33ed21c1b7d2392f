"""Which tier served a fleet's hits, from the real per-tier counters of two `kvgate serve` nodes on one redis pool.

A prefix node A stored (and flushed to the pool) is served on node B by the pool: counted under
tier `remote`, summed over the nodes, per step of a real sweep, and shown in the step's line.
"""

from __future__ import annotations

import shutil

import pytest

from tests.servers import ServerProcess, ask, distinct_prompt, started_pool_nodes
from workloads.loadgen.blocks import run_sweep
from workloads.loadgen.sweep import SweepSettings
from workloads.probes.faults import AdminClient
from workloads.probes.tier_hits import read_tier_hits, target_tier_hits, tier_difference, tier_line, tier_shares
from workloads.servers.stores import RedisServer
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target

BLOCKS = 5   # distinct_prompt's 1,400 characters: 5 whole 256-token blocks


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (.ci/run installs it; see the README)")
    with RedisServer(tmp_path_factory.mktemp("pool")) as pool:
        yield from started_pool_nodes([tmp_path_factory.mktemp(f"node-{name}") for name in ("a", "b")], pool.url)


def _stored_on(node, prompt: str) -> None:
    first = ask(node, prompt)
    assert first["cached"] == 0                   # a fresh prompt: computed, then stored
    AdminClient(node.base_url).flush()            # its pool puts are done


def test_a_prefix_node_a_stored_counts_as_a_pool_hit_when_node_b_serves_it(nodes):
    a, b = nodes
    prompt = distinct_prompt("pool share")
    _stored_on(a, prompt)
    roots = [a.base_url, b.base_url]
    before = read_tier_hits(roots)
    assert ask(b, prompt)["cached"] == BLOCKS * 256
    hits = tier_difference(before, read_tier_hits(roots))
    assert hits == {"device": 0, "host": 0, "disk": 0, "remote": BLOCKS}
    assert tier_shares(hits)["remote"] == 1.0
    assert tier_line(hits) == f"hits by tier: device 0%, host 0%, disk 0%, remote 100% of {BLOCKS} blocks"


def test_a_sweep_step_counts_its_hits_per_tier_over_both_nodes(nodes, tmp_path):
    a, b = nodes
    prompt = distinct_prompt("pool share in a step")
    _stored_on(a, prompt)
    request = WorkloadRequest("q", "s", 0, ({"role": "user", "content": prompt},), 4, len(prompt))
    fleet = Target("fleet", f"{a.base_url}/v1", "kvgate-tiny", nodes=(f"{a.base_url}/v1", f"{b.base_url}/v1"))
    said = []
    settings = SweepSettings(levels=(1,), duration_s=4, warmup_s=0, min_duration_s=1, min_requests=1,
                             out_dir=tmp_path, on_step=said.append, tier_hits=target_tier_hits)
    row = run_sweep([fleet], Workload("one prompt", ((request,),)), settings).to_dict("records")[0]
    hits = row["hit_blocks_by_tier"]
    # round-robin: A serves it from its device; B's first request reads the pool, B's later ones its own device
    assert hits["remote"] == BLOCKS and hits["device"] >= BLOCKS and hits["host"] == hits["disk"] == 0
    assert row["completed"] >= 2
    assert said[-1].endswith(tier_line(hits)) and "remote" in said[-1]


def test_a_server_without_cache_tiers_gives_no_reading(tmp_path):
    recompute = ServerProcess(tmp_path, mode="recompute")
    try:
        recompute.wait_healthy()
        assert read_tier_hits([recompute.base_url]) is None
    finally:
        recompute.stop()
    assert read_tier_hits([recompute.base_url]) is None           # and a node that is gone gives none either
    assert tier_difference(None, {"device": 3.0}) is None
