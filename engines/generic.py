"""An engine kvgate does not know: each control a configured HTTP call or command, the metric map from the config.

Nothing is assumed: with no `control:` and no `metric_map:`, every ability is unavailable with the
setting that would give it, and a gate that needs one says so (placement by pressure still works
from a configured device_kv_tokens).
"""

from __future__ import annotations

from .base import EngineAdapter, EngineSpec, assemble

HINTS = {
    "clear_device_cache": "generic: set control.clear_device_cache ({http: {method, url}} or {command: ...})",
    "clear_lower_tiers": "generic: set control.clear_lower_tiers ({http: {method, url}} or {command: ...})",
    "tier_accounting": "generic: set metric_map (per tier, the /metrics counters of its hit tokens)",
}


def build(spec: EngineSpec) -> EngineAdapter:
    maps = (spec.metric_map,) if spec.metric_map is not None else ()
    return assemble(spec, "generic", {}, HINTS, maps)
