"""vLLM (`vllm serve`), alone, with its native CPU offloading, or with a KV connector (LMCache, Mooncake).

Names from vLLM 0.33.0 (the PyPI wheel of tag v0.33.0):
- `POST /reset_prefix_cache?reset_external=<bool>` (vllm/entrypoints/serve/dev/cache/api_router.py):
  a development route, served only with VLLM_SERVER_DEV_MODE=1; answers {"success": false} while
  blocks are still held (running requests, async offload transfers). `reset_external=true` also
  resets the connector-managed (offloaded) cache.
- vllm/v1/metrics/loggers.py: `vllm:prompt_tokens_cached_by_source{source}` (device, host, disk, p2p,
  external_unspecified; sums to prefix_cache_hits + external_prefix_cache_hits),
  `vllm:prefix_cache_hits` (device), `vllm:external_prefix_cache_hits` (through the KV connector),
  `vllm:prompt_tokens`, and the info gauge `vllm:cache_config_info` whose labels are CacheConfig's
  fields (vllm/config/cache.py: num_gpu_blocks, block_size, kv_cache_size_tokens, ...).
  Counters are exposed with the `_total` suffix.
Older vLLM has no `_by_source` counter: the device and connector counters are read instead.
"""

from __future__ import annotations

import json
from typing import Optional

from workloads.probes.faults import AdminClient, CacheAdmin

from .base import Capacity, Control, EngineAdapter, EngineSpec, assemble
from .kvgate_connector import connector_controls, connector_tiers_lacking, connector_witness
from .lmcache import lmcache_controls, lmcache_map
from .metrics import MetricMap, Scrape, Series, finite_label
from .steps import ControlError, HttpStep, http_call

SOURCE = "vllm 0.33.0 vllm/v1/metrics/loggers.py"
# CacheHitSource (vllm/v1/metrics/cache_hit_source.py) -> kvgate's tiers; p2p: another instance's KV
BY_SOURCE = {"device": "device", "host": "host", "disk": "disk", "p2p": "remote", "external_unspecified": "lower"}


def vllm_maps(cache_layer: Optional[str]) -> tuple[MetricMap, ...]:
    """By source where vLLM says it; else device + connector. The connector's tier: native offloading keeps
    its KV in host DRAM; LMCache's may be host, disk or remote (folded: 'lower'); Mooncake's is the pool."""
    by_source: dict[str, list[Series]] = {}
    for source, tier in BY_SOURCE.items():
        by_source.setdefault(tier, []).append(Series("vllm:prompt_tokens_cached_by_source_total", {"source": source}))
    prompt = (Series("vllm:prompt_tokens_total"),)
    connector_tier = {None: "host", "mooncake": "remote"}.get(cache_layer, "lower")  # kvgate's: by source
    fallback = {"device": (Series("vllm:prefix_cache_hits_total"),),
                connector_tier: (Series("vllm:external_prefix_cache_hits_total"),)}
    maps = (MetricMap({tier: tuple(series) for tier, series in by_source.items()}, prompt,
                      present="vllm:prompt_tokens_cached_by_source_total", source=f"{SOURCE} (_by_source)"),
            MetricMap(fallback, prompt, present="vllm:prefix_cache_hits_total",
                      source=f"{SOURCE} (prefix_cache_hits, external_prefix_cache_hits)"))
    return (*maps, lmcache_map()) if cache_layer == "lmcache" else maps


def _success(text: str) -> Optional[str]:
    """vLLM 0.33 answers {"success": bool}; older releases an empty 200 (taken as done)."""
    try:
        body = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("success") is False:
        return "vLLM refused the reset (success: false): blocks are still held by running requests or " \
               "in-flight offload transfers; retry when the engine is idle"
    return None


DEV_MODE = {404: "vLLM serves /reset_prefix_cache only when started with VLLM_SERVER_DEV_MODE=1"}


def build(spec: EngineSpec) -> EngineAdapter:
    reset = spec.route("/reset_prefix_cache")
    controls = {"clear_device_cache": Control(HttpStep("POST", reset, None, spec.bearer, _success, DEV_MODE),
                                              ("device",))}
    missing: dict[str, str] = {}
    if spec.cache_layer in ("lmcache", "kvgate"):
        found = (lmcache_controls if spec.cache_layer == "lmcache" else connector_controls)(spec)
        controls.update(found.controls)
        missing.update(found.missing)
    else:
        # the connector's own reset: native offloading's CPU tier, or the pool's connector
        tiers = ("remote",) if spec.cache_layer == "mooncake" else ("host",)
        external = HttpStep("POST", f"{reset}?reset_external=true", None, spec.bearer, _success, DEV_MODE)
        controls["clear_lower_tiers"] = Control(external, ("device", *tiers))
    missing["host_kv_tokens"] = ("vllm: set host_kv_tokens (the CPU offload size is in bytes; the KV layout "
                                 "decides the tokens)")
    name = f"vllm+{spec.cache_layer}" if spec.cache_layer else "vllm"
    def lacking(scrape: Scrape) -> dict[str, str]:
        found = tiers_lacking(scrape, spec.cache_layer)
        return {**found, **connector_tiers_lacking(spec)} if spec.cache_layer == "kvgate" else found

    adapter = assemble(spec, name, controls, missing, vllm_maps(spec.cache_layer), {"device": device_capacity},
                       lacking)
    if spec.cache_layer == "kvgate":
        adapter.witness = connector_witness(spec)
    return adapter


def connector_cache_admin(spec: EngineSpec, model: str) -> CacheAdmin:
    """kvgate's connector inside this vLLM as G2's cold reads and G4's faults reach it: the sidecar's admin routes
    (`cache_layer_url`, the token in $KVGATE_ADMIN_TOKEN); vLLM's prefix cache emptied even under load
    (`reset_running_requests=true`: running requests are preempted and resume, from the connector's tiers); a
    chat prompt's token ids from vLLM's own /tokenize (its chat template, as the completion uses it)."""
    reset = HttpStep("POST", f"{spec.route('/reset_prefix_cache')}?reset_running_requests=true", None, spec.bearer,
                     _success, DEV_MODE)

    def chat_token_ids(messages: list) -> list[int]:
        status, text = http_call("POST", spec.route("/tokenize"), {"model": model, "messages": messages,
                                                                   "add_generation_prompt": True}, spec.bearer)
        try:
            tokens = json.loads(text)["tokens"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            tokens = None
        if not isinstance(tokens, list):
            raise ControlError(f"POST {spec.route('/tokenize')}: HTTP {status}: expected {{\"tokens\": [...]}}, "
                               f"found {text.strip()[:200]!r}")
        return tokens

    if not spec.cache_layer_url:
        raise ControlError("vllm+kvgate: cache_layer_url must name the connector's sidecar")
    return CacheAdmin(AdminClient(spec.cache_layer_url.rstrip("/")), reset.run, chat_token_ids)


CONFIG_INFO = "vllm:cache_config_info"


def _unset(value: Optional[str]) -> bool:
    return value is None or value.strip() in ("", "None", "0", "0.0")


def tiers_lacking(scrape: Scrape, cache_layer: Optional[str]) -> dict[str, str]:
    """The tiers this vLLM does not have, by `vllm:cache_config_info` (and the configured cache_layer: a KV
    connector's tiers are its own): no device reuse without prefix caching; nothing below the device without
    native offloading (kv_offloading_size) or a connector. {} when the info gauge is not on the page."""
    infos = scrape.label_values(CONFIG_INFO)
    if not infos:
        return {}
    info, lacking = infos[0], {}
    if info.get("enable_prefix_caching") == "False":
        lacking["device"] = f"{CONFIG_INFO} enable_prefix_caching=False: vLLM reuses no prefix"
    if cache_layer is None:
        none_below = "no KV connector configured (targets.<role>.cache_layer)"
        if _unset(info.get("kv_offloading_size")):
            lacking["host"] = (f"{CONFIG_INFO} kv_offloading_size={info.get('kv_offloading_size')}: no CPU offloading, "
                               f"and {none_below}")
        lacking["disk"] = f"vLLM alone keeps no KV on disk: {none_below}"
        lacking["remote"] = f"vLLM alone shares no KV pool: {none_below}"
    return lacking


def device_capacity(scrape: Scrape) -> Optional[Capacity]:
    """GPU KV tokens from `vllm:cache_config_info`: kv_cache_size_tokens where vLLM gives it, else
    num_gpu_blocks x block_size (summed over engines: data-parallel engines each hold their own); 0 with
    prefix caching off (vLLM then reuses nothing, whatever its KV pool holds while a request runs)."""
    total, how = 0, []
    infos = scrape.label_values(CONFIG_INFO)
    if infos and all(labels.get("enable_prefix_caching") == "False" for labels in infos):
        return Capacity(0, f"{CONFIG_INFO} enable_prefix_caching=False: no reusable KV")
    for labels in infos:
        tokens = finite_label(labels, "kv_cache_size_tokens")
        if tokens:
            total += int(tokens)
            how.append(f"kv_cache_size_tokens {int(tokens)}")
            continue
        blocks, size = finite_label(labels, "num_gpu_blocks"), finite_label(labels, "block_size")
        if not blocks or not size:
            return None
        total += int(blocks * size)
        how.append(f"num_gpu_blocks {int(blocks)} x block_size {int(size)}")
    return Capacity(total, "vllm:cache_config_info " + " + ".join(how)) if total else None
