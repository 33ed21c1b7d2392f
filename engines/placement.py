"""Leaving a prefix in one tier before a hit from it is measured: by route where the engine has one, else by pressure.

How it works: docs/methods/cache-and-engines.md (engines/placement.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

from .base import EngineAdapter, Unavailable
from .metrics import TIERS, MetricsError, Scrape
from .steps import StepResult

DEFAULT_MARGIN = 0.25


class PlacementError(ValueError):
    """The placement cannot be planned from what is known (a capacity missing, fillers that do not fit)."""


@dataclass(frozen=True)
class RoutePlan:
    """The controls that leave a prefix in `tier` (run in order after it is cached), and whether the read is cold."""

    tier: str
    steps: tuple[str, ...]
    cold: bool = False       # disk: the page cache is dropped too, so the hit reads the storage device
    not_cold: str = ""       # why it is not, when it is not

    def run(self, adapter: EngineAdapter) -> list[StepResult]:
        """Do the steps on the engine, in order (a failure raises ControlError and stops them)."""
        return [getattr(adapter, step)() for step in self.steps]

    def describe(self) -> str:
        cold = "; page cache dropped" if self.cold else (f"; page cache NOT dropped ({self.not_cold})"
                                                         if self.not_cold else "")
        return f"{self.tier}: {' then '.join(self.steps) or 'nothing to clear'}{cold}"


def route_plan(adapter: EngineAdapter, tier: str) -> tuple[Optional[RoutePlan], str]:
    """The route placement of a cached prefix in `tier` on this engine, or None and why there is none."""
    _check_tier(tier)
    above = set(TIERS[: TIERS.index(tier)])
    abilities = adapter.abilities()
    clearing = [abilities["clear_device_cache"], abilities["clear_lower_tiers"]]
    steps: list = []
    cleared: set[str] = set()
    for ability in clearing:  # device first: kvgate demotes what it evicts, so the host is emptied after
        if ability.available and tier not in ability.clears and set(ability.clears) & (above - cleared):
            steps.append(ability.name)
            cleared |= set(ability.clears)
    left = [t for t in TIERS if t in above - cleared]
    if left:
        reasons = [f"{a.name} empties {'/'.join(a.clears)}" if a.available else a.how
                   for a in clearing if not a.available or tier in a.clears]
        return None, (f"{adapter.engine}: no route empties {'/'.join(left)} and keeps {tier}"
                      + "".join(f"; {reason}" for reason in reasons))
    if tier != "disk":
        return RoutePlan(tier, tuple(steps)), ""
    drop = abilities["drop_disk_page_cache"]
    if drop.available:
        return RoutePlan(tier, (*steps, drop.name), cold=True), ""
    return RoutePlan(tier, tuple(steps), cold=False, not_cold=drop.how), ""


@dataclass(frozen=True)
class PressurePlan:
    """Filler prompts that push a cached prefix out of the tiers above `tier`."""

    tier: str
    pushed_through: tuple[str, ...]  # the tiers the prefix must leave
    capacity_tokens: int             # their KV capacity together
    target_tokens: int               # KV the fillers write: capacity x (1 + margin), at least
    filler_tokens: int               # prompt tokens per filler (a whole number of blocks)
    fillers: int

    @property
    def filler_total_tokens(self) -> int:
        return self.fillers * self.filler_tokens

    def describe(self) -> str:
        if not self.fillers:
            return f"{self.tier}: no filler needed"
        return (f"{self.tier}: {self.fillers} distinct fillers of {self.filler_tokens} tokens "
                f"({self.filler_total_tokens} tokens) past {'+'.join(self.pushed_through)} "
                f"({self.capacity_tokens} tokens)")


def pressure_plan(tier: str, capacities: Mapping[str, int], max_filler_tokens: int, margin: float = DEFAULT_MARGIN,
                  block_size: int = 1, target_capacity: Optional[int] = None, prefix_tokens: int = 0) -> PressurePlan:
    """The fillers that place a cached prefix in `tier` by pressure.

    `capacities`: KV tokens of the tiers above `tier` (device, and host for a disk target);
    `max_filler_tokens`: the longest prompt a filler may be (the model's context, less the output);
    each filler also fits the device, as an engine cannot hold a prompt larger than its KV pool.
    `target_capacity`: the target tier's own capacity, when known. A tier that keeps a copy of what is
    above it (write-through: kvgate's host, LMCache, HiCache's write_through) takes every filler too,
    so fillers and the prefix (`prefix_tokens`) must fit in it, else the prefix is pushed past it:
    such a plan is refused.
    """
    _check_tier(tier)
    through = TIERS[: TIERS.index(tier)]
    missing = [t for t in through if not capacities.get(t)]
    if missing:
        settable = [f"{t}_kv_tokens" for t in missing if t in ("device", "host")]
        how = f"set {', '.join(settable)} or use an engine whose metrics say it" if settable else "place it by route"
        raise PlacementError(f"placing in {tier} by pressure needs the KV capacity of {', '.join(missing)} ({how})")
    if margin < 0 or block_size < 1:
        raise PlacementError(f"expected margin >= 0 and block_size >= 1, found {margin}, {block_size}")
    if not through:
        return PressurePlan(tier, (), 0, 0, 0, 0)
    capacity = sum(int(capacities[t]) for t in through)
    fit = min(int(max_filler_tokens), int(capacities["device"]))
    filler = fit // block_size * block_size
    if filler < block_size:
        raise PlacementError(f"a filler must hold at least one block ({block_size} tokens), but the longest prompt "
                             f"allowed is {fit} tokens")
    target = math.ceil(capacity * (1 + margin))
    fillers = math.ceil(target / filler)
    if target_capacity is not None and fillers * filler + prefix_tokens > target_capacity:
        raise PlacementError(f"{fillers} fillers of {filler} tokens and the {prefix_tokens}-token prefix would "
                             f"overflow {tier} too ({target_capacity} tokens): the prefix would be pushed past it")
    return PressurePlan(tier, through, capacity, target, filler, fillers)


@dataclass(frozen=True)
class Placement:
    """How a cached prefix is left in `tier` on one engine: by route, else by pressure, else not at all (why)."""

    tier: str
    route: Optional[RoutePlan] = None
    pressure: Optional[PressurePlan] = None
    why_not_route: str = ""
    why_not_pressure: str = ""
    cold: bool = False          # disk: the page cache is dropped before the hit is measured
    not_cold: str = ""

    @property
    def possible(self) -> bool:
        return self.route is not None or self.pressure is not None

    def describe(self) -> str:
        if self.route is not None:
            return f"by route: {self.route.describe()}"
        if self.pressure is not None:
            cold = "" if self.tier != "disk" else ("; page cache dropped" if self.cold else
                                                   f"; page cache NOT dropped ({self.not_cold})")
            return f"by pressure: {self.pressure.describe()}{cold}"
        return f"{self.tier}: no placement ({self.why_not_route}; by pressure: {self.why_not_pressure})"


def plan_placement(adapter: EngineAdapter, tier: str, max_filler_tokens: int, block_size: int = 1,
                   prefix_tokens: int = 0, margin: float = DEFAULT_MARGIN,
                   scrape: Optional[Scrape] = None) -> Placement:
    """The placement of a cached prefix in `tier` on this engine: by route where it has the controls, else by
    pressure from the tiers' capacities (configured, else the engine's metrics: `scrape`, or one taken now)."""
    route, why_not_route = route_plan(adapter, tier)
    if route is not None:
        return Placement(tier, route=route, cold=route.cold, not_cold=route.not_cold)
    capacities, missing = {}, []
    needed = [*TIERS[: TIERS.index(tier)], *(("host",) if tier == "host" else ())]
    from_metrics = [t for t in needed if t not in adapter.capacities and t in adapter.capacity_from_metrics]
    if scrape is None and from_metrics and adapter.metrics_url:
        try:
            scrape = adapter.scrape()            # one page for every capacity the metrics give
        except MetricsError as error:
            missing.append(str(error))
    for name in TIERS[: TIERS.index(tier)]:
        try:
            capacities[name] = adapter.kv_tokens(name, scrape).tokens
        except (Unavailable, MetricsError, ValueError) as error:
            missing.append(str(error))
    target = _known_capacity(adapter, tier, scrape)
    try:
        pressure = pressure_plan(tier, capacities, max_filler_tokens, margin, block_size, target, prefix_tokens)
    except PlacementError as error:
        return Placement(tier, why_not_route=why_not_route, why_not_pressure="; ".join([str(error), *missing]))
    drop = adapter.ability("drop_disk_page_cache")
    cold = tier == "disk" and drop.available
    return Placement(tier, pressure=pressure, why_not_route=why_not_route, cold=cold,
                     not_cold="" if cold or tier != "disk" else drop.how)


def _known_capacity(adapter: EngineAdapter, tier: str, scrape: Optional[Scrape]) -> Optional[int]:
    """The target tier's capacity where it is known (a host); None otherwise (no disk or pool figure is kept)."""
    if tier != "host":
        return None
    try:
        return adapter.kv_tokens(tier, scrape).tokens
    except (Unavailable, MetricsError):
        return None


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier: expected one of {', '.join(TIERS)}, found {tier!r}")
