"""SGLang (`sglang.launch_server`), with or without HiCache (`--enable-hierarchical-cache`) and its L3 storage.

How it works: docs/methods/cache-and-engines.md (engines/sglang.py).
"""

from __future__ import annotations

from typing import Optional

from .base import Capacity, Control, EngineAdapter, EngineSpec, assemble
from .metrics import MetricMap, Scrape, Series
from .steps import HttpStep

SOURCE = "sglang 0.5.23 sglang/srt/observability/metrics_collector.py"
CACHED = "sglang:cached_tokens_total"


def sglang_maps(cache_layer: Optional[str]) -> tuple[MetricMap, ...]:
    storage_tier = "remote" if cache_layer == "mooncake" else "disk"
    prompt = (Series("sglang:prompt_tokens_total"),)
    tiers = {"device": (Series(CACHED, {"cache_source": "device"}),),
             "host": (Series(CACHED, {"cache_source": "host"}),),
             storage_tier: (Series(CACHED, {"cache_source": "storage"}),),
             "any": (Series(CACHED, {"cache_source": "total"}),)}
    by_source = MetricMap(tiers, prompt, present=CACHED, present_label="cache_source",
                          source=f"{SOURCE} (cache_source)")
    # SGLang before the cache_source label counted cached tokens with no breakdown
    unsplit = MetricMap({"any": (Series(CACHED),)}, prompt, present=CACHED, source=f"{SOURCE} (no cache_source)")
    return by_source, unsplit


def build(spec: EngineSpec) -> EngineAdapter:
    hicache = spec.cache_layer in ("hicache", "mooncake")
    storage_tier = "remote" if spec.cache_layer == "mooncake" else "disk"
    busy = {400: "SGLang flushes only when no request runs or waits"}
    flush = HttpStep("POST", spec.route("/flush_cache"), None, spec.bearer, hints=busy)
    controls = {"clear_device_cache": Control(flush, ("device", "host") if hicache else ("device",))}
    missing = {}
    if hicache:
        storage = HttpStep("POST", spec.route("/hicache/storage-backend/clear"), None, spec.bearer)
        controls["clear_lower_tiers"] = Control(storage, (storage_tier,))
    else:
        missing["clear_lower_tiers"] = "sglang without HiCache keeps no tier below the device"
    missing["host_kv_tokens"] = "sglang: set host_kv_tokens (HiCache sizes its host pool by --hicache-ratio/-size)"
    name = f"sglang+{spec.cache_layer}" if spec.cache_layer else "sglang"
    return assemble(spec, name, controls, missing, sglang_maps(spec.cache_layer), {"device": device_capacity})


def device_capacity(scrape: Scrape) -> Optional[Capacity]:
    """The device KV pool from `sglang:max_total_num_tokens` (one TP rank's figure: every rank holds the
    same tokens, so ranks are not summed)."""
    found = [v for (name, *_), v in scrape.samples.items() if name == "sglang:max_total_num_tokens" and v > 0]
    return Capacity(int(max(found)), "sglang:max_total_num_tokens") if found else None
