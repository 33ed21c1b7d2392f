"""The kvgate adapter against a real `kvgate serve` with small tiers: its admin routes place a prefix in a tier, its
/metrics say the hit came from that tier; and placement by pressure alone, with no admin route."""

from __future__ import annotations

import pytest

from engines import EngineSpec, build_adapter, embedded_spec
from engines import kvgate as kvgate_engine
from engines.placement import pressure_plan, route_plan
from tests.servers import ask, distinct_prompt, started_server

BLOCK = 256                      # cache.block_size's default
PROMPT_CHARS = 1400              # one token per character: 1401 tokens with BOS, 5 full blocks
PROMPT_HIT = 5 * BLOCK           # 1280 tokens served from the cache on a full-prefix hit
DEVICE_BLOCKS, HOST_BLOCKS = 32, 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """With its admin routes; small tiers (a block is 131072 bytes with the tiny preset): a device of 32 blocks and
    a host of 64, room for the fillers that push a prefix out of the device, few enough to push it past the host."""
    engine = {"cache": {"device_capacity_blocks": DEVICE_BLOCKS, "host_capacity_bytes": HOST_BLOCKS * 131072}}
    yield from started_server(tmp_path_factory.mktemp("engines"), engine=engine, admin=True)


def test_clearing_the_device_leaves_a_prefix_that_hits_from_host(server):
    adapter = build_adapter(embedded_spec(server.base_url))
    prompt = distinct_prompt("engines: host hit", PROMPT_CHARS)
    assert ask(server, prompt)["cached"] == 0
    plan, why = route_plan(adapter, "host")
    assert plan is not None and plan.steps == ("clear_device_cache",), why
    adapter.clear_device_cache()
    before = adapter.scrape()
    answer = ask(server, prompt)
    hits = adapter.tier_hits(before, adapter.scrape())
    assert answer["cached"] == PROMPT_HIT and hits.agrees_with(answer["cached"]) is None
    assert hits.tiers["host"] == PROMPT_HIT and hits.tiers["device"] == 0 and hits.prompt_tokens == 1401
    assert hits.verifies("host")[0] is True


def test_the_route_to_disk_empties_device_and_host_and_drops_the_page_cache(server):
    adapter = build_adapter(embedded_spec(server.base_url, cache_dir=server.cache_dir))
    prompt = distinct_prompt("engines: disk hit", PROMPT_CHARS)
    ask(server, prompt)
    plan, why = route_plan(adapter, "disk")
    assert plan is not None and plan.cold, why
    assert plan.steps == ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache")
    evict_device, evict_host, drop = plan.run(adapter)
    # each eviction first publishes queued writes (flush), then evicts: the prompt's 5 blocks at least, each tier
    assert evict_device.answer[1]["evicted"]["device"] >= 5 and evict_host.answer[1]["evicted"]["host"] >= 5
    assert drop.answer == {"dropped": True}
    before = adapter.scrape()
    answer = ask(server, prompt)
    hits = adapter.tier_hits(before, adapter.scrape())
    assert answer["cached"] == PROMPT_HIT
    assert hits.verifies("disk") == (True, f"{PROMPT_HIT} tokens from disk (device 0, host 0, disk {PROMPT_HIT}, "
                                           f"remote 0)")


def test_the_device_capacity_is_read_from_the_servers_metrics(server):
    adapter = build_adapter(embedded_spec(server.base_url))
    ask(server, distinct_prompt("engines: capacity", PROMPT_CHARS))   # the device holds blocks now
    assert adapter.device_kv_tokens().tokens == DEVICE_BLOCKS * BLOCK == 8192


def test_placement_by_pressure_needs_no_admin_route(server):
    adapter = kvgate_engine.build(EngineSpec("kvgate", server.base_url), admin_token="")   # no route can be called
    assert not any(adapter.ability(name).available for name in ("clear_device_cache", "clear_lower_tiers"))
    prompt = distinct_prompt("engines: pressure", PROMPT_CHARS)
    ask(server, prompt)
    scrape = adapter.scrape()
    device, host = adapter.device_kv_tokens(scrape), adapter.host_kv_tokens(scrape)
    assert (device.tokens, host.tokens) == (32 * BLOCK, 64 * BLOCK) == (8192, 16384)
    # the tiny model's context is 4096 tokens: fillers of at most 4096 - 16 (output) = 4080, 15 whole blocks = 3840
    # host: past the device, 8192 x 1.25 = 10240 tokens -> ceil(10240 / 3840) = 3 fillers; the write-through
    # host takes them too: 3 x 3840 + 1401 = 12921 <= 16384, so the prefix stays in it
    to_host = pressure_plan("host", {"device": device.tokens}, 4080, block_size=BLOCK, target_capacity=host.tokens,
                            prefix_tokens=1401)
    assert (to_host.filler_tokens, to_host.fillers) == (3840, 3)
    _send_fillers(server, to_host, "to host")
    before = adapter.scrape()
    ask(server, prompt)
    hits = adapter.tier_hits(before, adapter.scrape())
    served, why = hits.verifies("host")
    assert served is True, why
    assert why == f"{PROMPT_HIT} tokens from host (device 0, host {PROMPT_HIT}, disk 0, remote 0)"
    # disk: past device and host, (8192 + 16384) x 1.25 = 30720 tokens -> ceil(30720 / 3840) = 8 fillers
    to_disk = pressure_plan("disk", {"device": device.tokens, "host": host.tokens}, 4080, block_size=BLOCK)
    assert (to_disk.capacity_tokens, to_disk.fillers) == (24576, 8)
    _send_fillers(server, to_disk, "to disk")
    before = adapter.scrape()
    ask(server, prompt)
    hits = adapter.tier_hits(before, adapter.scrape())
    assert hits.verifies("disk")[0] is True, hits.verifies("disk")[1]


def _send_fillers(server, plan, tag: str) -> None:
    for i in range(plan.fillers):
        ask(server, distinct_prompt(f"filler {tag} {i}", plan.filler_tokens), max_tokens=2)
