"""Steady state for side-by-side blocks: when a level's warm-up ends, and what each matched pair serves.

How it works: docs/methods/side-by-side.md (workloads/loadgen/steady.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from kvcore.percent import format_percent
from workloads.loadgen.live import format_ms
from workloads.traffic.requests import Workload, load_order, of_pass


@dataclass(frozen=True)
class SteadyRule:
    """When the candidate has stopped warming up: two of its blocks `LAG` pairs apart agree within these. Where the
    blocks carry the cached share of their prompts' whole blocks (`cached_share`: the engine's block size known),
    that share is what warms, and alone is judged: its raw hit ratio and TTFT p50 follow each segment's requests."""

    # |TTFT p50 / the block two pairs before's - 1| at most, where no cached share is known: above a steady
    # candidate's block-to-block noise (on the 2-core VM, blocks of 16-28 requests two pairs apart in steady state
    # differed by 3-29%, over 8 comparisons)
    ttft_change: float = 0.35
    hit_ratio_points: float = 0.05    # |cached share (else hit ratio) - the block before's| at most (where reported)
    max_pairs: int = 3                # warm-up pairs left out at most before the level is measured anyway

    def agree(self, before: dict, after: dict) -> bool:
        """Whether two blocks of the candidate agree (a block without a TTFT never does)."""
        share_before, share_after = before.get("cached_share"), after.get("cached_share")
        if share_before is not None and share_after is not None:
            return abs(share_after - share_before) <= self.hit_ratio_points
        ttft_before, ttft_after = before.get("ttft_p50_s"), after.get("ttft_p50_s")
        if not (isinstance(ttft_before, (int, float)) and ttft_before > 0
                and isinstance(ttft_after, (int, float)) and ttft_after > 0):
            return False
        if abs(ttft_after / ttft_before - 1.0) > self.ttft_change:
            return False
        hits_before, hits_after = before.get("hit_ratio"), after.get("hit_ratio")
        return hits_before is None or hits_after is None or abs(hits_after - hits_before) <= self.hit_ratio_points

    def describe(self) -> str:
        return (f"the candidate's cached share of its prompts' whole blocks within {self.hit_ratio_points * 100:g} "
                f"points of its block {LAG} pairs before (where its engine's block size is not known: its TTFT p50 "
                f"within ±{format_percent(self.ttft_change, 0)} and its hit ratio within "
                f"{self.hit_ratio_points * 100:g} points)")


def cached_share(records: list[dict], block_tokens: Optional[int]) -> Optional[float]:
    """The tokens the responses say were cached over their prompts' whole blocks of `block_tokens` (what any cache of
    such blocks can serve of them); None without a block size or a response that reports its cached tokens."""
    reported = [r for r in records if r.get("ok") and r.get("cached_tokens") is not None and r.get("prompt_tokens")]
    whole = sum(r["prompt_tokens"] // block_tokens * block_tokens for r in reported) if block_tokens else 0
    return sum(r["cached_tokens"] for r in reported) / whole if whole else None


@dataclass(frozen=True)
class Settled:
    """How a level's warm-up ended: pairs left out, whether the candidate settled, its blocks' figures."""

    warmup_pairs: int
    settled: bool
    trail: tuple[dict, ...]           # the candidate's warm-up blocks and the first measured one(s)
    rule: SteadyRule

    def line(self) -> str:
        """'warm-up: 1 pair left out, settled at pair 2 (TTFT p50 46 ms → 34 ms → 33 ms → 35 ms, hit ratio …)'."""
        ttft = " → ".join(format_ms(b.get("ttft_p50_s")) for b in self.trail)
        hits = [b.get("hit_ratio") for b in self.trail]
        hit_text = (", hit ratio " + " → ".join(format_percent(h, 0) for h in hits if h is not None)
                    if None not in hits else "")
        shares = [share for b in self.trail if (share := b.get("cached_share")) is not None]
        if shares and len(shares) == len(self.trail):
            hit_text += ", cached share of whole blocks " + " → ".join(format_percent(h, 0) for h in shares)
        left = f"{self.warmup_pairs} pair{'s' if self.warmup_pairs != 1 else ''} left out"
        if self.settled:
            return f"warm-up: {left}, settled at pair {self.warmup_pairs + 1} (TTFT p50 {ttft}{hit_text})"
        return (f"warm-up: {left}, not settled ({self.rule.describe()} never held: TTFT p50 {ttft}{hit_text}); "
                f"measured from pair {self.warmup_pairs + 1}")

    def to_dict(self) -> dict:
        return {"pairs": self.warmup_pairs, "settled": self.settled, "line": self.line(),
                "rule": self.rule.describe()}


LAG = 2        # pairs between the candidate blocks compared: the same place in the ABBA order


def settle(candidate_blocks: list[dict], rule: SteadyRule) -> Optional[int]:
    """The index of the first pair whose candidate block agrees with its block `LAG` pairs later (None: none yet)."""
    for k in range(len(candidate_blocks) - LAG):
        if rule.agree(candidate_blocks[k], candidate_blocks[k + LAG]):
            return k
    return None


def warm_up_end(candidate_blocks: list[dict], pairs: int, rule: SteadyRule) -> Optional[tuple[int, bool]]:
    """After `pairs` warm-up pairs: (the pairs left out, whether the candidate settled) once the warm-up is over (its
    blocks agree `settle`, or `rule.max_pairs` + `LAG` pairs ran unsettled); None while it needs another pair."""
    found = settle(candidate_blocks, rule)
    if found is not None:
        return found, True
    return (rule.max_pairs, False) if pairs >= rule.max_pairs + LAG else None


def requests_per_part(workload: Workload, users: int, rate_per_s: Optional[float], duration_s: float) -> int:
    """Requests in a matched pair's segment: what the baseline serves in about `duration_s` at `rate_per_s`
    (unknown yet: eight per user), at least two per user, at most one pass of the workload."""
    wanted = 8 * users if not rate_per_s else math.ceil(rate_per_s * duration_s)
    return max(1, min(len(workload.requests), max(2 * users, wanted)))


def order_segment(workload: Workload, start: int, count: int, passes: bool = False) -> Workload:
    """`count` requests of the workload's load order from `start`, wrapping around it, each its own one-request
    session, sent in that order: what one matched pair serves. A session's next turn stays as many requests after
    its previous one as in the whole workload, so every prefix returns at the distance it does in service.
    At most one pass of the order, unless `passes` (a capacity probe's requests): then as many as `count`, a request
    of a later pass sent again under its id with the pass added ("u3-t1~2"), as ids are unique in a workload."""
    order = load_order(workload)
    first = start % len(order)
    picked = tuple((of_pass(order[(first + i) % len(order)], (first + i) // len(order) if passes else 0),)
                   for i in range(count if passes else min(count, len(order))))
    return Workload(f"{workload.name}[{start % len(order)}:+{len(picked)}]", picked)
