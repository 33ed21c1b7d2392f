"""G2's matrix on any candidate: a prefix cached, left in one tier, then asked for again, and the hit checked.

For each context length: the prefix is sent once (a miss: the engine computes and stores it), then each
round places it in the host tier and asks for it (a host hit), then places it on disk with its pages dropped
and asks for it (a cold disk hit). Placement goes through the candidate's engine adapter
(engines/placement.py): by route where the engine has the controls (kvgate's admin routes,
vLLM's /reset_prefix_cache, SGLang's /flush_cache), else by pressure (filler prompts whose KV exceeds
the tiers above the target). Each hit is then checked against the engine's tier accounting, two
scrapes of its /metrics around the request: `verified` is True when the hit came from the placed tier
alone, False when it came from elsewhere, None when the metrics cannot tell (no accounting, a folded
tier, a failed scrape), with the reason. A tier the engine cannot place in is not measured, and says
why; nothing here passes or skips silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engines import ControlError, EngineAdapter, MetricsError, Unavailable
from engines.placement import Placement, plan_placement
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest

PLACED = {"host-hit": "host", "disk-cold": "disk"}    # mode -> the tier its prefix is left in


class HitError(RuntimeError):
    """A request of the matrix failed (the message names it)."""


@dataclass(frozen=True)
class Hit:
    """One request of the matrix: its TTFT, what was cached, and whether the placed tier served it."""

    mode: str
    context_tokens: int
    round: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: Optional[int]        # the response's usage.prompt_tokens_details.cached_tokens (None: not said)
    tier_tokens: dict = field(default_factory=dict)   # the tier accounting's hit tokens per tier
    verified: Optional[bool] = None     # the hit came from the placed tier alone (None: cannot tell)
    why: str = ""

    @property
    def hit_tokens(self) -> Optional[float]:
        """Cached tokens as the response says them, else as the tier accounting counts them."""
        if self.cached_tokens is not None:
            return self.cached_tokens
        return sum(self.tier_tokens.values()) if self.tier_tokens else None


@dataclass
class PlacedHits:
    """The candidate's side of the matrix: its adapter, its client, how each tier is placed."""

    adapter: EngineAdapter
    client: StreamingClient
    placements: dict[str, Placement]                   # mode -> placement
    filler: Callable[[int, str], WorkloadRequest]      # (tokens, tag) -> a distinct filler prompt
    absent: dict[str, str] = field(default_factory=dict)   # tier -> why the engine has none (its own metrics)

    @classmethod
    def plan(cls, adapter: EngineAdapter, client: StreamingClient, longest: int, block_size: int,
             filler: Callable[[int, str], WorkloadRequest]) -> "PlacedHits":
        """Each tier's placement on this engine; fillers (by pressure) at most as long as the longest context."""
        placements = {mode: plan_placement(adapter, tier, max_filler_tokens=longest, block_size=block_size,
                                           prefix_tokens=longest) for mode, tier in PLACED.items()}
        return cls(adapter, client, placements, filler, adapter.absent_tiers())

    def not_applicable(self, mode: str) -> str:
        """Why `mode` does not apply to this engine: it has no such tier, by its own metrics ("" when it does or
        does not say). Said, not judged."""
        why = self.absent.get(PLACED[mode])
        return f"not applicable: {self.adapter.engine} has no {PLACED[mode]} tier ({why})" if why else ""

    def unplaced(self, mode: str) -> str:
        """Why `mode` cannot be measured on this engine although it has the tier ("" when it can)."""
        placement = self.placements[mode]
        if self.not_applicable(mode) or placement.possible:
            return ""
        return f"{self.adapter.engine}: {placement.describe()}"

    def miss(self, request: WorkloadRequest) -> None:
        """The first ask: the engine computes and stores the prefix."""
        self._send(request, "miss")

    def hit(self, mode: str, request: WorkloadRequest, tokens: int, round_: int) -> Hit:
        """Place the (cached) prefix for `mode`, then ask for it again and check which tier served it."""
        placement = self.placements[mode]
        try:
            self._place(placement, f"{mode}/{tokens}/{round_}")
        except (ControlError, Unavailable) as error:
            raise HitError(f"placing the prefix for {mode} at {tokens} tokens: {error}") from None
        before, why = self._scrape()
        witness_before, witness_why = self._witness_scrape()
        record = self._send(request, f"{mode} at {tokens} tokens")
        after, why_after = self._scrape() if before is not None else (None, why)
        tier_tokens, verified, why = {}, None, why or why_after
        if before is not None and after is not None:
            try:
                counted = self.adapter.tier_hits(before, after)
                tier_tokens = dict(counted.tiers)
                verified, why = counted.verifies(placement.tier)
                witness = self.adapter.witness
                if witness is not None and witness_before is None:
                    verified, why = None, witness_why
                elif witness is not None:
                    seen = witness.tier_hits(witness_before, witness.scrape())
                    verified, why = counted.witnessed(placement.tier, seen, self.adapter.engine, witness.engine)
            except (MetricsError, Unavailable, ValueError) as error:
                verified, why = None, str(error)
        return Hit(mode, tokens, round_, record.ttft_s, record.prompt_tokens or 0, record.cached_tokens,
                   tier_tokens, verified, why)

    def _place(self, placement: Placement, tag: str) -> None:
        if placement.route is not None:
            placement.route.run(self.adapter)
            return
        plan = placement.pressure
        if plan is None:
            raise HitError(f"placing a prefix: {placement.describe()}")
        for i in range(plan.fillers):
            self._send(self.filler(plan.filler_tokens, f"{tag}/filler/{i}"), "filler")
        if placement.tier == "disk" and placement.cold:
            self.adapter.drop_disk_page_cache()

    def _scrape(self):
        """The engine's metrics now, or None and why not (no accounting, a failed scrape)."""
        if not self.adapter.ability("tier_accounting").available:
            return None, f"no tier accounting: {self.adapter.ability('tier_accounting').how}"
        try:
            return self.adapter.scrape(), ""
        except (MetricsError, Unavailable) as error:
            return None, f"the metrics scrape failed: {error}"

    def _witness_scrape(self):
        """The second accounting's page now, or None and why not (none configured: ""; a failed scrape leaves
        the hit unverified)."""
        witness = self.adapter.witness
        if witness is None:
            return None, ""
        try:
            return witness.scrape(), ""
        except (MetricsError, Unavailable) as error:
            return None, f"{witness.engine}'s metrics scrape failed: {error}"

    def _send(self, request: WorkloadRequest, what: str):
        record = self.client.send(request)
        if not record.ok:
            raise HitError(f"G2 {what} request failed: {record.error_type}: {record.error_message}")
        return record
