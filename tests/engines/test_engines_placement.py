"""Placement plans: by pressure (filler count and size from the tiers' capacities, against hand computations)
and by route (which controls leave a prefix in a tier, per engine, and why there is none)."""

from __future__ import annotations

import pytest

from engines import EngineSpec, build_adapter
from engines import kvgate as kvgate_engine
from engines.placement import PlacementError, plan_placement, pressure_plan, route_plan

# -- by pressure -------------------------------------------------------------------------------------------


def test_pushing_out_of_a_vllm_device_takes_capacity_and_a_quarter_in_context_long_fillers():
    # device 27236 blocks x 16 = 435776 tokens; x 1.25 = 544720; fillers of 32768 (the context, whole 16-token
    # blocks): ceil(544720 / 32768) = ceil(16.62) = 17
    plan = pressure_plan("host", {"device": 435776}, max_filler_tokens=32768, block_size=16)
    assert (plan.capacity_tokens, plan.target_tokens, plan.filler_tokens, plan.fillers) == (435776, 544720, 32768, 17)
    assert plan.filler_total_tokens == 17 * 32768 == 557056
    assert plan.describe() == "host: 17 distinct fillers of 32768 tokens (557056 tokens) past device (435776 tokens)"


def test_pushing_to_disk_passes_device_and_host_together():
    # (16384 + 65536) x 1.25 = 102400; fillers of 4080 rounded down to 256-token blocks = 3840: ceil(26.67) = 27
    plan = pressure_plan("disk", {"device": 16384, "host": 65536}, max_filler_tokens=4080, block_size=256)
    assert (plan.pushed_through, plan.capacity_tokens, plan.target_tokens) == (("device", "host"), 81920, 102400)
    assert (plan.filler_tokens, plan.fillers) == (3840, 27)


def test_a_filler_never_exceeds_the_device():
    # the device holds 1000 tokens: fillers of min(4096, 1000) = 1000, rounded down to 16-token blocks = 992;
    # 1000 x 1.25 = 1250 -> ceil(1250 / 992) = 2
    plan = pressure_plan("host", {"device": 1000}, max_filler_tokens=4096, block_size=16)
    assert (plan.filler_tokens, plan.fillers) == (992, 2)


def test_no_margin_writes_exactly_the_capacity():
    # 8192 x 1.0 = 8192 -> 8192 / 2048 = 4 fillers
    plan = pressure_plan("host", {"device": 8192}, max_filler_tokens=2048, margin=0, block_size=256)
    assert (plan.target_tokens, plan.fillers) == (8192, 4)


def test_the_device_needs_no_filler():
    plan = pressure_plan("device", {}, max_filler_tokens=4096)
    assert plan.fillers == 0 and plan.describe() == "device: no filler needed"


def test_a_missing_capacity_names_the_setting():
    with pytest.raises(PlacementError, match="placing in disk by pressure needs the KV capacity of host \\(set "
                                             "host_kv_tokens"):
        pressure_plan("disk", {"device": 16384}, max_filler_tokens=4096)


def test_fillers_that_would_overflow_a_write_through_target_are_refused():
    # 16384 x 1.25 = 20480 -> 6 fillers of 3840 = 23040 tokens, + the 1401-token prefix = 24441 > 16384 (the host)
    with pytest.raises(PlacementError, match="6 fillers of 3840 tokens and the 1401-token prefix would overflow host "
                                             "too \\(16384 tokens\\)"):
        pressure_plan("host", {"device": 16384}, 4080, block_size=256, target_capacity=16384, prefix_tokens=1401)


def test_a_filler_must_hold_a_block():
    with pytest.raises(PlacementError, match="at least one block \\(256 tokens\\), but the longest prompt allowed is "
                                             "200 tokens"):
        pressure_plan("host", {"device": 16384}, max_filler_tokens=200, block_size=256)


def test_an_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="tier: expected one of device, host, disk, remote, found 'l3'"):
        pressure_plan("l3", {"device": 1}, 16)


# -- by route ------------------------------------------------------------------------------------------------


def adapter(engine: str, **fields):
    return build_adapter(EngineSpec(engine, "http://127.0.0.1:9", **fields))


def test_kvgate_places_in_host_by_evicting_the_device_and_on_disk_cold_by_evicting_both():
    kvgate = kvgate_engine.build(EngineSpec("kvgate", "http://127.0.0.1:9"), admin_token="t" * 20)
    host, _ = route_plan(kvgate, "host")
    disk, _ = route_plan(kvgate, "disk")
    assert host.steps == ("clear_device_cache",) and not host.cold
    assert disk.steps == ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache") and disk.cold
    assert disk.describe() == "disk: clear_device_cache then clear_lower_tiers then drop_disk_page_cache; page cache " \
                              "dropped"


def test_sglang_with_hicache_cannot_place_in_host_by_route():
    sglang = adapter("sglang", cache_layer="hicache")
    plan, why = route_plan(sglang, "host")
    assert plan is None
    assert why == "sglang+hicache: no route empties device and keeps host; clear_device_cache empties device/host"
    disk, _ = route_plan(sglang, "disk")       # /flush_cache empties device and host, L3 stays
    assert disk.steps == ("clear_device_cache",) and not disk.cold
    assert "set cache_dir" in disk.not_cold
    assert "page cache NOT dropped" in disk.describe()


def test_vllm_places_in_its_cpu_offload_by_resetting_the_prefix_cache():
    plan, _ = route_plan(adapter("vllm"), "host")
    assert plan.steps == ("clear_device_cache",)


def test_vllm_with_lmcache_and_no_api_cannot_reach_its_disk_by_route(tmp_path):
    plan, why = route_plan(adapter("vllm", cache_layer="lmcache", cache_dir=tmp_path), "disk")
    assert plan is None and why.startswith("vllm+lmcache: no route empties host and keeps disk")
    assert "set cache_layer_url" in why
    found, _ = route_plan(adapter("vllm", cache_layer="lmcache", cache_layer_url="http://h:7000", cache_dir=tmp_path),
                          "disk")
    assert found.steps == ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache") and found.cold


def test_a_generic_engine_without_controls_has_no_route():
    plan, why = route_plan(adapter("generic"), "host")
    assert plan is None and "generic: set control.clear_device_cache" in why


# -- route, else pressure --------------------------------------------------------------------------------------


def test_a_route_is_preferred_where_the_engine_has_one():
    kvgate = kvgate_engine.build(EngineSpec("kvgate", "http://127.0.0.1:9", device_kv_tokens=8192),
                                 admin_token="t" * 20)
    placement = plan_placement(kvgate, "host", max_filler_tokens=4080, block_size=256)
    assert placement.route.steps == ("clear_device_cache",) and placement.pressure is None
    assert placement.describe() == "by route: host: clear_device_cache"


def test_without_a_route_the_prefix_is_placed_by_pressure_from_the_configured_capacities():
    sglang = adapter("sglang", cache_layer="hicache", device_kv_tokens=452312, host_kv_tokens=4 * 452312)
    placement = plan_placement(sglang, "host", max_filler_tokens=32768, block_size=64, prefix_tokens=8192)
    # 452312 x 1.25 = 565390 -> ceil(565390 / 32768) = ceil(17.25) = 18 fillers; 18 x 32768 + 8192 = 598016 fits the
    # host (1809248)
    assert placement.route is None and placement.why_not_route.startswith("sglang+hicache: no route empties device")
    assert (placement.pressure.fillers, placement.pressure.filler_tokens) == (18, 32768)
    assert placement.possible


def test_placement_by_pressure_on_disk_says_whether_the_read_is_cold(tmp_path):
    sglang = adapter("sglang", device_kv_tokens=8192, host_kv_tokens=16384)
    warm = plan_placement(sglang, "disk", max_filler_tokens=4096, block_size=64)
    assert not warm.cold and "page cache NOT dropped (sglang: set cache_dir" in warm.describe()
    cold = plan_placement(adapter("sglang", device_kv_tokens=8192, host_kv_tokens=16384, cache_dir=tmp_path), "disk",
                          max_filler_tokens=4096, block_size=64)
    # (8192 + 16384) x 1.25 = 30720 -> 30720 / 4096 = 7.5 -> 8 fillers
    assert cold.cold and cold.pressure.fillers == 8


def test_no_route_and_no_capacity_is_no_placement_with_both_reasons():
    placement = plan_placement(adapter("generic"), "host", max_filler_tokens=4096)
    assert not placement.possible
    assert "generic: set control.clear_device_cache" in placement.why_not_route
    assert "needs the KV capacity of device (set device_kv_tokens" in placement.why_not_pressure
    assert placement.describe().startswith("host: no placement (generic: no route empties device and keeps host")


def test_an_unknown_engine_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="engine: expected one of kvgate, vllm, sglang, generic, found 'tgi'"):
        build_adapter(EngineSpec("tgi", "http://127.0.0.1:9"))
