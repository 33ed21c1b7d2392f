"""One engine adapter: cache control, capacities for placement by pressure, tier accounting from /metrics.

How it works: docs/methods/cache-and-engines.md (engines/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from .metrics import TIERS, MetricMap, MetricsError, Scrape, TierHits, parse_metrics, tier_hits
from .steps import ControlError, DropLocalPages, Step, StepResult, http_call

CONTROLS = ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache")
ABILITIES = (*CONTROLS, "device_kv_tokens", "host_kv_tokens", "tier_accounting")


class Unavailable(RuntimeError):
    """An ability the engine (as configured) does not have; the message says which and why."""

    def __init__(self, engine: str, ability: str, why: str) -> None:
        super().__init__(f"{engine}: {ability} unavailable: {why}")
        self.engine, self.ability, self.why = engine, ability, why


@dataclass(frozen=True)
class Ability:
    """An ability as reported: available with how it is done, or unavailable with why."""

    name: str
    available: bool
    how: str                              # available: the call; unavailable: the reason
    clears: tuple[str, ...] = ()          # controls: the tiers the call empties


@dataclass(frozen=True)
class Control:
    """A control ability the engine has: the step that does it and the tiers it empties."""

    step: Step
    clears: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = sorted(set(self.clears) - set(TIERS))
        if unknown:
            raise ValueError(f"clears: expected tiers among {', '.join(TIERS)}, found {unknown}")


@dataclass(frozen=True)
class Capacity:
    """A tier's KV capacity in tokens and where the figure came from ("targets.candidate.device_kv_tokens",
    "vllm:cache_config_info num_gpu_blocks x block_size")."""

    tokens: int
    source: str


@dataclass
class EngineAdapter:
    """What kvgate knows of one engine endpoint: its controls, capacities and tier accounting."""

    engine: str                                       # "vllm", "vllm+lmcache", "sglang+hicache", ...
    metrics_url: Optional[str]
    controls: Mapping[str, Control] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)  # ability -> why it is unavailable
    metric_maps: tuple[MetricMap, ...] = ()
    capacities: Mapping[str, int] = field(default_factory=dict)    # "device"/"host" tokens, from the config
    capacity_from_metrics: Mapping[str, Callable[[Scrape], Optional[Capacity]]] = field(default_factory=dict)
    metrics_headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout_s: float = 30.0
    # the tiers the engine says it lacks, from its metrics ({tier: why}); None: it does not say
    tiers_lacking: Optional[Callable[[Scrape], dict[str, str]]] = None
    # a second accounting of the same hits on its own page (a cache layer's own counters: kvgate's connector
    # inside vLLM); a placed hit is verified only when both count it from the placed tier
    witness: Optional["EngineAdapter"] = None

    # -- what it can do ---------------------------------------------------------------------

    def abilities(self) -> dict[str, Ability]:
        """Every ability, available or not, with how or why."""
        found = {}
        for name in CONTROLS:
            control = self.controls.get(name)
            found[name] = (Ability(name, True, control.step.describe(), control.clears) if control is not None
                           else Ability(name, False, self._why(name)))
        for tier in ("device", "host"):
            name = f"{tier}_kv_tokens"
            if tier in self.capacities:
                found[name] = Ability(name, True, f"configured: {self.capacities[tier]} tokens")
            elif tier in self.capacity_from_metrics and self.metrics_url:
                found[name] = Ability(name, True, f"from {self.metrics_url}")
            else:
                found[name] = Ability(name, False, self._why(name))
        if self.metric_maps and self.metrics_url:
            found["tier_accounting"] = Ability("tier_accounting", True,
                                               f"{self.metrics_url} by {self.metric_maps[0].source}")
        else:
            found["tier_accounting"] = Ability("tier_accounting", False, self._why("tier_accounting"))
        return found

    def ability(self, name: str) -> Ability:
        if name not in ABILITIES:
            raise ValueError(f"ability: expected one of {', '.join(ABILITIES)}, found {name!r}")
        return self.abilities()[name]

    def _why(self, name: str) -> str:
        return self.missing.get(name) or f"{self.engine} has no way to do it configured"

    def absent_tiers(self, scrape: Optional[Scrape] = None) -> dict[str, str]:
        """The tiers this engine, as its own metrics describe it, does not have, each with why (vLLM without
        offloading or a connector keeps nothing below the device); {} when it does not say or cannot be read."""
        if self.tiers_lacking is None or not self.metrics_url:
            return {}
        try:
            return self.tiers_lacking(scrape if scrape is not None else self.scrape())
        except MetricsError:
            return {}

    def probe(self) -> dict[str, Ability]:
        """Every ability as the engine really allows it now: each available control is called once (they
        empty caches: call it before measuring), and one that fails is unavailable with what happened (vLLM's
        /reset_prefix_cache is a 404 without VLLM_SERVER_DEV_MODE=1); a control whose only tiers below the
        device are ones the engine lacks is not applicable. `restrict` applies the result."""
        found = self.abilities()
        absent = self.absent_tiers()
        for name in CONTROLS:
            control = self.controls.get(name)
            if control is None:
                continue
            below = [tier for tier in control.clears if tier != "device"]
            if below and all(tier in absent for tier in below):
                found[name] = Ability(name, False, "not applicable: " + "; ".join(absent[t] for t in below))
                continue
            try:
                self._control(name)
            except ControlError as error:
                found[name] = Ability(name, False, f"probed: {error}")
        return found

    def restrict(self, probed: Mapping[str, Mapping]) -> None:
        """Take away the controls a probe (`probe()`, as recorded: {name: {available, how}}) found unavailable."""
        for name, ability in probed.items():
            if name in self.controls and not ability.get("available", True):
                self.controls = {k: v for k, v in self.controls.items() if k != name}
                self.missing = {**self.missing, name: str(ability.get("how", "unavailable when probed"))}

    # -- cache control ------------------------------------------------------------------------

    def clear_device_cache(self) -> StepResult:
        return self._control("clear_device_cache")

    def clear_lower_tiers(self) -> StepResult:
        return self._control("clear_lower_tiers")

    def drop_disk_page_cache(self) -> StepResult:
        return self._control("drop_disk_page_cache")

    def _control(self, name: str) -> StepResult:
        control = self.controls.get(name)
        if control is None:
            raise Unavailable(self.engine, name, self._why(name))
        try:
            return control.step.run()
        except ControlError as error:
            raise ControlError(f"{self.engine}: {name}: {error}") from None

    # -- capacities (placement by pressure) -----------------------------------------------------

    def device_kv_tokens(self, scrape: Optional[Scrape] = None) -> Capacity:
        """The device tier's KV capacity in tokens: the configured figure, else the engine's metrics."""
        return self.kv_tokens("device", scrape)

    def host_kv_tokens(self, scrape: Optional[Scrape] = None) -> Capacity:
        """The host tier's KV capacity in tokens (configured, else the engine's metrics where it says)."""
        return self.kv_tokens("host", scrape)

    def kv_tokens(self, tier: str, scrape: Optional[Scrape] = None) -> Capacity:
        """A memory tier's KV capacity in tokens (device or host), or Unavailable naming what would give it."""
        name = f"{tier}_kv_tokens"
        if tier in self.capacities:
            return Capacity(int(self.capacities[tier]), f"configured {name}")
        read = self.capacity_from_metrics.get(tier)
        if read is None or not self.metrics_url:
            raise Unavailable(self.engine, name, self._why(name))
        found = read(scrape if scrape is not None else self.scrape())
        if found is None:
            raise Unavailable(self.engine, name, f"{self.metrics_url} does not say it yet; "
                              f"{self._why(name)}")
        return found

    # -- tier accounting ---------------------------------------------------------------------------

    def scrape(self) -> Scrape:
        """The engine's /metrics now."""
        if not self.metrics_url:
            raise Unavailable(self.engine, "tier_accounting", self._why("tier_accounting"))
        try:
            status, text = http_call("GET", self.metrics_url, headers=self.metrics_headers, timeout_s=self.timeout_s)
        except ControlError as error:
            raise MetricsError(str(error)) from None
        if status != 200:
            raise MetricsError(f"GET {self.metrics_url}: HTTP {status}: {text.strip()[:200]}")
        return parse_metrics(text)

    def tier_hits(self, before: Scrape, after: Scrape) -> TierHits:
        """Prompt tokens served from each tier between two scrapes of this engine."""
        if not self.metric_maps:
            raise Unavailable(self.engine, "tier_accounting", self._why("tier_accounting"))
        return tier_hits(self.metric_maps, before, after)

    def hit_totals(self) -> Optional[dict[str, float]]:
        """Hit tokens per tier since the engine started (its counters' growth from zero); None without tier
        accounting or when the page cannot be read (a sweep reads this before and after each step)."""
        if not self.metric_maps or not self.metrics_url:
            return None
        try:
            return dict(self.tier_hits(Scrape({}), self.scrape()).tiers)
        except (MetricsError, Unavailable):
            return None

    def reported_tiers(self) -> tuple[str, ...]:
        """The tiers this engine's metrics may attribute hits to, over the maps of its versions (a folded name
        covers several); which a scrape gives is in its TierHits."""
        names = dict.fromkeys(tier for m in self.metric_maps for tier in m.tiers)
        return tuple(names)


@dataclass(frozen=True)
class EngineSpec:
    """What an adapter is built from: the endpoint's address and the engine's settings (gates.yaml's
    `targets.<role>` for an external target; the harness's own figures for an embedded one)."""

    engine: str
    server_root: str                               # http://host:port, no /v1
    metrics_url: Optional[str] = None              # default: server_root + /metrics
    api_key: Optional[str] = field(default=None, repr=False)
    cache_layer: Optional[str] = None              # lmcache | hicache | mooncake
    cache_layer_url: Optional[str] = None          # LMCache's internal API server
    cache_dir: Optional[Path] = None               # the disk tier's directory, when it is on this host
    device_kv_tokens: Optional[int] = None
    host_kv_tokens: Optional[int] = None
    control: Mapping[str, Control] = field(default_factory=dict)   # configured steps (override the engine's)
    metric_map: Optional[MetricMap] = None         # generic: the configured map
    block_size: Optional[int] = None               # kvgate: tokens per block (its counters count blocks)

    @property
    def metrics(self) -> str:
        return self.metrics_url or f"{self.server_root.rstrip('/')}/metrics"

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def route(self, path: str) -> str:
        return f"{self.server_root.rstrip('/')}{path}"

    def configured_capacities(self) -> dict[str, int]:
        return {tier: tokens for tier, tokens in (("device", self.device_kv_tokens), ("host", self.host_kv_tokens))
                if tokens is not None}


def assemble(spec: EngineSpec, name: str, controls: Mapping[str, Control], missing: Mapping[str, str],
             metric_maps: tuple[MetricMap, ...], capacity_from_metrics: Optional[Mapping] = None,
             tiers_lacking: Optional[Callable[[Scrape], dict[str, str]]] = None) -> EngineAdapter:
    """The adapter an engine builder describes, with what the config adds on top: configured steps
    replace the engine's, a local `cache_dir` gives the page-cache drop, configured capacities win."""
    controls, missing = dict(controls), dict(missing)
    if spec.cache_dir is not None and "drop_disk_page_cache" not in controls:
        controls["drop_disk_page_cache"] = Control(DropLocalPages(Path(spec.cache_dir)), ())
    controls.update(spec.control)
    for ability in controls:
        missing.pop(ability, None)
    missing.setdefault("drop_disk_page_cache", f"{name}: set cache_dir (the disk tier's directory on this host) "
                       "or control.drop_disk_page_cache (a command on the storage host)")
    for tier in ("device", "host"):
        missing.setdefault(f"{tier}_kv_tokens", f"{name}: set {tier}_kv_tokens")
    return EngineAdapter(name, spec.metrics, controls, missing, metric_maps, spec.configured_capacities(),
                         dict(capacity_from_metrics or {}), spec.bearer, tiers_lacking=tiers_lacking)


__all__ = ["ABILITIES", "CONTROLS", "Ability", "Capacity", "Control", "EngineAdapter", "EngineSpec", "Unavailable",
           "assemble"]
