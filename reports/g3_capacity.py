"""G3's capacity search in the report: each target's TTFT and TPOT p90 against load with the SLO's limits,
its goodput curve, and a table of every probe with its decision (gates/g3_main/test_g3_slo_capacity.py).

Read from the `capacity_probe` and `capacity_users` (open loop: `capacity_rate`) measurements; a run without a capacity
search draws
nothing here.
"""

from __future__ import annotations

from kvcore.capacity import LOAD_KINDS, USERS
from kvcore.percent import format_percent
from kvcore.rundata import finite_number as number

from . import plots
from .rows import GateRows, predicted

ROLES = ("baseline", "candidate")
CAPACITIES = tuple(kind.metric for kind in LOAD_KINDS)


def _probes(rows: GateRows) -> list[dict]:
    return [r for r in rows.measurements if r.get("metric") == "capacity_probe"]


def _capacities(rows: GateRows) -> dict[str, dict]:
    return {str((r.get("context") or {}).get("target")): r for r in rows.measurements
            if r.get("metric") in CAPACITIES}


def _points(probes: list[dict], target: str, key: str) -> list[tuple[float, float]]:
    found = {}
    for row in probes:
        context = row.get("context") or {}
        load, value = number(context.get("load")), number(context.get(key))
        if context.get("target") == target and load is not None and value is not None:
            found[load] = value
    return sorted(found.items())


def _markers(rows: GateRows) -> list[tuple[float, str]]:
    """A dashed line at each target's capacity (closed brackets only), and at its prediction; one line, its labels
    joined, where two fall on the same load ("baseline predicted, candidate predicted: 6")."""
    found: dict[float, list[str]] = {}
    for target, row in _capacities(rows).items():
        load = number(row.get("value"))
        if load is not None:
            found.setdefault(load, []).append(target)
        forecast = _predicted(rows, row)
        if forecast is not None:
            found.setdefault(forecast, []).append(f"{target} predicted")
    return [(load, f"{', '.join(names)}: {load:g}") for load, names in sorted(found.items())]


def _predicted(rows: GateRows, capacity: dict) -> float | None:
    """The sizing model's capacity for the row's target, made before G3 (sizing/capacity.py)."""
    return predicted(
        rows.predictions, str(capacity.get("metric")), target=(capacity.get("context") or {}).get("target")
    )


def capacity_plots(rows: GateRows) -> list[str]:
    """TTFT p90 and TPOT p90 against load, each target a line, the SLO's limit as the band within it and each
    target's found capacity marked; then goodput against load, the SLO's percentile as the band."""
    probes = _probes(rows)
    if not probes:
        return []
    context = probes[0].get("context") or {}
    axis = _load_axis(context)
    charts = []
    for key, limit_key, name in (("ttft_p90_ms", "ttft_limit_ms", "TTFT p90"),
                                 ("tpot_p90_ms", "tpot_limit_ms", "TPOT p90")):
        lines = [plots.Series(t, points) for t in ROLES if (points := _points(probes, t, key))]
        if not lines:
            continue
        limit = number(context.get(limit_key))
        charts.append(plots.line_chart(
            lines, f"G3 capacity search: {name} by load (each probe until decided)", axis,
            f"{name} (ms)", band=(None, limit) if limit is not None else None, band_label="within the SLO",
            markers=_markers(rows), marker_label="capacity found, predicted"))
    goodput = [plots.Series(t, points) for t in ROLES if (points := _points(probes, t, "goodput"))]
    percentile = number(context.get("percentile"))
    if goodput:
        charts.append(plots.line_chart(
            goodput, "G3 capacity search: goodput by load (within the SLO / counted)",
            axis, "goodput", percent=True, y_reach=1.0,
            band=(percentile / 100, None) if percentile is not None else None, band_label="the SLO's percentile",
            markers=_markers(rows), marker_label="capacity found, predicted"))
    return charts


def capacity_tables(rows: GateRows) -> list[dict]:
    """Every probe in the order it ran: target, load, decision, requests, misses, the miss share's interval,
    TTFT and TPOT p90, goodput; then each target's capacity."""
    probes = _probes(rows)
    if not probes:
        return []
    table, statuses = [], []
    for row in probes:
        c = row.get("context") or {}
        low, high = (c.get("interval") or [None, None])[:2]
        cells = [str(c.get("target")), f"{number(c.get('load')) or 0:g}", str(c.get("decision")),
                 f"{c.get('requests')}", f"{c.get('misses')}" + (f" ({c.get('late')} late)" if c.get("late") else ""),
                 f"[{format_percent(low)}, {format_percent(high)}]" if low is not None and high is not None else "",
                 _ms(c.get("ttft_p90_ms")), _ms(c.get("tpot_p90_ms")),
                 format_percent(c["goodput"]) if number(c.get("goodput")) is not None else "",
                 f"{number(c.get('seconds')) or 0:.1f}"]
        table.append(cells)
        # a probe that misses is the search working, not a failure: only an undecided one is marked
        statuses.append("inconclusive" if c.get("decision") == "undecided" else "")
    found = []
    for target, row in _capacities(rows).items():
        forecast, measured = _predicted(rows, row), number(row.get("value"))
        error = "" if forecast is None or not measured else format_percent(forecast / measured - 1, signed=True)
        found.append([target, str((row.get("context") or {}).get("line", "")),
                      "" if forecast is None else f"{forecast:g}", error])
    first = probes[0].get("context") or {}
    slo, unit = str(first.get("slo", "")), _load_axis(first)
    return [{"title": f"Capacity search: every probe, in the order it ran (SLO: {slo})",
             "columns": ["target", unit, "decision", "requests", "misses", "miss share (95% sequence)",
                         "TTFT p90 (ms)", "TPOT p90 (ms)", "goodput", "seconds"],
             "rows": table, "statuses": statuses, "text_columns": [0, 2, 5]},
            {"title": f"Capacity within the SLO, per target: the most load decided to meet it, in {unit}, beside the "
                      "sizing model's prediction made before G3",
             "columns": ["target", "capacity", "predicted", "error"], "rows": found, "text_columns": [0, 1]}]


def _load_axis(context: dict) -> str:
    """'users (closed loop)' or 'x the trace's rate (open loop)', by the probes' recorded unit."""
    return next((kind.axis for kind in LOAD_KINDS if kind.unit == context.get("load_unit")), USERS.axis)


def _ms(value) -> str:
    value = number(value)
    return "" if value is None else f"{value:,.1f}"
