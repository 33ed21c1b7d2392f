"""Reading a gate's run rows (measurements, verdicts, predictions) into what the report draws.

Rows are located by their `context` keys (kvcore.rundata names them), never by their reason text.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

from kvcore.predictions import made_before
from kvcore.rules import Band, Rule, Threshold, stored_rule
from kvcore.rundata import RunStore
from kvcore.rundata import finite_number as number

Points = list[tuple[float, float]]


@dataclass(frozen=True)
class GateRows:
    """One gate's rows as the plot and table builders read them; `predictions` are the sizing model's
    figures for this gate made before it ran (predictions.jsonl, stage "before <gate>")."""

    gate: str
    verdicts: list[dict]
    measurements: list[dict]
    unjudged: list[dict]
    predictions: list[dict]
    store: RunStore


def gate_rows(gate: dict, store: RunStore, predictions: list[dict]) -> GateRows:
    """A gate's rows from its results entry and the run's predictions."""
    name = gate["gate"]
    return GateRows(name, gate["verdicts"], gate["measurements"], gate["unjudged"], made_before(predictions, name),
                    store)


def interval(value: Any) -> Optional[tuple[float, float]]:
    """A stored [lo, hi] as numbers, or None."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        lo, hi = number(value[0]), number(value[1])
        if lo is not None and hi is not None:
            return lo, hi
    return None


def rule_of(row: dict) -> Optional[Rule]:
    return stored_rule(row.get("rule"))


def threshold_of(row: dict) -> Optional[Threshold]:
    rule = rule_of(row)
    return rule if isinstance(rule, Threshold) else None


def accepted(rule: Optional[Rule]) -> Optional[tuple[Optional[float], Optional[float]]]:
    """Where a figure passes, as a band (lo, hi) with None for an open side; None for `==` or no rule."""
    if isinstance(rule, Band):
        return rule.min, rule.max
    if isinstance(rule, Threshold) and rule.op in (">=", ">"):
        return rule.value, None
    if isinstance(rule, Threshold) and rule.op in ("<=", "<"):
        return None, rule.value
    return None


def series(rows: list[dict], metric: str, group: str, x_key: str) -> dict[str, Points]:
    """Median value per (group, x) of one metric; group and x come from each row's context."""
    buckets: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        context = row.get("context") or {}
        x, y = number(context.get(x_key)), number(row.get("value"))
        if row.get("metric") != metric or x is None or y is None:
            continue
        name = str(context.get(group) or row.get("check") or metric)
        buckets.setdefault(name, {}).setdefault(x, []).append(y)
    return {name: [(x, statistics.median(ys)) for x, ys in sorted(points.items())] for name, points in buckets.items()}


def unit_of(rows: list[dict], metric: str) -> str:
    return next((str(m.get("unit") or "") for m in rows if m.get("metric") == metric), "")


def geometric(xs: list[float]) -> bool:
    """Whether x values spread widely enough (8× or more) for a logarithmic axis."""
    return bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 8


ACRONYMS = {"ttft", "itl", "tpot", "e2e", "rss", "kv", "gpu", "cpu", "fio"}


def metric_words(metric: str, unit: str = "") -> str:
    """"ttft_p99_ms" with unit "ms" → "TTFT p99"; "output_tokens_per_s" → "output tokens/s"."""
    words = metric.split("_")
    if len(words) > 1 and words[-1] in {unit.lower(), "ms", "mib", "gib", "gbps", "pct", "fraction"}:
        words = words[:-1]
    return " ".join(word.upper() if word in ACRONYMS else word for word in words).replace(" per s", "/s")


def predicted(predictions: list[dict], metric: str, **context: Any) -> Optional[float]:
    """The last prediction of `metric` whose context holds every given key and value."""
    for row in reversed(predictions):
        where = row.get("context") or {}
        if row.get("metric") == metric and all(where.get(k) == v for k, v in context.items()):
            return number(row.get("value"))
    return None


def predicted_series(predictions: list[dict], metric: str, group: str, x_key: str) -> dict[str, Points]:
    """Predicted values per group (a target) along x (a level), as `series` reads measurements."""
    return series([p for p in predictions if "value" in p], metric, group, x_key)
