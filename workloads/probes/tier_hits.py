"""Which cache tier served a target's hits: per-tier hit blocks from its nodes' /metrics, and their shares.

kvgate's servers count every block a load served under the tier that served it
(`kvgate_cache_hits_total{tier="device"|"host"|"disk"|"remote"}`, cache_impl/server/metrics_export.py;
`remote` is the pool the nodes share). A target of several nodes counts the sum over its nodes; a
sweep step's hits are the difference of those sums read just before and just after the step
(`SweepSettings.tier_hits`), so they cover the whole step, its warm-up too (counters have no time
window). A tier's share is its hit blocks over the step's hit blocks of every tier.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from kvcore.percent import format_percent
from workloads.probes.faults import AdminClient, AdminError, per_tier
from workloads.traffic.target import Target

HIT_COUNTER = "kvgate_cache_hits_total"
POOL_TIER = "remote"
TIER_ORDER = ("device", "host", "disk", "remote")   # top-down, as the cache's levels are


def node_roots(target: Target) -> list[str]:
    """Each node's server root (its base URL without /v1)."""
    return [url.rstrip("/").removesuffix("/v1") for url in target.node_urls]


def read_tier_hits(roots: Sequence[str], timeout_s: float = 10.0) -> Optional[dict[str, float]]:
    """Hit blocks per tier so far, summed over the nodes at `roots`; None when a node's /metrics cannot be read
    or counts no tiers (a server without a cache, or not kvgate's)."""
    total: dict[str, float] = {}
    for root in roots:
        try:
            tiers = per_tier(AdminClient(root, timeout_s=timeout_s).metrics(), HIT_COUNTER)
        except (OSError, AdminError, ValueError):
            return None
        if not tiers:
            return None
        for tier, blocks in tiers.items():
            total[tier] = total.get(tier, 0.0) + blocks
    return total


def target_tier_hits(target: Target) -> Optional[dict[str, float]]:
    """`read_tier_hits` over a target's nodes (a `SweepSettings.tier_hits` reader for kvgate servers)."""
    return read_tier_hits(node_roots(target))


def tier_difference(before: Optional[Mapping[str, float]],
                    after: Optional[Mapping[str, float]]) -> Optional[dict[str, int]]:
    """Hit blocks per tier between two readings (None when either is missing), in the cache's tier order."""
    if before is None or after is None:
        return None
    tiers = sorted(set(before) | set(after), key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else 99, t))
    return {tier: int(round(after.get(tier, 0.0) - before.get(tier, 0.0))) for tier in tiers}


def tier_shares(hits: Mapping[str, float]) -> dict[str, Optional[float]]:
    """Each tier's share of the hit blocks (None for every tier when nothing hit)."""
    total = sum(hits.values())
    return {tier: (blocks / total if total else None) for tier, blocks in hits.items()}


def tier_line(hits: Optional[Mapping[str, float]], unit: str = "blocks") -> str:
    """'hits by tier: device 12%, host 0%, disk 3%, remote 85% of 1,234 blocks' ('' without a reading)."""
    if hits is None:
        return ""
    total = sum(hits.values())
    if not total:
        return f"hits by tier: no hit {unit}"
    shares = ", ".join(f"{tier} {format_percent(blocks / total, 0)}" for tier, blocks in hits.items())
    return f"hits by tier: {shares} of {total:,.0f} {unit}"
