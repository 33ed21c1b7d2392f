"""targets.<role>.engine and its settings in gates.yaml: defaults, the adapter built from them, and errors that
name the field, what was expected and what was found."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engines import build_adapter, spec_from_endpoint
from engines.metrics import parse_metrics
from gates.config import load_config
from kvcore.settings import ConfigError

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
BASELINE = {"url": "http://127.0.0.1:8001/v1", "model": "m"}


def load(tmp_path: Path, candidate: dict):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({"targets": {"kind": "external", "baseline": BASELINE,
                                                "candidate": {"url": "http://10.0.0.6:8000/v1", "model": "m",
                                                              **candidate}}}))
    return load_config(path).targets.candidate


def test_an_external_endpoint_is_generic_unless_it_names_its_engine(tmp_path):
    endpoint = load(tmp_path, {})
    assert endpoint.engine == "generic" and endpoint.metrics_endpoint == "http://10.0.0.6:8000/metrics"
    adapter = build_adapter(spec_from_endpoint(endpoint))
    assert adapter.engine == "generic" and not adapter.ability("clear_device_cache").available


def test_a_vllm_lmcache_candidate_gets_its_routes_from_the_config(tmp_path):
    endpoint = load(tmp_path, {"engine": "vllm", "cache_layer": "lmcache", "cache_layer_url": "http://10.0.0.6:7000",
                               "cache_dir": str(tmp_path / "lmcache"), "device_kv_tokens": 500000,
                               "metrics_url": "http://10.0.0.6:9100/metrics",
                               "control": {"drop_disk_page_cache": {"command": "ssh st01 'echo 1 > /proc/sys/vm/x'"}}})
    adapter = build_adapter(spec_from_endpoint(endpoint))
    abilities = adapter.abilities()
    assert adapter.engine == "vllm+lmcache" and adapter.metrics_url == "http://10.0.0.6:9100/metrics"
    assert abilities["clear_device_cache"].how == "POST http://10.0.0.6:8000/reset_prefix_cache"
    assert abilities["clear_lower_tiers"].how == "DELETE http://10.0.0.6:7000/cache/clear?locations=LocalCPUBackend"
    # the configured command wins over the local cache_dir
    assert abilities["drop_disk_page_cache"].how == "command: ssh st01 'echo 1 > /proc/sys/vm/x'"
    assert adapter.device_kv_tokens().tokens == 500000
    assert endpoint.cache_dir == tmp_path / "lmcache" and endpoint.cache_dir.is_absolute()


def test_a_generic_engines_steps_and_metric_map_come_from_the_config(tmp_path):
    # kvgate serve as a generic candidate: its block counters, scaled to tokens by its 256-token blocks
    endpoint = load(tmp_path, {"control": {"clear_device_cache": {"http": {"method": "POST",
                                                                            "url": "http://10.0.0.6:8000/flush",
                                                                            "json": {"tiers": ["gpu"]}}},
                                           "clear_lower_tiers": {"command": "true", "clears": ["host", "disk"]}},
                               "metric_map": {"device": {"metric": "kvgate_cache_hits_total",
                                                         "labels": {"tier": "device"}, "scale": 256},
                                              "host": [{"metric": "kvgate_cache_hits_total", "labels": {"tier": "host"},
                                                        "scale": 256}],
                                              "disk": {"metric": "kvgate_cache_hits_total", "labels": {"tier": "disk"},
                                                       "scale": 256},
                                              "prompt_tokens": [{"metric": "kvgate_prompt_tokens_computed_total"},
                                                                {"metric": "kvgate_prompt_tokens_reused_total"}]}})
    adapter = build_adapter(spec_from_endpoint(endpoint))
    abilities = adapter.abilities()
    assert abilities["clear_device_cache"].how == 'POST http://10.0.0.6:8000/flush {"tiers": ["gpu"]}'
    assert abilities["clear_device_cache"].clears == ("device",)        # the ability's own, by default
    assert abilities["clear_lower_tiers"].clears == ("host", "disk")
    before = parse_metrics((DATA / "kvgate_tiered_host_hit.prom").read_text())
    after = parse_metrics((DATA / "kvgate_tiered_disk_hit.prom").read_text())
    hits = adapter.tier_hits(before, after)
    # {tier="disk"} 0 -> 5 blocks x 256; prompt: computed 1522 -> 1643 (+121), reused 1280 -> 2560 (+1280)
    assert dict(hits.tiers) == {"device": 0, "host": 0, "disk": 1280} and hits.prompt_tokens == 1401
    assert hits.verifies("disk")[0] is True and hits.source == "the configured metric_map"


@pytest.mark.parametrize("candidate, message", [
    ({"engine": "tgi"}, "targets.candidate.engine: expected one of 'kvgate', 'vllm', 'sglang' or 'generic', "
                        "found 'tgi'"),
    ({"engine": "sglang", "cache_layer": "lmcache"},
     "targets.candidate.cache_layer: expected lmcache only with engine vllm, found engine sglang"),
    ({"engine": "vllm", "cache_layer_url": "http://h:7000"},
     "targets.candidate.cache_layer_url: expected only with cache_layer: lmcache (its internal API server) or kvgate "
     "(the connector's sidecar), found cache_layer None"),
    ({"engine": "vllm", "metric_map": {"device": {"metric": "x_total"}}},
     "targets.candidate.metric_map: expected only with engine: generic (vllm's metric names are known), found engine "
     "vllm"),
    ({"device_kv_tokens": 0}, "targets.candidate.device_kv_tokens: expected a value >= 1, found 0"),
    ({"control": {"clear_device_cache": {}}},
     "targets.candidate.control.clear_device_cache: expected exactly one of http ({method, url, json}) or command, "
     "found neither"),
    ({"control": {"clear_device_cache": {"command": "x", "http": {"url": "http://h/x"}}}},
     "targets.candidate.control.clear_device_cache: expected exactly one of http ({method, url, json}) or command, "
     "found both"),
    ({"control": {"clear_device_cache": {"command": "x", "clears": ["gpu"]}}},
     "targets.candidate.control.clear_device_cache.clears[0]: expected one of 'device', 'host', 'disk' or 'remote', "
     "found 'gpu'"),
    ({"control": {"drop_disk_page_cache": {"command": "x", "clears": ["disk"]}}},
     "targets.candidate.control.drop_disk_page_cache.clears: expected none (dropping the page cache leaves the tier's "
     "files), found ['disk']"),
    ({"control": {"flush_everything": {"command": "x"}}},
     "targets.candidate.control.flush_everything: unknown field"),
    ({"metric_map": {"gpu": {"metric": "x_total"}}}, "targets.candidate.metric_map.gpu: unknown field"),
    ({"metric_map": {"prompt_tokens": {"metric": "x_total"}}},
     "targets.candidate.metric_map: expected at least one tier (device, host, disk, remote, lower, any) with its "
     "series, found none"),
    ({"metric_map": {"device": {"metric": "not a name"}}},
     "targets.candidate.metric_map.device[0].metric: expected a Prometheus sample name (letters, digits, _ and :), "
     "found 'not a name'"),
    ({"metrics_url": "10.0.0.6:8000/metrics"}, "targets.candidate.metrics_url: expected"),
    ({"tokenizer": "/nonexistent/model"}, "targets.candidate.tokenizer: expected a tokenizer.json or a model "
     "directory, found no such file or directory: /nonexistent/model"),
])
def test_bad_engine_settings_name_the_field(tmp_path, candidate, message):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, candidate)
    assert message in str(caught.value), str(caught.value)


def test_a_configured_call_carries_the_api_key_only_to_the_endpoints_own_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CANDIDATE_KEY", "sk-candidate")
    endpoint = load(tmp_path, {"api_key_env": "CANDIDATE_KEY",
                               "control": {"clear_device_cache": {"http": {"url": "http://10.0.0.6:8000/flush"}},
                                           "clear_lower_tiers": {"http": {"url": "http://10.0.0.9:9000/clear"}}}})
    controls = build_adapter(spec_from_endpoint(endpoint)).controls
    assert controls["clear_device_cache"].step.headers == {"Authorization": "Bearer sk-candidate"}
    assert controls["clear_lower_tiers"].step.headers == {}      # another host: the key stays home
    assert controls["clear_device_cache"].step.method == "POST"  # the default method


def _tokenizer_file(path, *, unk: bool, deleting: bool) -> str:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1} if unk else {"the": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]" if unk else None))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if deleting:                                           # a normalizer that strips every character
        tokenizer.normalizer = normalizers.Replace(Regex(r"[\s\S]"), "")
    tokenizer.save(str(path))
    return str(path)


@pytest.mark.parametrize("unk, deleting, message", [
    (False, False, "expected a tokenizer that encodes plain words, found {} failing on them"),
    (True, True, "expected a tokenizer that turns words into tokens, found {} making 0 tokens of 32 words"),
])
def test_a_tokenizer_that_cannot_size_prompts_is_refused_at_load_naming_it(tmp_path, unk, deleting, message):
    path = _tokenizer_file(tmp_path / "tokenizer.json", unk=unk, deleting=deleting)
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, {"tokenizer": path})
    assert f"targets.candidate.tokenizer: {message.format(path)}" in str(caught.value), str(caught.value)


def test_a_tokenizer_that_makes_words_into_tokens_sizes_prompts(tmp_path):
    from workloads.traffic.datasets import sizer_for

    path = _tokenizer_file(tmp_path / "tokenizer.json", unk=True, deleting=False)
    assert load(tmp_path, {"tokenizer": path}).tokenizer == path
    assert len(sizer_for(path).tokens(sizer_for(path).text(40, "seed"))) == 40


@pytest.mark.parametrize("typo", ["kvgate-byte-v2", "kvgate-bytes-v1", "kvgate_byte_v1"])
def test_a_tokenizer_id_one_typo_from_kvgates_is_refused_naming_it(tmp_path, typo):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, {"tokenizer": typo})
    assert "targets.candidate.tokenizer: expected kvgate-byte-v1 (did you mean it?)" in str(caught.value)
    assert load(tmp_path, {"tokenizer": "meta-llama/Llama-3.1-8B"}).tokenizer == "meta-llama/Llama-3.1-8B"


def test_a_tokenizer_that_is_a_device_is_said_to_be_one(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, {"tokenizer": "/dev/null"})
    assert "found neither (a device, a FIFO or another special file): /dev/null" in str(caught.value)
