"""G2's cache figures as the report draws them: TTFT by context length per mode, the cold-read
rounds side by side with fio, and each judged ratio with its 95% interval beside its threshold and
the sizing model's prediction (made before G2 ran) where there is one.

Rows read (gates/g2_baseline): `ttft_ms` (context mode, context_tokens), `cold_read_pair` (context
round, tier_gbps or aa_gbps (A/A), fio_gbps (the best job), same_pattern_gbps); the verdicts' value, interval and rule.
"""

from __future__ import annotations

from . import plots
from .rows import GateRows, geometric, interval, number, predicted, predicted_series, series, threshold_of


def ttft_plots(rows: GateRows) -> list[str]:
    measured = series(rows.measurements, "ttft_ms", "mode", "context_tokens")
    if not measured:
        return []
    lines = [plots.Series(mode, points) for mode, points in measured.items()]
    lines += [plots.Series(f"{mode} (predicted)", points, predicted=True, key=mode)
              for mode, points in predicted_series(rows.predictions, "ttft_ms", "mode", "context_tokens").items()]
    xs = [x for points in measured.values() for x, _ in points]
    return [plots.line_chart(lines, "G2 TTFT by context length", "context length (tokens)", "TTFT (ms)",
                             log_x=geometric(xs))]


def cold_read_plots(rows: GateRows) -> list[str]:
    pairs = [m.get("context") or {} for m in rows.measurements if m.get("metric") == "cold_read_pair"]
    if not pairs:
        return []
    legs = (("tier", "disk tier cold load"), ("aa", "A/A: the best job"), ("fio", "the storage's best read job"),
            ("same_pattern", "fio in the tier's own pattern (diagnostic)"))
    sides = [plots.Series(name, [(p.get("round"), p.get(f"{side}_gbps")) for p in pairs])
             for side, name in legs if any(p.get(f"{side}_gbps") is not None for p in pairs)]
    return [plots.line_chart(sides, "G2 cold-read bandwidth, sequential pairs", "round", "GB/s")]


def judged_ratio_plots(rows: GateRows) -> list[str]:
    """Each judged fraction (unit %) with an interval or a prediction: measured, predicted, threshold."""
    dots = []
    for v in rows.verdicts:
        rule, metric = threshold_of(v), str(v.get("metric") or "")
        forecast = predicted(rows.predictions, metric)
        bounds = interval(v.get("interval"))
        if v.get("unit") != "%" or rule is None or rule.op == "==" or (bounds is None and forecast is None):
            continue
        dots.append(plots.Dot(metric.replace("_", " "), number(v.get("value")), bounds, forecast, rule.value,
                              str(v.get("status", ""))))
    if not dots:
        return []
    return [plots.dot_chart(dots, "G2 judged ratios beside their predictions",
                            "ratio (the threshold as a bar)", percent=True)]


def cache_plots(rows: GateRows) -> list[str]:
    return judged_ratio_plots(rows) + ttft_plots(rows) + cold_read_plots(rows)
