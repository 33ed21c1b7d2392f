"""G3's judged figures over its block pairs: per pair the candidate's TTFT p50 and throughput over the baseline's,
their geometric means and the interval valid at every look (kvcore/sequential.py). Shared by G3, which judges
its measured blocks (gates/g3_main/blocks.py), and the sizing model, which judges its simulated ones alike.

How it works: docs/methods/side-by-side.md (kvcore/block_pairs.py).
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from typing import Optional

from kvcore.g3_analysis import LevelFigures
from kvcore.sequential import METHOD, MIN_PAIRS_FOR_AN_INTERVAL, Looks, log_ratio_sequence, method


@dataclass(frozen=True)
class PairFigures(LevelFigures):
    """A level's judged figures (as `LevelFigures`) over its block pairs: how many pairs gave them, how many
    were left out and why, and the interval's method."""

    pairs: int                      # pairs that gave the figures
    left_out: int                   # pairs left out: a block invalid (or without a figure)
    left_out_reasons: str = ""
    method: str = METHOD

    def interval_of(self, metric: str) -> Optional[tuple[float, float]]:
        return {"ttft_p50_reduction": self.ttft_interval, "throughput_gain": self.throughput_interval}[metric]

    def value_of(self, metric: str) -> Optional[float]:
        return {"ttft_p50_reduction": self.ttft_reduction, "throughput_gain": self.throughput_gain}[metric]


def level_pairs(baseline: dict, candidate: dict) -> list[tuple[dict, dict]]:
    """(baseline block row, candidate block row) per pair, matched by block index, from two step rows."""
    by_block = {row["block"]: row for row in candidate.get("blocks") or []}
    return [(row, by_block[row["block"]]) for row in baseline.get("blocks") or [] if row["block"] in by_block]


def _usable(block: dict) -> bool:
    figures = (block.get("ttft_p50_s"), block.get("output_tokens_per_s"))
    return bool(block.get("valid")) and all(isinstance(f, (int, float)) and f > 0 for f in figures)


def pair_figures(pairs: list[tuple[dict, dict]], looks: Optional[Looks] = None) -> PairFigures:
    """The level's TTFT p50 reduction and throughput gain over its valid pairs, with intervals valid at every look of
    `looks` (the schedule the pairs were sampled under: `level_looks`), or (None) Lai's sequence, valid at any n."""
    usable = [(a, b) for a, b in pairs if _usable(a) and _usable(b)]
    left_out = [(k, a, b) for k, (a, b) in enumerate(pairs) if not (_usable(a) and _usable(b))]
    reasons = "; ".join(
        f"pair {k + 1}: "
        + ", ".join(
            f"{row['target']} block: {row.get('invalid_reasons') or 'no figure'}" for row in (a, b) if not _usable(row)
        )
        for k, a, b in left_out
    )
    if len(usable) < MIN_PAIRS_FOR_AN_INTERVAL:
        causes = counted_causes([row.get("invalid_reasons") or "no figure" for _, a, b in left_out for row in (a, b)
                                 if not _usable(row)])
        why = (f"{len(usable)} valid block pairs of {len(pairs)} (an interval needs {MIN_PAIRS_FOR_AN_INTERVAL})"
               + (f"; {len(left_out)} left out, their blocks: {causes}" if causes else ""))
        return PairFigures(None, None, None, None, False, why, len(usable), len(left_out), reasons, method(looks))
    ttft, (t_lo, t_hi) = log_ratio_sequence([b["ttft_p50_s"] for _, b in usable], [a["ttft_p50_s"] for a, _ in usable],
                                            looks=looks)
    tput, (g_lo, g_hi) = log_ratio_sequence([b["output_tokens_per_s"] for _, b in usable],
                                            [a["output_tokens_per_s"] for a, _ in usable], looks=looks)
    return PairFigures(1.0 - ttft, (1.0 - t_hi, 1.0 - t_lo), tput - 1.0, (g_lo - 1.0, g_hi - 1.0), True, "",
                       len(usable), len(left_out), reasons, method(looks))


def level_looks(most_blocks: int) -> Looks:
    """A level's schedule, fixed before its first block: a look after every pair from the 3rd to its most blocks
    (g3.blocks.max; at least 3)."""
    return Looks(last=max(most_blocks, MIN_PAIRS_FOR_AN_INTERVAL))


def cause(reason: str) -> str:
    """A block's invalid reason without its figures: 'client saturated', '… completed requests < minimum', 'ran out
    of requests' (the per-pair detail stays in the record)."""
    if "ran out after" in reason:
        return "ran out of requests"
    head = reason.split(":", 1)[0] if ":" in reason else reason
    head = re.sub(r"\b(in )?\d[\d,]* of \d[\d,]* ", "in some ", head)       # "disagree in 3 of 24 requests"
    return re.sub(r"\s+", " ", re.sub(r"\([^)]*\)|[-+]?\d[\d.,]*\s*(%|ms|s\b)?", "", head)).strip()


def counted_causes(reasons: list[str]) -> str:
    """'ran out of requests (5), client saturated (2)': each cause over the blocks' reasons, most frequent first."""
    counts = collections.Counter(cause(part) for reason in reasons for part in reason.split("; ") if part)
    return ", ".join(f"{name} ({count})" for name, count in counts.most_common())
