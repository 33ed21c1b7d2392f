"""G4 as the report shows it: each windowed figure over the soak with the injected faults marked and
the windows left out of the drift checks shaded, and the faults as a table.

Rows read (gates/g4_soak): `window_*` (context target, window_start_s), `drift_excluded_window`
(context window, window_start_s, window_end_s, reason), and `fault`, one per injected fault (value 1
when handled; context kind, at_s, detected_by, detected_count, answer_unchanged, probe_cached_tokens,
probe_prompt_tokens, recovered_after_s, error). A fault row recorded before the typed fields existed
shows "not recorded" in their columns: the renderer never reads the outcome's words.
"""

from __future__ import annotations

from typing import Any, Optional

from . import plots
from .rows import GateRows, metric_words, number, series, unit_of

NOT_RECORDED = "not recorded"


def _scale(span_s: float) -> tuple[float, str]:
    return (3600.0, "h") if span_s >= 3 * 3600 else (60.0, "min") if span_s >= 600 else (1.0, "s")


def window_plots(rows: GateRows) -> list[str]:
    measurements = rows.measurements
    metrics = sorted({str(m.get("metric")) for m in measurements if str(m.get("metric", "")).startswith("window_")},
                     key=lambda metric: (metric != "window_ttft_p99_ms", metric))
    faults, left_out = fault_markers(measurements), left_out_spans(measurements)
    charts = []
    for metric in metrics:
        found = series(measurements, metric, "target", "window_start_s")
        if not found:
            continue
        scale, label = _scale(max(x for points in found.values() for x, _ in points))
        lines = [plots.Series(name, [(x / scale, y) for x, y in points]) for name, points in found.items()]
        markers = [(at / scale, kind) for at, kind in faults]
        spans = [(a / scale, b / scale, words) for a, b, words in left_out]
        unit = unit_of(measurements, metric) or _unit_in_name(metric)
        name = metric_words(metric.removeprefix("window_"), unit)
        charts.append(plots.line_chart(lines, f"G4 windowed {name}", f"time since the soak's start ({label})",
                                       f"{name} ({unit})" if unit else name, markers=markers, spans=spans,
                                       marker_label="fault" if len(markers) == 1 else "faults",
                                       span_label="left out of the drift checks (warm-up, faults)"))
    return charts


def fault_markers(measurements: list[dict]) -> list[tuple[float, str]]:
    """(seconds since the soak's start, kind) of each injected fault."""
    found = [(number((m.get("context") or {}).get("at_s")), str((m.get("context") or {}).get("kind") or "fault"))
             for m in measurements if m.get("metric") == "fault"]
    return [(at, kind) for at, kind in found if at is not None]


def left_out_spans(measurements: list[dict]) -> list[tuple[float, float, str]]:
    """(from, to, which window) in seconds of each window the drift checks left out."""
    spans = []
    for m in measurements:
        context = m.get("context") or {}
        start, end = number(context.get("window_start_s")), number(context.get("window_end_s"))
        if m.get("metric") == "drift_excluded_window" and start is not None and end is not None:
            spans.append((start, end, f"window {context.get('window')}"))
    return spans


def _unit_in_name(metric: str) -> str:
    """The unit a window metric's name ends with (window_rss_mib → MiB) when its rows carry none."""
    if metric.endswith("_per_s"):
        return ""  # a rate: its name says it (output tokens/s)
    return {"ms": "ms", "mib": "MiB"}.get(metric.rsplit("_", 1)[-1], "")


def _yes_no(value: Any) -> str:
    return NOT_RECORDED if value is None else ("yes" if value else "NO")


def _detected(context: dict) -> str:
    counter = context.get("detected_by")
    if "detected_by" not in context:
        return NOT_RECORDED
    if counter is None:
        return "—"
    count = number(context.get("detected_count"))
    return f"{counter} (+{count:g})" if count else f"NOT detected ({counter} did not move)"


def _answer(context: dict) -> str:
    if "answer_unchanged" not in context:
        return NOT_RECORDED
    if context.get("answer_unchanged") is None:
        return "—"
    cached, prompt = number(context.get("probe_cached_tokens")), number(context.get("probe_prompt_tokens"))
    share = f" ({cached:g} of {prompt:g} prompt tokens from cache)" if cached is not None and prompt else ""
    reprobes = number(context.get("reprobes"))
    again = (f"; asked again {reprobes:g}× past an upper tier's whole copy of the damaged block"
             if reprobes else "")
    return _yes_no(context.get("answer_unchanged")) + share + again


def _recovered(context: dict) -> str:
    after: Optional[float] = number(context.get("recovered_after_s"))
    if after is not None:
        return f"{after:.1f} s"
    return "not recovered" if "detected_by" in context else NOT_RECORDED


def fault_tables(rows: GateRows) -> list[dict]:
    faults = sorted((m for m in rows.measurements if m.get("metric") == "fault"),
                    key=lambda m: number((m.get("context") or {}).get("at_s")) or 0.0)
    if not faults:
        return []
    table, statuses = [], []
    for m in faults:
        context = m.get("context") or {}
        at = number(context.get("at_s"))
        handled = number(m.get("value"))
        table.append([str(context.get("kind") or ""), "" if at is None else f"{at:g} s", _detected(context),
                      _answer(context), _recovered(context), str(context.get("error") or ""),
                      "PASS" if handled else "FAIL"])
        statuses.append("PASS" if handled else "FAIL")
    return [{"title": "Injected faults", "columns": ["fault", "at", "detected by", "answer unchanged",
                                                     "recovered after", "injection error", "handled"],
             "rows": table, "statuses": statuses, "text_columns": [0, 2, 3, 5], "badge_column": 6}]
