"""G3 as the report draws it: each target's figures by level with the sizing model's prediction beside
them, each judged figure with its interval against its accepted band, and the TTFT and E2E
distributions of every step (an empirical CDF per target, a panel per level). Per level, how its
block pairs were sampled: blocks run, decided after N blocks or why not, the interval and its method
(`sampling_tables`), and each block (`block_tables`). An A/A run opens the section with its count
of intervals that excluded 0 (kvcore.aa).

How it works: docs/methods/measurement.md (reports/g3_main.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcore.aa import false_decision_line
from kvcore.percent import format_percent
from kvcore.rundata import read_records

from . import plots
from .rows import GateRows, accepted, geometric, interval, metric_words, number, predicted_series, rule_of, series

FIGURES = (("ttft_p50_ms", "TTFT p50", "TTFT p50 (ms)", False),
           ("output_tokens_per_s", "output throughput", "output throughput (tokens/s)", False),
           ("hit_ratio", "prefix-cache hit ratio", "prompt tokens served from cache", True))
DISTRIBUTIONS = (("ttft_s", "TTFT"), ("e2e_s", "E2E latency"))
STEP_PREFIX = {"concurrency": "c", "multiplier": "x"}   # the sweep's step directories (workloads.loadgen.sweep)


@dataclass(frozen=True)
class Level:
    key: str      # "concurrency" or "multiplier": the rows' context key
    axis: str     # the x axis title
    words: str    # "concurrency", "rate multiplier"

    def label(self, value: float) -> str:
        return f"c={value:g}" if self.key == "concurrency" else f"×{value:g} the trace's rate"


def level_of(rows: list[dict]) -> Level:
    """What G3's levels are in this run: concurrencies, or multipliers of a trace's arrival rate."""
    if any("multiplier" in (row.get("context") or {}) for row in rows):
        return Level("multiplier", "rate multiplier (× the trace's arrival rate)", "rate multiplier")
    return Level("concurrency", "concurrency", "concurrency")


def figure_plots(rows: GateRows, level: Level) -> list[str]:
    """Per figure: a line per target by level, and its prediction dashed beside it."""
    charts = []
    for metric, name, y_label, percent in FIGURES:
        measured = series(rows.measurements, metric, "target", level.key)
        if not measured:
            continue
        lines = [plots.Series(target, points) for target, points in measured.items()]
        lines += [plots.Series(f"{target} (predicted)", points, predicted=True, key=target)
                  for target, points in predicted_series(rows.predictions, metric, "target", level.key).items()]
        xs = [x for points in measured.values() for x, _ in points]
        charts.append(plots.line_chart(lines, f"G3 {name} by {level.words}", level.axis, y_label,
                                       log_x=geometric(xs), percent=percent, y_reach=1.0 if percent else None))
    return charts


def judged_plots(rows: GateRows, level: Level) -> list[str]:
    """Per judged metric with a level (TTFT p50 reduction, throughput gain): the figure with its interval
    as error bars, where it passes shaded, and the prediction beside it."""
    by_metric: dict[str, list[dict]] = {}
    for v in rows.verdicts:
        if number(v.get("value")) is not None and number((v.get("context") or {}).get(level.key)) is not None:
            by_metric.setdefault(str(v.get("metric") or v.get("check")), []).append(v)
    charts = []
    for metric, verdicts in by_metric.items():
        verdicts = sorted(verdicts, key=lambda v: v["context"][level.key])
        unit = str(verdicts[0].get("unit") or "")
        measured = plots.Series("measured (95% interval)", [(v["context"][level.key], v["value"]) for v in verdicts],
                                errors=[interval(v.get("interval")) for v in verdicts], key="measured")
        forecast = [p for p in rows.predictions if "target" not in (p.get("context") or {})]
        guesses = predicted_series(forecast, metric, "target", level.key)
        lines = [measured] + [plots.Series("predicted", points, predicted=True, key="predicted")
                              for points in guesses.values()]
        words = metric_words(metric, unit)
        band = accepted(rule_of(verdicts[0]))
        levels = [p[0] for p in measured.points if p[0] is not None]
        charts.append(plots.line_chart(lines, f"G3 {words} by {level.words}", level.axis,
                                       f"{words} (%)" if unit == "%" else words, percent=unit == "%", band=band,
                                       band_label="passes", log_x=geometric(levels)))
    return charts


def step_records(rows: GateRows, level: Level) -> dict[tuple[str, float], tuple[list[dict], bool]]:
    """Each (target, level)'s completed requests of its measured window, and whether the warm-up is in them
    (a run that did not record its windows)."""
    steps = {}
    for row in rows.measurements:
        context = row.get("context") or {}
        at = number(context.get(level.key))
        if row.get("metric") != "step_valid" or at is None or "target" not in context:
            continue
        target = str(context["target"])
        blocks = context.get("blocks")
        if not isinstance(blocks, list):   # one step per target: its window on the row itself
            recorded = context.get("records_dir")
            blocks = [
                {
                    "records_dir": recorded
                    or str(
                        rows.store.gate_dir("g3").relative_to(rows.store.root)
                        / "raw"
                        / "sweep"
                        / target
                        / f"{STEP_PREFIX[level.key]}{at:g}"
                        / "records"
                    ),
                    "window_start": context.get("window_start"),
                }
            ]
        found = [_window_records(rows.store.root / str(block.get("records_dir")), block) for block in blocks
                 if isinstance(block, dict)]
        steps[(target, at)] = ([r for records in found for r in records],
                               any(number(block.get("window_start")) is None for block in blocks))
    return steps


def _window_records(directory: Path, block: dict) -> list[dict]:
    """A block's completed requests in its measured window (all of them when it recorded no window)."""
    start = number(block.get("window_start"))
    left_out = set(block.get("left_out_ids") or ())
    return [r for r in read_records(directory) if r.get("ok") and r.get("request_id") not in left_out
            and (start is None or (number(r.get("sent_at")) or 0.0) >= start)]


def distribution_plots(rows: GateRows, level: Level) -> list[str]:
    """TTFT and E2E CDFs: a panel per level, a line per target, from the steps' raw records."""
    steps = step_records(rows, level)
    if not steps:
        return []
    levels = sorted({at for _, at in steps})
    charts = []
    for field, name in DISTRIBUTIONS:
        panels = []
        for at in levels:
            here = {target: found for (target, where), found in steps.items() if where == at}
            warm = any(included for _, included in here.values())
            panels.append(plots.Panel(level.label(at) + (" (warm-up included)" if warm else ""),
                                      [plots.Distribution(target, [1e3 * r[field] for r in records
                                                                   if number(r.get(field)) is not None])
                                       for target, (records, _) in here.items()]))
        charts.append(plots.cdf_chart(panels, f"G3 {name} distribution per {level.words} (CDF)", f"{name} (ms)"))
    return charts


STEP_COLUMNS = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99"),
                ("e2e_p50_ms", "E2E p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("output_tokens_per_s", "tokens/s"),
                ("requests_per_s", "req/s"), ("hit_ratio", "hit ratio"), ("error_rate", "errors"))


def step_tables(rows: GateRows) -> list[dict]:
    """One row per (level, target): the step's figures as G3 recorded them, and whether it was valid."""
    level = level_of(rows.measurements)
    steps: dict[tuple[float, str], dict[str, dict]] = {}
    for row in rows.measurements:
        context = row.get("context") or {}
        at = number(context.get(level.key))
        if (
            at is not None
            and "target" in context
            and row.get("metric") in {m for m, _ in STEP_COLUMNS} | {"step_valid"}
        ):
            steps.setdefault((at, str(context["target"])), {})[str(row["metric"])] = row
    if not steps:
        return []
    table, statuses = [], []
    for (at, target), figures in sorted(steps.items()):
        cells = []
        for metric, _ in STEP_COLUMNS:
            value = number((figures.get(metric) or {}).get("value"))
            percent = metric in ("hit_ratio", "error_rate")
            cells.append("" if value is None else format_percent(value) if percent else f"{value:,.1f}")
        valid = figures.get("step_valid") or {}
        reasons = str((valid.get("context") or {}).get("reasons") or "")
        ok = valid.get("value")
        table.append([level.label(at), target, *cells, _due_sent_finished(valid.get("context") or {}),
                      "yes" if ok else f"NO: {reasons}" if valid else ""])
        statuses.append("" if ok or not valid else "inconclusive")
    return [{"title": f"Each step: figures from its measured window, by {level.words} and target",
             "columns": [level.words, "target", *(name for _, name in STEP_COLUMNS), "due / sent / finished",
                         "valid"], "rows": table,
             "statuses": statuses, "text_columns": [0, 1, len(STEP_COLUMNS) + 2, len(STEP_COLUMNS) + 3]}]


def _due_sent_finished(context: dict) -> str:
    """"107 / 98 / 91": the window's requests due, sent and finished ("" for a run that did not count them)."""
    counts = [number(context.get(key)) for key in ("due", "sent", "finished")]
    return "" if None in counts else " / ".join(f"{count:,.0f}" for count in counts)


SAMPLED = ("ttft_p50_reduction", "throughput_gain")


def sampling_tables(rows: GateRows) -> list[dict]:
    """Per level and judged figure: blocks run per target, pairs used and left out, decided after N blocks or
    why not, the figure and its interval (the method in the title), from the verdicts' context."""
    level = level_of(rows.measurements)
    found = sorted((v for v in rows.verdicts if v.get("metric") in SAMPLED
                    and "blocks" in (v.get("context") or {}) and number(v["context"].get(level.key)) is not None),
                   key=lambda v: (v["context"][level.key], str(v["metric"])))
    if not found:
        return []
    table, statuses = [], []
    for v in found:
        context = v["context"]
        value, ends = number(v.get("value")), interval(v.get("interval"))
        figure = "" if value is None else format_percent(value)
        if ends is not None:
            figure += f" [{format_percent(ends[0], symbol=False)}, {format_percent(ends[1], symbol=False)}]"
        table.append([level.label(context[level.key]), metric_words(str(v["metric"]), "%"), str(context["blocks"]),
                      f"{context.get('pairs_used', '')} used, {context.get('pairs_left_out', 0)} left out",
                      str(context.get("stopped") or ""), figure, str(v.get("status") or "")])
        statuses.append({"PASS": "", "FAIL": "failed"}.get(str(v.get("status")), "inconclusive"))
    method = next((str(v["context"]["method"]) for v in found if v["context"].get("method")), "")
    return [{"title": f"Block pairs per level: how many decided each verdict. Interval: {method}",
             "columns": [level.words, "figure", "blocks per target", "pairs", "sampling", "figure [interval]",
                         "verdict"], "rows": table, "statuses": statuses, "text_columns": [0, 1, 3, 4, 5, 6]}]


def block_tables(rows: GateRows) -> list[dict]:
    """Each block as it ran (`g3_block` rows): level, target, pair and its place in the pair (ABBA...), start,
    TTFT p50, output tokens/s, requests, valid."""
    level = level_of(rows.measurements)
    blocks = sorted((m for m in rows.measurements if m.get("metric") == "g3_block"),
                    key=lambda m: (m["context"].get(level.key) or 0, m["context"].get("started_at") or 0))
    if not blocks:
        return []
    first = min(number(m["context"].get("started_at")) or 0.0 for m in blocks)
    table = []
    for m in blocks:
        c = m["context"]
        ttft, tput = number(c.get("ttft_p50_ms")), number(c.get("output_tokens_per_s"))
        table.append([level.label(c[level.key]), str(c.get("target")), f"{int(c.get('block', 0)) + 1}",
                      "first" if c.get("position") == 0 else "second",
                      f"{(number(c.get('started_at')) or first) - first:.0f}",
                      "" if ttft is None else f"{ttft:,.1f}", "" if tput is None else f"{tput:,.1f}",
                      str(c.get("requests", "")), "yes" if c.get("valid") else f"NO: {c.get('reasons') or ''}"])
    return [{"title": "Each block: baseline and candidate in turn (pair k: baseline first for even k, ABBA...)",
             "columns": [level.words, "target", "pair", "in pair", "start s", "TTFT p50 ms", "tokens/s",
                         "requests", "valid"], "rows": table, "text_columns": [0, 1, 3, 8]}]


def g3_tables(rows: GateRows) -> list[dict]:
    """G3's tables: the sampling per level, each (target, level) pooled over its blocks, each block."""
    return sampling_tables(rows) + step_tables(rows) + block_tables(rows)


def g3_warnings(rows: GateRows) -> list[str]:
    """Lines at the top of G3's section: an A/A run's false decisions, then hit ratios far below the bound."""
    aa = false_decision_line(rows.measurements)
    return ([aa] if aa else []) + hit_ratio_warnings(rows)


def g3_plots(rows: GateRows) -> list[str]:
    level = level_of(rows.measurements)
    return judged_plots(rows, level) + figure_plots(rows, level) + distribution_plots(rows, level)


def hit_ratio_warnings(rows: GateRows) -> list[str]:
    """A line per candidate step whose hit ratio G3 recorded as far below what its workload allows
    (hit_ratio_bound); the baseline's and the recompute reference's are below it by design, never warned of."""
    level = level_of(rows.measurements)
    found = []
    for row in rows.measurements:
        context = row.get("context") or {}
        at = number(context.get(level.key))
        candidate = str(context.get("target", "")).startswith("candidate")
        if row.get("metric") != "hit_ratio_bound" or not context.get("far_below") or at is None or not candidate:
            continue
        found.append(
            f"{context.get('target')} at {level.label(at)}: hit ratio {format_percent(float(context['measured']))}, "
            f"far below the {format_percent(float(row['value']))} its workload allows (an infinite cache over one "
            f"primed pass): its tiers, or its engine's prefix matching, lose reuse the workload has"
        )
    return found
