"""examples/engines/: each gates.yaml loads, names its candidate's engine, and gives the adapter the README's
"Real engines as candidates" table describes; the engine-side files beside them agree with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cache_impl.engine.hf_export import export_hf
from engines import build_adapter, parse_metrics, spec_from_endpoint
from engines.placement import plan_placement
from gates.config import EmbeddedTargets, load_config
from gates.targets import engine_settings
from kvcore.settings import parse_size
from sizing.layout import KVShape

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "engines"
METRICS = Path(__file__).resolve().parents[1] / "data" / "metrics"
GIB = 2**30

# The README table, per file: each ability of the candidate, available or not, and the tiers a control
# empties; and the baseline's engine (the same engine without offload).
TABLE = {
    "vllm-lmcache.yaml": {
        "engine": "vllm+lmcache",
        "baseline": "vllm",
        "clear_device_cache": ("device",),
        "clear_lower_tiers": ("host",),
        "drop_disk_page_cache": (),
        "device_kv_tokens": True,
        "host_kv_tokens": True,
        "tier_accounting": True,
    },
    "sglang-hicache.yaml": {
        "engine": "sglang+hicache",
        "baseline": "sglang",
        "clear_device_cache": ("device", "host"),
        "clear_lower_tiers": ("disk",),
        "drop_disk_page_cache": (),
        "device_kv_tokens": True,
        "host_kv_tokens": True,
        "tier_accounting": True,
    },
    "vllm-mooncake.yaml": {
        "engine": "vllm+mooncake",
        "baseline": "vllm",
        "clear_device_cache": ("device",),
        "clear_lower_tiers": ("device", "remote"),
        "drop_disk_page_cache": None,
        "device_kv_tokens": True,
        "host_kv_tokens": False,
        "tier_accounting": True,
    },
    "vllm-cpu.yaml": {  # claimed by the profile; the pre-flight's probe finds the lower clear not applicable
        "engine": "vllm",
        "baseline": "vllm",
        "clear_device_cache": ("device",),
        "clear_lower_tiers": ("device", "host"),
        "drop_disk_page_cache": None,
        "device_kv_tokens": True,
        "host_kv_tokens": False,
        "tier_accounting": True,
    },
    "vllm-kvgate.yaml": {  # kvgate's connector: its sidecar empties the host tier and drops disk pages
        "engine": "vllm+kvgate",
        "baseline": "vllm",
        "clear_device_cache": ("device",),
        "clear_lower_tiers": ("host",),
        "drop_disk_page_cache": (),
        "device_kv_tokens": True,
        "host_kv_tokens": False,
        "tier_accounting": True,
    },
    "kvgate-serve-generic.yaml": {
        "engine": "generic",
        "baseline": "generic",
        "clear_device_cache": None,
        "clear_lower_tiers": None,
        "drop_disk_page_cache": (),
        "device_kv_tokens": True,
        "host_kv_tokens": True,
        "tier_accounting": True,
    },
}


def load(name: str, tmp_path: Path, monkeypatch):
    """The example loaded as `kvgate run --config` would, from a fresh directory (relative paths land there)."""
    monkeypatch.chdir(tmp_path)
    if name in ("vllm-cpu.yaml", "vllm-kvgate.yaml"):   # its tokenizer: the exported model's, as the README says
        export_hf(tmp_path / "kvgate-small-hf", "tiny", 0)
    return load_config(EXAMPLES / name)


def config_host(adapter) -> int:
    return adapter.host_kv_tokens().tokens


def candidate_adapter(config):
    return build_adapter(spec_from_endpoint(config.targets.candidate))


def test_the_table_covers_every_example():
    assert sorted(path.name for path in EXAMPLES.glob("*.yaml")) == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_example_loads_and_its_candidate_has_the_abilities_the_readme_lists(name, tmp_path, monkeypatch):
    config = load(name, tmp_path, monkeypatch)
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    assert config.targets.kind == "external"
    assert "engine" in raw["targets"]["candidate"] and "engine" in raw["targets"]["baseline"]   # named, not defaulted
    expected = TABLE[name]
    adapter = candidate_adapter(config)
    assert adapter.engine == expected["engine"]
    assert build_adapter(spec_from_endpoint(config.targets.baseline)).engine == expected["baseline"]
    abilities = adapter.abilities()
    for ability in ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache"):
        clears = expected[ability]
        assert abilities[ability].available is (clears is not None), (ability, abilities[ability].how)
        if clears is not None:
            assert abilities[ability].clears == clears, ability
    for ability in ("device_kv_tokens", "host_kv_tokens", "tier_accounting"):
        assert abilities[ability].available is expected[ability], (ability, abilities[ability].how)


def test_vllm_lmcache_clears_lmcache_only_through_its_api_server(tmp_path, monkeypatch):
    config = load("vllm-lmcache.yaml", tmp_path, monkeypatch)
    ability = candidate_adapter(config).ability("clear_lower_tiers")
    assert ability.how == "DELETE http://127.0.0.1:7000/cache/clear?locations=LocalCPUBackend"
    # without cache_layer_url nothing clears LMCache (vLLM's reset_external does not reach it)
    without = config.targets.candidate.model_copy(update={"cache_layer_url": None})
    ability = build_adapter(spec_from_endpoint(without)).ability("clear_lower_tiers")
    assert not ability.available and "cache_layer_url" in ability.how
    # the device reset is vLLM's development route
    assert candidate_adapter(config).ability("clear_device_cache").how == \
        "POST http://127.0.0.1:8000/reset_prefix_cache"


def test_vllm_lmcache_places_host_and_disk_by_route_and_reports_lmcache_hits_as_lower(tmp_path, monkeypatch):
    adapter = candidate_adapter(load("vllm-lmcache.yaml", tmp_path, monkeypatch))
    after = parse_metrics((METRICS / "vllm_0.33.0_lmcache_0.5.6_after.prom").read_text())
    before = parse_metrics((METRICS / "vllm_0.33.0_lmcache_0.5.6_before.prom").read_text())
    host = plan_placement(adapter, "host", 60000, scrape=after)
    disk = plan_placement(adapter, "disk", 60000, scrape=after)
    assert host.route.steps == ("clear_device_cache",)
    assert disk.route.steps == ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache") and disk.cold
    hits = adapter.tier_hits(before, after)
    assert hits.tiers["lower"] > 0 and hits.verifies("disk")[0] is None    # host and disk together
    # num_gpu_blocks 27236 x block_size 16 in the fixture's vllm:cache_config_info
    assert adapter.device_kv_tokens(after).tokens == 27236 * 16


def test_sglang_flush_empties_host_too_so_host_is_placed_by_pressure(tmp_path, monkeypatch):
    adapter = candidate_adapter(load("sglang-hicache.yaml", tmp_path, monkeypatch))
    assert adapter.ability("clear_device_cache").how == "POST http://127.0.0.1:30000/flush_cache"
    after = parse_metrics((METRICS / "sglang_0.5.23_hicache_after.prom").read_text())
    host = plan_placement(adapter, "host", 60000, block_size=64, prefix_tokens=65536, scrape=after)
    assert host.route is None and "clear_device_cache empties device/host" in host.why_not_route
    # device 452312 tokens (sglang:max_total_num_tokens) x 1.25 = 565390 -> 10 fillers of 60000 // 64 * 64 = 59968
    assert host.pressure.capacity_tokens == 452312 and host.pressure.filler_tokens == 59968
    assert host.pressure.fillers == 10
    # they and the prefix fit the host pool (write-through keeps a copy of each): 10 x 59968 + 65536 <= 976562
    assert config_host(adapter) == 976562 and 10 * 59968 + 65536 <= 976562
    disk = plan_placement(adapter, "disk", 60000, scrape=after)
    assert disk.route.steps == ("clear_device_cache", "drop_disk_page_cache") and disk.cold
    before = parse_metrics((METRICS / "sglang_0.5.23_hicache_before.prom").read_text())
    assert set(adapter.tier_hits(before, after).tiers) >= {"device", "host", "disk"}


def test_vllm_mooncake_resets_the_store_with_the_device_and_has_no_disk_tier(tmp_path, monkeypatch):
    adapter = candidate_adapter(load("vllm-mooncake.yaml", tmp_path, monkeypatch))
    assert adapter.ability("clear_lower_tiers").how == \
        "POST http://127.0.0.1:8000/reset_prefix_cache?reset_external=true"
    after = parse_metrics((METRICS / "vllm_0.33.0_lmcache_0.5.6_after.prom").read_text())
    # "host" is the store: clearing the device leaves the prefix there; there is no disk tier to place in
    assert plan_placement(adapter, "host", 60000, scrape=after).route.steps == ("clear_device_cache",)
    assert not plan_placement(adapter, "disk", 60000, scrape=after).possible


def test_lmcache_yaml_agrees_with_the_candidate(tmp_path, monkeypatch):
    config = load("vllm-lmcache.yaml", tmp_path, monkeypatch)
    lmcache = yaml.safe_load((EXAMPLES / "vllm-lmcache" / "lmcache.yaml").read_text())
    candidate, target = config.targets.candidate, config.sizing.target
    # the API server is on, and worker 0 listens on port_start + 1
    assert lmcache["internal_api_server_enabled"] is True
    assert candidate.cache_layer_url == f"http://{lmcache['internal_api_server_host']}:" \
                                        f"{lmcache['internal_api_server_port_start'] + 1}"
    # the disk backend exists only with local_disk and a size > 0; its directory is the one dropped
    assert lmcache["local_disk"] == f"file://{candidate.cache_dir}/" and lmcache["max_local_disk_size"] > 0
    # 64 GB (2^30 bytes each) / 128 KiB per token (2 x 32 layers x 8 heads x 128 x 2 bytes) = 524288 tokens
    per_token = target.shape().bytes_per_token
    assert per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert candidate.host_kv_tokens == lmcache["max_local_cpu_size"] * GIB // per_token == 524288
    assert parse_size(target.host_capacity) == lmcache["max_local_cpu_size"] * GIB
    assert parse_size(target.disk_capacity) == lmcache["max_local_disk_size"] * GIB


def test_mooncake_json_is_embedded_mode_with_a_segment(tmp_path, monkeypatch):
    config = load("vllm-mooncake.yaml", tmp_path, monkeypatch)
    mooncake = json.loads((EXAMPLES / "vllm-mooncake" / "mooncake.json").read_text())
    # vLLM 0.33's embedded mode (the default) refuses global_segment_size 0
    assert mooncake.get("mode", "embedded") == "embedded" and parse_size(mooncake["global_segment_size"]) > 0
    assert mooncake["protocol"] == "tcp" and mooncake["metadata_server"] == "http://127.0.0.1:8080/metadata"
    assert parse_size(config.sizing.target.pool_capacity) == parse_size(mooncake["global_segment_size"])


def test_kvgate_serve_runs_the_embedded_settings_and_the_capacities_follow_from_them(tmp_path, monkeypatch):
    config = load("kvgate-serve-generic.yaml", tmp_path, monkeypatch)
    engine = yaml.safe_load((EXAMPLES / "kvgate-serve" / "engine.yaml").read_text())["engine"]
    embedded = engine_settings(EmbeddedTargets())
    path = engine["cache"]["disk"].pop("path")     # the embedded servers get theirs by --cache-dir
    assert engine == embedded
    candidate = config.targets.candidate
    assert candidate.cache_dir == tmp_path / path              # both relative to where kvgate runs
    # small: 4 KiB per token, 256-token blocks of 1 MiB; 64 device blocks, 1 GiB of host = 1024 blocks
    block_bytes = KVShape.from_preset("small").bytes_per_block(256)
    assert block_bytes == 2**20
    assert candidate.device_kv_tokens == 64 * 256 == 16384
    assert candidate.host_kv_tokens == parse_size(engine["cache"]["host_capacity_bytes"]) // block_bytes * 256 == 262144
    assert config.targets.baseline.device_kv_tokens == candidate.device_kv_tokens


def test_kvgate_serve_generic_tells_tiers_apart_from_its_block_counters(tmp_path, monkeypatch):
    adapter = candidate_adapter(load("kvgate-serve-generic.yaml", tmp_path, monkeypatch))
    before = parse_metrics((METRICS / "kvgate_tiered_host_hit.prom").read_text())
    after = parse_metrics((METRICS / "kvgate_tiered_disk_hit.prom").read_text())
    hits = adapter.tier_hits(before, after)
    # kvgate_cache_hits_total{tier="disk"} 0 -> 5 blocks x 256; computed 1522 -> 1643, reused 1280 -> 2560
    assert dict(hits.tiers) == {"device": 0, "host": 0, "disk": 1280} and hits.prompt_tokens == 121 + 1280
    assert hits.verifies("disk")[0] is True
    # no admin route: host and disk are placed by pressure. Fillers: the small preset's 16384-token context
    # less 32 output tokens, in whole blocks: 16352 // 256 * 256 = 16128.
    # host: 16384 x 1.25 = 20480 -> 2 fillers; disk: (16384 + 262144) x 1.25 = 348160 -> 21.6 -> 22 fillers
    host = plan_placement(adapter, "host", 16384 - 32, block_size=256, prefix_tokens=8192)
    disk = plan_placement(adapter, "disk", 16384 - 32, block_size=256)
    assert host.route is None and host.pressure.filler_tokens == 16128 and host.pressure.fillers == 2
    assert disk.route is None and disk.pressure.fillers == 22 and disk.cold
