"""kvgate's tiered cache inside vLLM (`engine: vllm`, `cache_layer: kvgate`): the connector's sidecar controls.

The connector (cache_impl/vllm/vllm_connector.py) serves, on its own port (`admin_port` in vLLM's
kv_connector_extra_config; `cache_layer_url` here), kvgate's admin routes for the cache under vLLM, behind
the admin token ($KVGATE_ADMIN_TOKEN, as for `kvgate serve --admin`): POST /admin/cache/flush,
/admin/cache/evict {"tiers": ["host"]} (evicted blocks are demoted: they stay on disk),
/admin/cache/drop-page-cache. Its /metrics has kvgate_cache_* per tier and kvgate_connector_loaded_tokens
{tier}. vLLM counts the connector's hits by tier itself: the connector says where each loaded block comes
from (`vllm:prompt_tokens_cached_by_source_total{source="host"|"disk"|"p2p"}`), so the vLLM maps read them,
and the connector's own count (`connector_witness`) is the second witness G2 checks each placed hit against.
"""

from __future__ import annotations

import os
from typing import Optional

from cache_impl.server.auth import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER

from .base import EngineAdapter, EngineSpec
from .kvgate import admin_controls
from .lmcache import LayerControls
from .metrics import MetricMap, MetricsError, Scrape, Series, parse_metrics
from .steps import ControlError, http_call


def connector_controls(spec: EngineSpec, admin_token: Optional[str] = None) -> LayerControls:
    """Emptying the connector's host tier (its blocks stay on disk) and dropping its disk files' pages."""
    token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
    url = spec.cache_layer_url
    if url and token:
        root = url.rstrip("/")
        found = admin_controls(lambda path: root + path, {ADMIN_TOKEN_HEADER: token})
        return LayerControls({name: found[name] for name in ("clear_lower_tiers", "drop_disk_page_cache")})
    if not url:
        why = ("vllm+kvgate: set cache_layer_url to the connector's sidecar (http://127.0.0.1:<admin_port of "
               "kv_connector_extra_config>)")
    else:
        why = f"vllm+kvgate: the connector's admin routes need its admin token in ${ADMIN_TOKEN_ENV}"
    return LayerControls(missing={"clear_lower_tiers": why, "drop_disk_page_cache": why})


WITNESS_SOURCE = "kvgate cache_impl/vllm/vllm_connector.py (kvgate_connector_loaded_tokens_total{tier}, its sidecar)"


def connector_witness(spec: EngineSpec) -> Optional[EngineAdapter]:
    """The connector's own count of the tokens it loaded into vLLM, by tier, on its sidecar's /metrics: the second
    witness of each hit vLLM's by-source counters attribute (None without cache_layer_url)."""
    if not spec.cache_layer_url:
        return None
    loaded = MetricMap({tier: (Series("kvgate_connector_loaded_tokens_total", {"tier": tier}),)
                        for tier in ("host", "disk", "remote")}, (),
                       present="kvgate_cache_hits_total", source=WITNESS_SOURCE)
    return EngineAdapter("kvgate's connector", spec.cache_layer_url.rstrip("/") + "/metrics", metric_maps=(loaded,))


def connector_tiers_lacking(spec: EngineSpec) -> dict[str, str]:
    """The tiers the connector lacks, by its sidecar's /metrics; {} when it cannot be read (nothing is said)."""
    if not spec.cache_layer_url:
        return {}
    try:
        status, text = http_call("GET", spec.cache_layer_url.rstrip("/") + "/metrics", None, {}, 10.0)
        return connector_tiers(parse_metrics(text)) if status == 200 else {}
    except (ControlError, MetricsError):
        return {}


def connector_tiers(scrape: Scrape) -> dict[str, str]:
    """The tiers the connector lacks, by its sidecar's gauges (each tier it has reports its capacity)."""
    lacking = {}
    for tier in ("host", "disk", "remote"):
        if scrape.total("kvgate_cache_capacity_bytes", {"tier": tier}) is None and \
                scrape.total("kvgate_cache_hits_total", {"tier": tier}) is None:
            lacking[tier] = f"kvgate's connector has no {tier} tier (its sidecar's /metrics)"
    return lacking
