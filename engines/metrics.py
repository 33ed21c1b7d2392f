"""Tier accounting from Prometheus text: a scrape, a per-engine metric map, and the hits per tier between two scrapes.

An engine says where a prompt's cached tokens came from only through its counters, and each
engine names them its own way (vLLM's `vllm:prompt_tokens_cached_by_source`, SGLang's
`sglang:cached_tokens_total{cache_source}`, kvgate's `kvgate_cache_hits_total{tier}` in blocks).
A `MetricMap` is that naming as data: for each tier, the samples whose growth is that tier's hit
tokens. Two scrapes, before and after a step, give `TierHits`: the tokens each tier served in
between. A tier an engine folds into another (LMCache reports host and disk hits together) is
reported under the folded name, so "served from the disk tier" is never claimed from it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from prometheus_client.parser import text_string_to_metric_families

# The tiers a hit is attributed to. "lower": below the device, the engine does not say which of its
# offload tiers (host, disk, pool) served it; "any": a cache hit, the engine does not say from where.
TIERS = ("device", "host", "disk", "remote")
FOLDED = {"lower": ("host", "disk", "remote"), "any": ("device", "host", "disk", "remote")}
TIER_NAMES = TIERS + tuple(FOLDED)

SampleKey = tuple  # (sample name, (label, value), ...) with the labels sorted


class MetricsError(RuntimeError):
    """A /metrics page could not be read or parsed, or two scrapes cannot be compared."""


@dataclass(frozen=True)
class Scrape:
    """Every sample of one /metrics page, as {(name, (label, value), ...): value}, and when it was read."""

    samples: Mapping[SampleKey, float]
    taken_at: float = field(default_factory=time.time)
    families: frozenset = frozenset()  # metric names declared, with or without samples yet (a labelled
    #                                    counter no request has touched has none)

    def declares(self, name: str) -> bool:
        """Whether the page has metric `name` (a sample name; a counter's `_total` family counts too)."""
        return name in self.families or name.removesuffix("_total") in self.families or any(
            key[0] == name for key in self.samples)

    def total(self, name: str, labels: Optional[Mapping[str, str]] = None, combine: str = "sum") -> Optional[float]:
        """The sum (or the max) of `name`'s samples whose labels include `labels`; None when no sample matches."""
        wanted = set((labels or {}).items())
        found = [v for (n, *pairs), v in self.samples.items() if n == name and wanted <= set(pairs)]
        if not found:
            return None
        return max(found) if combine == "max" else sum(found)

    def label_values(self, name: str) -> list[dict[str, str]]:
        """The label sets of `name`'s samples (an info gauge carries its facts there)."""
        return [dict(pairs) for (n, *pairs) in self.samples if n == name]


def parse_metrics(text: str) -> Scrape:
    """A scrape from Prometheus text exposition (prometheus_client's own parser: types, labels, escapes)."""
    samples: dict[SampleKey, float] = {}
    families = set()
    try:
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            for sample in family.samples:
                samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
    except (ValueError, TypeError, IndexError, KeyError) as error:  # whatever the parser trips on: never a traceback
        raise MetricsError(f"not Prometheus text exposition: {type(error).__name__}: {error}") from None
    return Scrape(samples, families=frozenset(families))


@dataclass(frozen=True)
class Series:
    """Samples of one metric (those whose labels include `labels`), times `scale` (e.g. blocks to tokens).

    `combine`: "sum" the matching samples (engines, tiers), or take the "max" where each process of a
    tensor-parallel group counts the same tokens for its own shard (LMCache's workers)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    scale: float = 1.0
    combine: str = "sum"

    def growth(self, before: Scrape, after: Scrape) -> Optional[float]:
        """How much the series grew between the scrapes, scaled; None when `after` has no such sample.

        A counter that went down was reset in between (a restart, or an engine that zeroes its
        metrics on a cache flush): the difference means nothing, so it is an error, not a zero."""
        now = after.total(self.name, self.labels, self.combine)
        if now is None:
            return None
        was = before.total(self.name, self.labels, self.combine) or 0.0
        if not (math.isfinite(now) and math.isfinite(was)):
            raise MetricsError(f"{self.describe()}: expected a finite counter, found {was:g} -> {now:g}")
        if now < was:
            raise MetricsError(f"{self.describe()} went down between the scrapes ({was:g} -> {now:g}): the "
                               f"engine restarted or reset its counters in between")
        return (now - was) * self.scale

    def describe(self) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        scaled = f" x {self.scale:g}" if self.scale != 1 else ""
        return f"{self.name}{{{labels}}}{scaled}" if labels else f"{self.name}{scaled}"


@dataclass(frozen=True)
class MetricMap:
    """Which samples count each tier's hit tokens (summed per tier), and the prompt tokens they are out of.

    `present` names a sample that must be in the scrape for this map to apply: engines renamed
    their counters across versions, so an adapter holds maps in order of preference."""

    tiers: Mapping[str, tuple[Series, ...]]
    prompt_tokens: tuple[Series, ...] = ()
    present: str = ""
    present_label: str = ""  # ...with this label on its samples (a counter that gained a label across versions)
    source: str = ""  # where the names come from (the engine's file and version), for the report

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tiers) - set(TIER_NAMES))
        if unknown:
            raise ValueError(f"tiers: expected names among {', '.join(TIER_NAMES)}, found {unknown}")

    def applies_to(self, scrape: Scrape) -> bool:
        name = self.present or next(s.name for series in self.tiers.values() for s in series)
        if not scrape.declares(name):
            return False
        labelled = scrape.label_values(name)
        return not self.present_label or not labelled or any(self.present_label in labels for labels in labelled)


@dataclass(frozen=True)
class TierHits:
    """Prompt tokens served from each tier between two scrapes (`tiers`), and the prompt tokens sent.

    A tier missing from `tiers` is one the engine does not report on its own (see `verifies`)."""

    tiers: Mapping[str, float]
    prompt_tokens: Optional[float] = None
    source: str = ""  # the metric map that read them

    @property
    def hit_tokens(self) -> float:
        return sum(self.tiers.values())

    def ratio(self, tier: str) -> Optional[float]:
        """The share of the prompt tokens that `tier` served (None without prompt tokens or such a tier)."""
        if not self.prompt_tokens or tier not in self.tiers:
            return None
        return self.tiers[tier] / self.prompt_tokens

    def agrees_with(self, cached_tokens: int) -> Optional[str]:
        """None when the engine's own count of a request's cached tokens (usage.prompt_tokens_details.
        cached_tokens, where it returns one) matches the hits the metrics attribute; else what differs
        (another request between the scrapes, or counters that miss a tier)."""
        if cached_tokens == self.hit_tokens:
            return None
        return (f"the response says {cached_tokens} cached tokens, the metrics attribute {self.hit_tokens:g} "
                f"({self._said()})")

    @staticmethod
    def combined(hits: "list[TierHits]") -> "TierHits":
        """A fleet's hits: each node's summed per tier (prompt tokens only when every node counts them)."""
        tiers: dict[str, float] = {}
        for node in hits:
            for tier, tokens in node.tiers.items():
                tiers[tier] = tiers.get(tier, 0.0) + tokens
        prompts = [node.prompt_tokens for node in hits if node.prompt_tokens is not None]
        return TierHits(tiers, sum(prompts) if hits and len(prompts) == len(hits) else None,
                        " + ".join(dict.fromkeys(node.source for node in hits)))

    def verifies(self, tier: str) -> tuple[Optional[bool], str]:
        """Did the hits come from `tier` alone? True, False, or None (the metrics cannot tell), with why.

        None when the engine reports no such tier, or reports the hits under a folded name that
        covers `tier` (LMCache's host/disk/remote together): a hit there may or may not be the tier's."""
        if tier not in TIERS:
            raise ValueError(f"tier: expected one of {', '.join(TIERS)}, found {tier!r}")
        covering = [name for name, inside in FOLDED.items() if tier in inside and name in self.tiers]
        if tier not in self.tiers and not covering:
            return None, f"the engine reports no {tier} hits"
        served = {name for name, tokens in self.tiers.items() if tokens > 0}
        if not served:
            return False, f"no cached tokens at all ({self._said()})"
        if served == {tier}:
            return True, f"{self.tiers[tier]:g} tokens from {tier} ({self._said()})"
        if served - {tier} - set(covering):
            return False, f"hits came from {self._said()}, not {tier} alone"
        folded = next(name for name in covering if name in served)
        return None, (f"the engine reports {self.tiers[folded]:g} tokens under '{folded}' "
                      f"({'/'.join(FOLDED[folded])} together), so {tier} cannot be told apart")

    def witnessed(self, tier: str, witness: "TierHits", engine: str, by: str) -> tuple[Optional[bool], str]:
        """`verifies(tier)`, then the same hits as a second accounting (`witness`, `by` names it: a cache layer's
        own counters) counts them: False when the two give the tier different tokens."""
        verified, why = self.verifies(tier)
        if verified is not True:
            return verified, why
        mine, theirs = self.tiers.get(tier, 0.0), witness.tiers.get(tier, 0.0)
        if mine != theirs:
            return False, f"{engine} counted {mine:g} {tier} tokens, {by} {theirs:g} ({witness._said()})"
        return True, f"{why}; {by} counted the same"

    def _said(self) -> str:
        ordered = sorted(self.tiers.items(), key=lambda item: TIER_NAMES.index(item[0]))
        return ", ".join(f"{name} {tokens:g}" for name, tokens in ordered) or "nothing reported"


def tier_hits(metric_maps: tuple[MetricMap, ...], before: Scrape, after: Scrape) -> TierHits:
    """The hit tokens per tier between two scrapes, by the first map whose metrics `after` has."""
    for metric_map in metric_maps:
        if metric_map.applies_to(after):
            return _apply(metric_map, before, after)
    wanted = ", ".join(m.present or next(iter(m.tiers)) for m in metric_maps)
    raise MetricsError(f"the scrape has none of the metrics the map reads (looked for {wanted})")


def _apply(metric_map: MetricMap, before: Scrape, after: Scrape) -> TierHits:
    tiers = {}
    for tier, series in metric_map.tiers.items():
        grown = [g for g in (s.growth(before, after) for s in series) if g is not None]
        tiers[tier] = sum(grown) if grown else 0.0
    prompts = [g for g in (s.growth(before, after) for s in metric_map.prompt_tokens) if g is not None]
    return TierHits(tiers, sum(prompts) if prompts else None, metric_map.source)


def finite_label(labels: Mapping[str, str], name: str) -> Optional[float]:
    """A number an info gauge carries as a label value ("None", "" or a non-number: None)."""
    try:
        value = float(labels.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None
