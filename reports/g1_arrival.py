"""G1 as the report shows it: each judged figure against the spec sheet in one table (measured, spec,
measured / spec, verdict), and one chart of headroom over the spec on a single unitless axis.

A table, because G1's figures have as many units as checks (cores, GiB, GB/s, IOPS, ms, errors):
bars of them on shared axes compare nothing. Headroom is comparable across them: measured / spec
for a floor (≥), spec / measured for a ceiling (≤), so right of 1× passes for every check.
A check with an exact rule (`== 0` verify errors) has no headroom and is in the table only.
"""

from __future__ import annotations

from typing import Optional

from kvcore.checks import CHECKS
from kvcore.rules import SYMBOLS

from . import plots
from .rows import GateRows, number, threshold_of

MEANINGS = {check.metric: check.meaning for check in CHECKS["g1"]}


def _figure(value: Optional[float], unit: str) -> str:
    if value is None:
        return ""
    text = plots.fmt_tick(value) if abs(value) >= 1000 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def ratio(measured: Optional[float], spec: Optional[float]) -> Optional[float]:
    """measured / spec; None when either is missing or the spec is 0 (a ratio to nothing)."""
    if measured is None or spec is None or spec == 0:
        return None
    return measured / spec


def headroom(measured: Optional[float], op: str, spec: Optional[float]) -> Optional[float]:
    """How many times the spec a figure clears it by (> 1 passes): measured / spec for ≥, spec / measured for ≤."""
    if op in (">=", ">"):
        return ratio(measured, spec)
    if op in ("<=", "<") and measured:
        return ratio(spec, measured)
    return None


def spec_table(rows: GateRows) -> list[dict]:
    """Every judged G1 figure beside its spec, then the figures measured with no rule."""
    table = []
    statuses = []
    for v in rows.verdicts:
        rule = threshold_of(v)
        unit = str(v.get("unit") or "")
        measured, spec = number(v.get("value")), rule.value if rule else None
        quotient = ratio(measured, spec)
        metric = str(v.get("metric") or "")
        table.append([MEANINGS.get(metric, str(v.get("check") or metric)), metric, _figure(measured, unit),
                      f"{SYMBOLS[rule.op]} {_figure(spec, unit)}" if rule else "",
                      "" if quotient is None else f"{quotient:.3g}×", str(v.get("status", ""))])
        statuses.append(str(v.get("status", "")))
    for u in rows.unjudged:
        metric = str(u.get("metric") or "")
        table.append([MEANINGS.get(metric, str(u.get("label") or metric)), metric,
                      _figure(number(u.get("value")), str(u.get("unit") or "")), "no rule", "", "not judged"])
        statuses.append("not judged")
    if not table:
        return []
    return [{"title": "Measured against the spec sheet",
             "columns": ["check", "metric", "measured", "spec", "measured / spec", "verdict"],
             "rows": table, "statuses": statuses, "text_columns": [0, 1], "badge_column": 5}]


def headroom_plots(rows: GateRows) -> list[str]:
    bars = []
    for v in rows.verdicts:
        rule = threshold_of(v)
        clear = headroom(number(v.get("value")), rule.op, rule.value) if rule else None
        if clear is not None and clear > 0:
            bars.append(plots.Bar(str(v.get("metric") or v.get("check")), clear, status=str(v.get("status", ""))))
    if not bars:
        return []
    return [plots.bar_chart(bars, "G1 headroom over the spec sheet", "× the spec (measured / spec; ≤ checks: "
                            "spec / measured); right of 1× passes", line=(1.0, "the spec (1×)"), log=True,
                            horizontal=True)]
