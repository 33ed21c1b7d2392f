"""Writes the /metrics fixtures of vLLM, vLLM + LMCache and SGLang: before and after one request.

Each exposition is what the engine's own registry writes (prometheus_client, as every one of
them uses): the metric names, types and label names are those of the engine's source, cited in
each file's first lines; only the values are chosen, one request's worth, written out in
tests/engines/test_engines_metrics.py. kvgate's fixtures are captured from a real `kvgate serve` instead
(tests/engines/test_engines_kvgate.py says how). Run: python tests/data/metrics/make_fixtures.py
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

HERE = Path(__file__).resolve().parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

VLLM_SOURCE = """\
# vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64, tag v0.33.0): names, types and labels of
# vllm/v1/metrics/loggers.py (PrometheusStatLogger: labels model_name, engine; prompt_tokens_by_source and
# prompt_tokens_cached_by_source add source, the latter's values from vllm/v1/metrics/cache_hit_source.py),
# vllm:cache_config_info's labels = CacheConfig's fields (vllm/config/cache.py metrics_info()) + engine, and
# vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py (kv_offload_*). Values: one request.
"""
LMCACHE_SOURCE = """\
# vLLM 0.33.0 with LMCache 0.5.6 as its KV connector (one page: LMCache's counters with vLLM's, shared registry):
# vLLM names as in vllm_*.prom; LMCache's from lmcache/observability.py of the lmcache-0.5.6 wheel (the same
# names in LMCache/LMCache at 0353be824aeb): labels model_name, worker_id, role, served_model_name.
"""
SGLANG_SOURCE = """\
# SGLang 0.5.23 (PyPI wheel sglang-0.5.23-cp311): names, types and labels of
# sglang/srt/observability/metrics_collector.py: TokenizerMetricsCollector (labels model_name, engine_type;
# cached_tokens_total adds cache_source: device, host, storage; prompt_tokens_total adds is_streaming) and
# SchedulerMetricsCollector's max_total_num_tokens (labels model_name, engine_type, tp_rank, pp_rank,
# moe_ep_rank). Values: one request.
"""

CACHE_CONFIG = {  # CacheConfig's fields as metrics_info() renders them (str of each value)
    "block_size": "16", "user_specified_block_size": "False", "kv_cache_layout": "None", "prefix_match_unit": "None",
    "gpu_memory_utilization": "0.9", "cache_dtype": "auto", "is_attention_free": "False",
    "num_gpu_blocks_override": "None", "sliding_window": "None", "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
    "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16", "use_replayssm": "False",
    "use_kda_recoverssm": "False", "num_gpu_blocks": "27236", "num_cpu_blocks": "None",
    "simple_cpu_offload_num_blocks": "None", "effective_attention_block_size": "16", "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "3.32", "hash_block_size": "16", "cache_hit_alignment_tokens": "16",
    "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "16.0", "kv_offloading_backend": "native", "_block_size_resolved": "True",
}
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def vllm_registry(step: dict, by_source: bool = True) -> CollectorRegistry:
    """vLLM's cache and token metrics after `step`: {prompt, device, external, source: {..}, computed, bytes}."""
    registry, labels = CollectorRegistry(), {"model_name": MODEL, "engine": "0"}
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 labelnames=[*CACHE_CONFIG, "engine"], registry=registry)
    info.labels(**CACHE_CONFIG, engine="0").set(1)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labelnames=list(labels),
                  registry=registry)
    usage.labels(**labels).set(step["usage"])
    counters = {
        "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.", step["prompt"]),
        "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", step["device"]),
        "vllm:external_prefix_cache_queries": ("External prefix cache queries from KV connector cross-instance cache "
                                               "sharing, in terms of number of queried tokens.",
                                               step["prompt"] - step["device"]),
        "vllm:external_prefix_cache_hits": ("External prefix cache hits from KV connector cross-instance cache "
                                            "sharing, in terms of number of cached tokens.", step["external"]),
        "vllm:prompt_tokens": ("Number of prefill tokens processed.", step["prompt"]),
        "vllm:prompt_tokens_cached": ("Number of cached prompt tokens (local + external).",
                                      step["device"] + step["external"]),
    }
    for name, (documentation, value) in counters.items():
        Counter(name, documentation, labelnames=list(labels), registry=registry).labels(**labels).inc(value)
    sources = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                      labelnames=[*labels, "source"], registry=registry)
    for source, value in (("local_compute", step["computed"]), ("local_cache_hit", step["device"]),
                          ("external_kv_transfer", step["external"])):
        sources.labels(**labels, source=source).inc(value)
    if by_source:
        cached = Counter("vllm:prompt_tokens_cached_by_source",
                         "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
                         "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
                         "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
                         "vllm:external_prefix_cache_hits.", labelnames=[*labels, "source"], registry=registry)
        for source in CACHE_HIT_SOURCES:
            cached.labels(**labels, source=source).inc(step["source"].get(source, 0))
    for name, documentation, value in (
            ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.", step["load_bytes"]),
            ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.", step["store_bytes"])):
        Counter(name, documentation, labelnames=list(labels), registry=registry).labels(**labels).inc(value)
    deprecated = Counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                         labelnames=[*labels, "transfer_type"], registry=registry)
    deprecated.labels(**labels, transfer_type="CPU_to_GPU").inc(step["load_bytes"])
    deprecated.labels(**labels, transfer_type="GPU_to_CPU").inc(step["store_bytes"])
    return registry


def lmcache_counters(registry: CollectorRegistry, step: dict) -> None:
    labels = {"model_name": MODEL, "worker_id": "0", "role": "worker", "served_model_name": MODEL}
    for name, documentation, value in (
            ("lmcache:num_retrieve_requests", "Total number of retrieve requests sent to lmcache", step["retrieves"]),
            ("lmcache:num_store_requests", "Total number of store requests sent to lmcache", step["stores"]),
            ("lmcache:num_requested_tokens", "Total number of tokens requested from lmcache", step["requested"]),
            ("lmcache:num_hit_tokens", "Total number of tokens hit in lmcache", step["hit"]),
            ("lmcache:num_stored_tokens", "Total number of tokens stored in lmcache including evicted ones",
             step["stored"]),
            ("lmcache:num_remote_read_bytes", "Total number of bytes read from remote backends in lmcache",
             step["remote_bytes"])):
        Counter(name, documentation, labelnames=list(labels), registry=registry).labels(**labels).inc(value)
    Gauge("lmcache:local_cache_usage", "Local cache usage (bytes) of lmcache", labelnames=list(labels),
          registry=registry).labels(**labels).set(step["local_usage"])
    Histogram("lmcache:time_to_retrieve", "Time to retrieve from lmcache (seconds)", labelnames=list(labels),
              buckets=[0.001, 0.01, 0.1, 1.0, 10.0], registry=registry).labels(**labels).observe(step["retrieve_s"])


def sglang_registry(step: dict) -> CollectorRegistry:
    registry = CollectorRegistry()
    labels = {"model_name": MODEL, "engine_type": "unified"}
    prompt = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                     labelnames=[*labels, "is_streaming"], registry=registry)
    prompt.labels(**labels, is_streaming="true").inc(step["prompt"])
    cached = Counter("sglang:cached_tokens_total", "Number of cached prompt tokens by source (device/host/storage).",
                     labelnames=[*labels, "cache_source"], registry=registry)
    for source in ("device", "host", "storage"):
        if step.get(source):
            cached.labels(**labels, cache_source=source).inc(step[source])
    rank = {**labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    Gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
          labelnames=list(rank), registry=registry).labels(**rank).set(step["max_total_num_tokens"])
    Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labelnames=list(rank),
          registry=registry).labels(**rank).set(step["hit_rate"])
    return registry


VLLM_STEPS = (  # native CPU offloading: a 4096-token prompt, 1024 from the device, 2048 loaded from host DRAM
    {"prompt": 8192, "device": 0, "external": 0, "computed": 8192, "source": {}, "usage": 0.05,
     "load_bytes": 0, "store_bytes": 1073741824},
    {"prompt": 8192 + 4096, "device": 1024, "external": 2048, "computed": 8192 + 1024,
     "source": {"device": 1024, "host": 2048}, "usage": 0.07, "load_bytes": 268435456, "store_bytes": 1207959552},
)
LMCACHE_STEPS = (  # vLLM + LMCache after a prefix-cache reset: an 8192-token prompt, 6144 retrieved from LMCache
    ({"prompt": 8192, "device": 0, "external": 0, "computed": 8192, "source": {}, "usage": 0.05,
      "load_bytes": 0, "store_bytes": 0},
     {"retrieves": 1, "stores": 1, "requested": 8192, "hit": 0, "stored": 8192, "remote_bytes": 0,
      "local_usage": 1073741824, "retrieve_s": 0.002}),
    ({"prompt": 16384, "device": 0, "external": 6144, "computed": 8192 + 2048,
      "source": {"external_unspecified": 6144}, "usage": 0.06, "load_bytes": 0, "store_bytes": 0},
     {"retrieves": 2, "stores": 2, "requested": 16384, "hit": 6144, "stored": 8192 + 2048, "remote_bytes": 0,
      "local_usage": 1342177280, "retrieve_s": 0.04}),
)
SGLANG_STEPS = (  # HiCache with a file L3: a 4096-token prompt, 512 from device, 1536 from host, 2048 from storage
    {"prompt": 4096, "max_total_num_tokens": 452312, "hit_rate": 0.0},
    {"prompt": 8192, "device": 512, "host": 1536, "storage": 2048, "max_total_num_tokens": 452312, "hit_rate": 0.5},
)


def write(name: str, header: str, registry: CollectorRegistry) -> None:
    (HERE / name).write_text(header + generate_latest(registry).decode())


def main() -> None:
    disable_created_metrics()  # no creation timestamps: the files are the same at every run (and multiprocess
    #                            registries, as vLLM's and SGLang's, write none either)
    for when, step in zip(("before", "after"), VLLM_STEPS):
        write(f"vllm_0.33.0_offload_{when}.prom", VLLM_SOURCE, vllm_registry(step))
    for when, (step, lmc) in zip(("before", "after"), LMCACHE_STEPS):
        registry = vllm_registry(step)
        lmcache_counters(registry, lmc)
        write(f"vllm_0.33.0_lmcache_0.5.6_{when}.prom", VLLM_SOURCE + LMCACHE_SOURCE, registry)
    # vLLM before prompt_tokens_cached_by_source (0.2x): device and connector counters only
    for when, step in zip(("before", "after"), VLLM_STEPS):
        write(f"vllm_no_by_source_{when}.prom", VLLM_SOURCE.replace("Values: one request.",
              "Written without vllm:prompt_tokens_cached_by_source, as vLLM before it has. Values: one request."),
              vllm_registry(step, by_source=False))
    for when, step in zip(("before", "after"), SGLANG_STEPS):
        write(f"sglang_0.5.23_hicache_{when}.prom", SGLANG_SOURCE, sglang_registry(step))


if __name__ == "__main__":
    main()
