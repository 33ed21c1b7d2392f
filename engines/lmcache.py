"""LMCache as a cache layer under vLLM: its internal API's clear route and its hit/retrieve/store counters.

Names from LMCache 0.5.6 (the PyPI wheel; the same in LMCache/LMCache at 0353be824aeb):
- lmcache/v1/internal_api_server/vllm/cache_api.py: `DELETE /cache/clear?locations=<backend>...`
  (e.g. LocalCPUBackend, LocalDiskBackend; none: every backend), answering {"status": "success",
  "num_removed": n}. The internal API server runs with `internal_api_server_enabled: true`, the
  scheduler at internal_api_server_port_start (6999) and worker i at port_start + 1 + i; the
  worker holds the engine, so `cache_layer_url` is usually http://host:7000.
- lmcache/observability.py: counters `lmcache:num_hit_tokens`, `num_requested_tokens`,
  `num_stored_tokens`, `num_retrieve_requests`, `num_store_requests`, `num_remote_read_bytes`,
  labels model_name, worker_id, role, served_model_name. LMCache does not count hits per backend:
  its hits are one figure for host, disk and remote together ("lower"). They are on the internal
  API server's /metrics (metrics_api.py: the worker's registry), and on vLLM's when the two share
  PROMETHEUS_MULTIPROC_DIR (point metrics_url at whichever page has them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .base import Control, EngineSpec
from .metrics import MetricMap, Scrape, Series
from .steps import HttpStep, with_query

SOURCE = "LMCache 0.5.6 lmcache/observability.py (lmcache:num_hit_tokens: host, disk and remote together)"
HOST_BACKEND = "LocalCPUBackend"
TRAFFIC = {"hit_tokens": "lmcache:num_hit_tokens_total", "requested_tokens": "lmcache:num_requested_tokens_total",
           "stored_tokens": "lmcache:num_stored_tokens_total",
           "retrieve_requests": "lmcache:num_retrieve_requests_total",
           "store_requests": "lmcache:num_store_requests_total",
           "remote_read_bytes": "lmcache:num_remote_read_bytes_total"}


def lmcache_map() -> MetricMap:
    """LMCache's own counters (a scrape of its internal API server, or of vLLM without the vLLM counters).
    Each tensor-parallel worker counts the same tokens for its shard: one worker's figure (the max) is read."""
    return MetricMap({"lower": (Series(TRAFFIC["hit_tokens"], combine="max"),)},
                     (Series(TRAFFIC["requested_tokens"], combine="max"),), present=TRAFFIC["hit_tokens"],
                     source=SOURCE)


def lmcache_traffic(before: Scrape, after: Scrape) -> dict[str, float]:
    """What LMCache moved between two scrapes: hit, requested and stored tokens, requests, remote bytes read
    (one worker's figures: each tensor-parallel worker moves its own shard of the same tokens)."""
    moved = {}
    for name, metric in TRAFFIC.items():
        grown = Series(metric, combine="max").growth(before, after)
        if grown is not None:
            moved[name] = grown
    return moved


def _cleared(text: str) -> Optional[str]:
    try:
        body = json.loads(text)
    except ValueError:
        return f"expected LMCache's JSON answer, found {text.strip()[:120]!r}"
    if not isinstance(body, dict) or body.get("status") != "success":
        return f"LMCache did not clear: {body}"
    return None


@dataclass(frozen=True)
class LayerControls:
    controls: Mapping[str, Control] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)


def lmcache_controls(spec: EngineSpec) -> LayerControls:
    """Clearing LMCache's host tier through its internal API (only LocalCPUBackend: the disk stays)."""
    if not spec.cache_layer_url:
        return LayerControls(missing={"clear_lower_tiers": (
            "vllm+lmcache: set cache_layer_url to LMCache's internal API server (internal_api_server_enabled: "
            "true; worker 0 listens on internal_api_server_port_start + 1, 7000 by default)")})
    url = with_query(spec.cache_layer_url.rstrip("/") + "/cache/clear", {"locations": [HOST_BACKEND]})
    return LayerControls({"clear_lower_tiers": Control(HttpStep("DELETE", url, None, {}, _cleared), ("host",))})
