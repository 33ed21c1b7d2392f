"""kvgate's own server (`kvgate serve --admin`): its admin routes and its per-tier counters.

Routes (cache_impl/server/admin.py), all behind the admin token in the X-Kvgate-Admin-Token header:
POST /admin/cache/flush (queued lower-tier writes published), POST /admin/cache/evict
{"tiers": [...]} (device and/or host; evicted blocks are demoted, so they stay on disk), POST
/admin/cache/drop-page-cache (flushes, then drops the disk tier's files from the page cache).

Metrics (cache_impl/server/metrics_export.py): `kvgate_cache_hits_total{tier}` counts *blocks* served by
each tier (device, host, disk, remote), each hit block counted once, on the tier it came from;
`kvgate_prompt_tokens_reused_total` / `_computed_total` count tokens. A block is `block_size`
tokens (cache.block_size, 256 by default), so a tier's hit tokens are its hit blocks x block_size.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

from cache_impl.cache.config import DEFAULT_BLOCK_SIZE
from cache_impl.server.auth import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER

from .base import Capacity, Control, EngineAdapter, EngineSpec, assemble
from .metrics import MetricMap, Scrape, Series
from .steps import HttpStep, StepChain

SOURCE = "kvgate cache_impl/server/metrics_export.py (kvgate_cache_hits_total{tier}, in blocks)"


def kvgate_map(block_size: int) -> MetricMap:
    tiers = {tier: (Series("kvgate_cache_hits_total", {"tier": tier}, float(block_size)),)
             for tier in ("device", "host", "disk", "remote")}
    prompt = (Series("kvgate_prompt_tokens_computed_total"), Series("kvgate_prompt_tokens_reused_total"))
    return MetricMap(tiers, prompt, present="kvgate_prompt_tokens_reused_total", source=SOURCE)


def admin_controls(route: Callable[[str], str], headers: dict[str, str]) -> dict[str, Control]:
    """The controls kvgate's admin routes give (`route(path)`: their URL; `headers`: the admin token's), each
    flushing queued writes first: emptying the device or the host tier (evicted blocks are demoted, so they stay
    below), dropping the disk tier's pages (the route, even with cache_dir on this host: it publishes queued disk
    writes before dropping). `kvgate serve --admin`, and kvgate's connector's sidecar inside vLLM."""

    def admin(path: str, body: Optional[dict] = None) -> HttpStep:
        return HttpStep("POST", route(path), body if body is not None else {}, headers)

    def flushed_evict(tier: str) -> Control:
        return Control(StepChain((admin("/admin/cache/flush"), admin("/admin/cache/evict", {"tiers": [tier]}))),
                       (tier,))

    return {"clear_device_cache": flushed_evict("device"), "clear_lower_tiers": flushed_evict("host"),
            "drop_disk_page_cache": Control(admin("/admin/cache/drop-page-cache"), ())}


def build(spec: EngineSpec, admin_token: Optional[str] = None) -> EngineAdapter:
    """The adapter of a kvgate server; `admin_token` default: $KVGATE_ADMIN_TOKEN (where `kvgate run`
    puts the token of the servers it starts)."""
    token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
    block_size = spec.block_size or DEFAULT_BLOCK_SIZE
    controls, missing = {}, {}
    if token:
        controls = admin_controls(spec.route, {ADMIN_TOKEN_HEADER: token, **spec.bearer})
    else:
        why = (f"kvgate: the admin routes need the server's admin token in ${ADMIN_TOKEN_ENV} (and the server "
               f"started with --admin)")
        missing = dict.fromkeys(("clear_device_cache", "clear_lower_tiers"), why)
        missing["drop_disk_page_cache"] = why + ", or cache_dir on this host"
    for tier in ("device", "host"):
        missing[f"{tier}_kv_tokens"] = (f"kvgate: its metrics give the {tier} tier's size once it holds a block (modes "
                                        f"without that tier never do); or set {tier}_kv_tokens")
    return assemble(spec, "kvgate", controls, missing, (kvgate_map(block_size),),
                    {tier: functools.partial(tier_capacity, tier=tier, block_size=block_size)
                     for tier in ("device", "host")})


def tier_capacity(scrape: Scrape, tier: str, block_size: int) -> Optional[Capacity]:
    """A memory tier's capacity in tokens from its gauges: capacity bytes over bytes per held block, x block_size.
    Bytes per block from the tier itself, else from the other memory tier (device and host hold the same
    payload); None while neither holds a block (a block's size is not exported)."""
    capacity = scrape.total("kvgate_cache_capacity_bytes", {"tier": tier})
    for source in (tier, *({"device", "host"} - {tier})):
        used = scrape.total("kvgate_cache_used_bytes", {"tier": source})
        blocks = scrape.total("kvgate_cache_blocks", {"tier": source})
        if capacity and used and blocks:
            slots = round(capacity / (used / blocks))
            return Capacity(int(slots * block_size), f"kvgate_cache_capacity_bytes{{tier={tier}}} / "
                            f"{used / blocks:g} bytes per {source} block = {slots} blocks x {block_size} tokens")
    return None
