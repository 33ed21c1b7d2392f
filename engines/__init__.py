"""Engine adapters: what kvgate knows of kvgate, vLLM, SGLang (with LMCache, HiCache, Mooncake) and generic engines.

`build_adapter(spec)` gives an `EngineAdapter` (engines/base.py) for an `EngineSpec`;
`spec_from_endpoint` makes the spec of an external target from gates.yaml, `embedded_spec` of
one of the harness's own `kvgate serve` processes. Placement by pressure is placement.py.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union
from urllib.parse import urlsplit

from workloads.probes.faults import AdminClient, CacheAdmin
from workloads.probes.tier_hits import read_tier_hits

from .base import ABILITIES, CONTROLS, Ability, Capacity, Control, EngineAdapter, EngineSpec, Unavailable
from .metrics import TIERS, MetricMap, MetricsError, Scrape, Series, TierHits, parse_metrics
from .settings import ENGINES, ControlStep, RunEndpoint, TargetSettings, TargetsOf, role_settings
from .steps import CommandStep, ControlError, HttpStep, StepResult
from .vllm import connector_cache_admin

if TYPE_CHECKING:
    from workloads.probes.faults import CacheAdmin



def build_adapter(spec: EngineSpec) -> EngineAdapter:
    """The adapter of `spec.engine`, built by the module of that name (ValueError naming the engines when it is
    none of them)."""
    if spec.engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, found {spec.engine!r}")
    return importlib.import_module(f".{spec.engine}", __name__).build(spec)


def spec_from_endpoint(endpoint: TargetSettings) -> EngineSpec:
    """The spec of an external target from its validated gates.yaml section (engines.settings.TargetSettings)."""
    api_key = os.environ.get(endpoint.api_key_env) if endpoint.api_key_env else None
    root = endpoint.url.rstrip("/").removesuffix("/v1")
    control = {name: Control(_step(step, root, api_key), tuple(clears))
               for name, (step, clears) in endpoint.control.steps().items()}
    metric_map = None
    if endpoint.metric_map is not None:
        config = endpoint.metric_map
        tiers = {tier: tuple(Series(s.metric, s.labels, s.scale) for s in series)
                 for tier, series in config.tiers().items()}
        prompt = tuple(Series(s.metric, s.labels, s.scale) for s in config.prompt_tokens or ())
        metric_map = MetricMap(tiers, prompt, source="the configured metric_map")
    return EngineSpec(endpoint.engine, root, endpoint.metrics_endpoint,
                      api_key, endpoint.cache_layer, endpoint.cache_layer_url, endpoint.cache_dir,
                      endpoint.device_kv_tokens, endpoint.host_kv_tokens, control, metric_map)


def embedded_spec(server_root: str, cache_dir: Optional[Path] = None, device_kv_tokens: Optional[int] = None,
                  host_kv_tokens: Optional[int] = None, block_size: Optional[int] = None) -> EngineSpec:
    """The spec of a `kvgate serve --admin` the harness started (its disk tier's directory is on this host)."""
    return EngineSpec("kvgate", server_root.rstrip("/").removesuffix("/v1"), cache_dir=cache_dir,
                      device_kv_tokens=device_kv_tokens, host_kv_tokens=host_kv_tokens, block_size=block_size)


def endpoint_adapter(config: TargetsOf, endpoint: RunEndpoint) -> EngineAdapter:
    """The adapter of one of a run's endpoints (gates.targets.Endpoint): a `kvgate serve --admin` the harness
    started (its admin routes; its disk tier's directory on this host), else the external target's
    configured engine (`targets.<role>` in gates.yaml)."""
    if endpoint.admin:
        cache_dir = Path(endpoint.cache_dir) if endpoint.cache_dir else None
        return build_adapter(embedded_spec(endpoint.server_root, cache_dir=cache_dir))
    return build_adapter(spec_from_endpoint(role_settings(config, endpoint.role)))


def cache_admin(config: TargetsOf, endpoint: RunEndpoint) -> Optional["CacheAdmin"]:
    """kvgate's admin routes over an endpoint's cache (workloads.probes.faults.CacheAdmin), where its cache is
    kvgate's: a `kvgate serve --admin` the harness started, or vLLM with kvgate's connector and its sidecar
    (`cache_layer: kvgate`, `cache_layer_url`); None for any other cache (its disk reads are not exported, faults
    cannot be injected into it)."""
    if endpoint.admin:
        return CacheAdmin(AdminClient(endpoint.server_root))
    settings = role_settings(config, endpoint.role)
    if settings.engine == "vllm" and settings.cache_layer == "kvgate" and settings.cache_layer_url:
        return connector_cache_admin(spec_from_endpoint(settings), settings.model)
    return None


def hit_reader(endpoint: RunEndpoint, adapter: EngineAdapter, config: Optional[TargetsOf] = None,
               ) -> tuple[Callable[[], Optional[dict]], str]:
    """How a gate reads a target's hits per tier so far, and what they count: an embedded target's kvgate
    counters summed over its nodes (blocks), else its engine's tier accounting (tokens; None without one),
    summed over an external target's nodes (`targets.candidate_nodes`: each node's own /metrics, the
    endpoint's engine settings) when `config` is given."""
    if endpoint.admin:
        return (lambda: read_tier_hits(endpoint.node_roots)), "blocks"
    roots = endpoint.node_roots
    if len(roots) < 2 or config is None:
        return adapter.hit_totals, "tokens"
    spec = spec_from_endpoint(role_settings(config, endpoint.role))
    nodes = [adapter, *(build_adapter(replace(spec, server_root=root, metrics_url=None)) for root in roots[1:])]

    def read() -> Optional[dict]:
        read_totals = [node.hit_totals() for node in nodes]
        totals = [total for total in read_totals if total is not None]
        if len(totals) < len(read_totals):     # a node that cannot be read: no figure, not a partial one
            return None
        return {tier: sum(total.get(tier, 0.0) for total in totals) for tier in dict.fromkeys(
            tier for total in totals for tier in total)}

    return read, "tokens"


def _step(step: ControlStep, root: str, api_key: Optional[str]) -> Union[CommandStep, HttpStep]:
    """A configured step; an HTTP call to the endpoint's own server carries its API key (to another host, never)."""
    if step.command is not None:
        return CommandStep(step.command)
    if step.http is None:       # ControlStep holds one of the two
        raise ValueError("control step: expected an http call or a command, found neither")
    same_server = _origin(step.http.url) == _origin(root)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key and same_server else {}
    return HttpStep(step.http.method, step.http.url, step.http.body, headers)


def _origin(url: str) -> tuple:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


__all__ = ["ABILITIES", "CONTROLS", "ENGINES", "TIERS", "Ability", "Capacity", "CommandStep", "Control", "ControlError",
           "EngineAdapter", "EngineSpec", "HttpStep", "MetricMap", "MetricsError", "Scrape", "Series", "StepResult",
           "TierHits", "Unavailable", "build_adapter", "cache_admin", "embedded_spec", "endpoint_adapter",
           "hit_reader", "parse_metrics", "spec_from_endpoint"]
