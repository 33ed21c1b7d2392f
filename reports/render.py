"""Render a run directory into results.json, junit.xml and a self-contained index.html.

Everything is derived from the run directory's raw data (run.json, each gate's
status, verdicts and measurements), so a report can be re-rendered at any time,
also while a gate is still running::

    python -m reports.render RUN_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from kvcore.files import write_json, write_text_atomic
from kvcore.rules import Band, Threshold, stored_rule
from kvcore.claims import claim_text, claims_table, format_figure, run_claims
from kvcore.predictions import beside
from kvcore.rundata import GATE_TITLES, GATES, RunStore

from . import g2_storage, svg

TEMPLATES = Path(__file__).parent / "templates"
PROBLEM = ("failed", "error")


# ---------------------------------------------------------------- results.json

def collect_results(store: RunStore) -> dict:
    """The run's figures, verdicts and outcome as one JSON-ready dict."""
    run = store.run_info()
    requested = [str(g).lower() for g in (run.get("gates") or GATES)]
    predictions = store.predictions()
    gates = [_gate_result(store, gate, gate in requested, predictions) for gate in GATES]
    sizing = store.sizing()
    claims = [{**row, "promised": claim_text(row), "measured_text": format_figure(row["measured"], row["unit"]),
               "predicted_text": format_figure(row["predicted"], row["unit"])}
              for row in claims_table(store, run_claims(store))]
    comparison = [{**row, "predicted_text": format_figure(row["predicted"], row.get("unit", "")),
                   "measured_text": format_figure(row["measured"], row.get("unit", ""))}
                  for row in sizing.get("comparison", [])]
    return {"run": run, "overall": overall(gates), "claims": claims,
            "sizing": {**sizing, "comparison": comparison}, "gates": gates, "preflight": store.preflight(),
            "environment": run.get("environment", {})}


def _gate_result(store: RunStore, gate: str, requested: bool, predictions: list[dict]) -> dict:
    """A gate's status, verdicts (each with the sizing model's prediction beside it, or None) and figures."""
    try:
        record = store.status(gate)
    except ValueError:  # a status file being replaced right now: treat as still running
        record = None
    verdicts = [{**v, "predicted": beside(v, predictions)} for v in store.verdicts(gate)]
    measurements = store.measurements(gate)
    if record:
        status, reason = str(record.get("status", "unknown")), str(record.get("reason", ""))
    elif verdicts or measurements:
        status, reason = "running", _progress(verdicts, measurements)
    else:
        status, reason = "not run", "not run yet" if requested else "not requested"
    return {"gate": gate, "title": GATE_TITLES[gate], "status": status, "reason": reason, "requested": requested,
            "status_record": record, "verdicts": verdicts, "unjudged": store.unjudged(gate),
            "measurements": measurements}


def _progress(verdicts: list[dict], measurements: list[dict]) -> str:
    """"in progress: 12 verdicts (1 FAIL), 340 measurements so far": a known failure is not hidden."""
    judged = [str(v.get("status", "")).upper() for v in verdicts]
    bad = ", ".join(f"{judged.count(s)} {s}" for s in ("FAIL", "INCONCLUSIVE") if s in judged)
    return (f"in progress: {len(verdicts)} verdicts" + (f" ({bad})" if bad else "")
            + f", {len(measurements)} measurements so far")


def _stopped(gate: dict) -> bool:
    return gate["status"] == "not run" and "stopped" in gate["reason"].lower()


def overall(gates: list[dict]) -> dict:
    """failed > inconclusive > incomplete > passed; a gate in error counts as failed."""
    requested = [g for g in gates if g["requested"]]
    failed = [g for g in gates if g["status"] in PROBLEM]
    inconclusive = [g for g in gates if g["status"] == "inconclusive"]
    unfinished = [g for g in requested if g["status"] != "passed" and not _stopped(g)]
    if failed:
        status, first = "failed", failed[0]
    elif inconclusive:
        status, first = "inconclusive", inconclusive[0]
    elif not requested or any(g["status"] != "passed" for g in requested):
        not_passed = unfinished or [g for g in requested if g["status"] != "passed"]
        status, first = "incomplete", not_passed[0] if not_passed else None
    else:
        status, first = "passed", None
    listing = " · ".join(f"{g['gate'].upper()} {g['status']}" for g in requested)
    if first is None:
        headline = "all requested gates passed" if requested else "no gates requested"
    else:
        reason = first["reason"].strip().splitlines()[0] if first["reason"].strip() else ""
        headline = f"{first['gate'].upper()} {first['status']}" + (f": {reason}" if reason else "")
    return {"status": status, "summary": f"{headline} — {listing}" if listing else headline}


# ---------------------------------------------------------------- junit.xml

def junit_xml(store: RunStore, results: dict) -> str:
    """One <testsuites> document: each gate's pytest suite, or one derived from its verdicts."""
    run_id = str(results["run"].get("run_id") or store.root.name)
    root = ET.Element("testsuites", name=f"kvgate {run_id}")
    for gate in results["gates"]:
        name = f"{gate['gate']} {_short_title(gate)}"
        suite = _pytest_suite(store.gate_dir(gate["gate"]) / "junit.xml", name) or _verdict_suite(gate, name)
        root.append(suite)
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in root)))
    root.set("time", f"{sum(float(s.get('time', '0') or 0) for s in root):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _short_title(gate: dict) -> str:
    first, _, rest = gate["title"].partition(" ")
    return rest if first.lower() == gate["gate"] and rest else gate["title"]


def _pytest_suite(path: Path, name: str) -> Optional[ET.Element]:
    """Pytest's report merged into one suite named after the gate (None when absent or unreadable)."""
    try:
        parsed = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [parsed] if parsed.tag == "testsuite" else parsed.findall("testsuite")
    if not suites:
        return None
    merged = ET.Element("testsuite", {k: v for k, v in suites[0].attrib.items() if k != "name"}, name=name)
    properties = suites[0].find("properties")
    if properties is not None:
        merged.append(properties)
    for suite in suites:
        merged.extend(suite.findall("testcase"))
    merged.set("time", f"{sum(float(s.get('time', '0') or 0) for s in suites):.3f}")
    return _count(merged)


def _verdict_suite(gate: dict, name: str) -> ET.Element:
    suite = ET.Element("testsuite", name=name, time="0")
    classname = f"kvgate.{gate['gate']}"
    for verdict in gate["verdicts"]:
        case = ET.SubElement(suite, "testcase", classname=classname,
                             name=str(verdict.get("check") or verdict.get("metric") or "check"), time="0")
        status, reason = str(verdict.get("status", "")).upper(), str(verdict.get("reason", ""))
        if status == "FAIL":
            ET.SubElement(case, "failure", message=reason, type="FAIL").text = reason
        elif status == "INCONCLUSIVE":
            ET.SubElement(case, "failure", message=f"INCONCLUSIVE: {reason}", type="INCONCLUSIVE")
        elif status != "PASS":
            ET.SubElement(case, "error", message=f"{status or 'no status'}: {reason}", type="verdict")
        ET.SubElement(case, "system-out").text = reason
    _outcome_case(suite, gate, classname)
    return _count(suite)


def _outcome_case(suite: ET.Element, gate: dict, classname: str) -> None:
    """A testcase for the gate itself when its verdicts alone would not tell its outcome."""
    status, reason = gate["status"], gate["reason"]
    statuses = {str(v.get("status", "")).upper() for v in gate["verdicts"]}
    if status in ("not run", "running"):
        case = ET.SubElement(suite, "testcase", classname=classname, name=f"{gate['gate']} {status}", time="0")
        ET.SubElement(case, "skipped", message=reason)
    elif status in PROBLEM and "FAIL" not in statuses:
        case = ET.SubElement(suite, "testcase", classname=classname, name=f"{gate['gate']} outcome", time="0")
        ET.SubElement(case, "error" if status == "error" else "failure", message=reason, type=status)
    elif status == "inconclusive" and not statuses & {"FAIL", "INCONCLUSIVE"}:
        case = ET.SubElement(suite, "testcase", classname=classname, name=f"{gate['gate']} outcome", time="0")
        ET.SubElement(case, "failure", message=f"INCONCLUSIVE: {reason}", type="INCONCLUSIVE")
    elif not gate["verdicts"]:
        ET.SubElement(suite, "testcase", classname=classname, name=f"{gate['gate']} outcome", time="0")


def _count(suite: ET.Element) -> ET.Element:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for key, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
        suite.set(key, str(sum(1 for case in cases if case.find(tag) is not None)))
    return suite


# ---------------------------------------------------------------- plots

def _threshold(verdict: dict) -> Optional[Threshold]:
    rule = stored_rule(verdict.get("rule"))
    return rule if isinstance(rule, Threshold) else None


def _band(verdict: dict) -> Optional[Band]:
    rule = stored_rule(verdict.get("rule"))
    return rule if isinstance(rule, Band) else None


def _number(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _series(measurements: list[dict], metric: str, group: str, x_key: str) -> dict[str, list[tuple[float, float]]]:
    """Median value per (group, x) of one metric; group and x come from each row's context."""
    buckets: dict[str, dict[float, list[float]]] = {}
    for row in measurements:
        context = row.get("context") or {}
        x, y = _number(context.get(x_key)), _number(row.get("value"))
        if row.get("metric") != metric or x is None or y is None:
            continue
        name = str(context.get(group) or row.get("check") or metric)
        buckets.setdefault(name, {}).setdefault(x, []).append(y)
    return {name: [(x, statistics.median(ys)) for x, ys in sorted(points.items())] for name, points in buckets.items()}


def _unit(measurements: list[dict], metric: str) -> str:
    return next((str(m.get("unit") or "") for m in measurements if m.get("metric") == metric), "")


def _geometric(series: dict[str, list[tuple[float, float]]]) -> bool:
    xs = [x for points in series.values() for x, _ in points]
    return bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 8


def _g1_plots(gate: dict) -> list[str]:
    by_unit: dict[str, list[dict]] = {}
    for v in gate["verdicts"]:
        if _threshold(v) is not None and _number(v.get("value")) is not None:
            by_unit.setdefault(str(v.get("unit") or ""), []).append(v)
    return [svg.bar_chart([(str(v.get("check") or v.get("metric")), v["value"]) for v in rows],
                          [(i, _threshold(v).value) for i, v in enumerate(rows)],
                          "G1 measured against spec" + (f" ({unit})" if unit else ""), unit,
                          statuses=[str(v.get("status", "")) for v in rows])
            for unit, rows in by_unit.items()]


def _g2_plots(gate: dict) -> list[str]:
    plots = []
    series = _series(gate["measurements"], "ttft_ms", "mode", "context_tokens")
    if series:
        plots.append(svg.line_chart(series, "G2 TTFT by context length", "context length (tokens)", "TTFT (ms)",
                                    log_x=_geometric(series)))
    pairs = [m.get("context") or {} for m in gate["measurements"] if m.get("metric") == "cold_read_pair"]
    if pairs:
        sides = {side: [(p.get("round"), p.get(f"{side}_gbps")) for p in pairs] for side in ("tier", "fio")}
        plots.append(svg.line_chart({"disk tier cold load": sides["tier"], "fio, same storage": sides["fio"]},
                                    "G2 cold-read bandwidth, alternating rounds", "round", "GB/s"))
    return plots + g2_storage.storage_plots(gate["measurements"])


def _g3_level_key(rows: list[dict]) -> tuple[str, str]:
    """What G3's levels are in this run (the context key and the axis title): concurrencies or rate multipliers."""
    multiplied = any("multiplier" in (row.get("context") or {}) for row in rows)
    return ("multiplier", "rate multiplier (× the trace's arrival rate)") if multiplied else ("concurrency",
                                                                                              "concurrency")


def _g3_plots(gate: dict) -> list[str]:
    plots, rows = [], gate["measurements"]
    key, axis = _g3_level_key(rows)
    by = key if key == "concurrency" else "rate multiplier"
    bands = [v for v in gate["verdicts"] if _band(v) is not None]
    ttft = _series(rows, "ttft_p50_ms", "target", key)
    if ttft:
        plots.append(svg.line_chart(ttft, f"G3 TTFT p50 by {by}", axis, "TTFT p50 (ms)", log_x=_geometric(ttft)))
    throughput, unit = _series(rows, "output_tokens_per_s", "target", key), _unit(rows, "output_tokens_per_s")
    same_unit = [v for v in bands if str(v.get("unit") or "") == unit and unit]
    if throughput:
        band = (_band(same_unit[0]).min, _band(same_unit[0]).max) if same_unit else None
        plots.append(svg.line_chart(throughput, f"G3 output throughput by {by}", axis,
                                    f"output throughput ({unit or 'tokens/s'})", band=band,
                                    log_x=_geometric(throughput), band_label="accepted band"))
    judged = [v for v in bands if v not in same_unit and _number(v.get("value")) is not None
              and _number((v.get("context") or {}).get(key)) is not None]
    if judged:
        unit = str(judged[0].get("unit") or "")
        scale = 100.0 if unit == "%" else 1.0  # verdicts hold fractions; a percent axis shows percents
        points = [(float(v["context"][key]), v["value"] * scale) for v in judged]
        band = (_band(judged[0]).min * scale, _band(judged[0]).max * scale)
        metric = str(judged[0].get("metric") or judged[0].get("check") or "judged figure")
        plots.append(svg.line_chart({metric: points}, f"G3 {metric} against its band", axis,
                                    f"{metric} ({unit})" if unit else metric, band=tuple(band),
                                    log_x=_geometric({"": points}), band_label="accepted band"))
    return plots


def _fault_marker(row: dict) -> tuple[Any, str]:
    context = row.get("context") or {}
    return context.get("at_s"), str(context.get("kind") or row.get("check") or "fault")


def _left_out_span(row: dict) -> tuple[Optional[float], Optional[float], str]:
    """A window the drift checks left out: where it lies and which faults were in it."""
    context = row.get("context") or {}
    return (_number(context.get("window_start_s")), _number(context.get("window_end_s")),
            f"window {context.get('window')} left out of the drift checks: {context.get('reason') or ''}")


def _g4_plots(gate: dict) -> list[str]:
    rows = gate["measurements"]
    metrics = sorted({str(m.get("metric")) for m in rows if str(m.get("metric", "")).startswith("window_")},
                     key=lambda metric: (metric != "window_ttft_p99_ms", metric))
    faults = [_fault_marker(m) for m in rows if m.get("metric") == "fault"]
    left_out = [_left_out_span(m) for m in rows if m.get("metric") == "drift_excluded_window"]
    plots = []
    for metric in metrics:
        series = _series(rows, metric, "target", "window_start_s")
        if not series:
            continue
        span = max(max(x for x, _ in points) for points in series.values())
        scale, label = (3600.0, "h") if span >= 3 * 3600 else (60.0, "min") if span >= 600 else (1.0, "s")
        scaled = {name: [(x / scale, y) for x, y in points] for name, points in series.items()}
        markers = [(at / scale, kind) for at, kind in faults if _number(at) is not None]
        spans = [(a / scale, b / scale, words) for a, b, words in left_out if None not in (a, b)]
        unit = _unit(rows, metric)
        name = _metric_words(metric.removeprefix("window_"), unit)
        plots.append(svg.line_chart(scaled, f"G4 windowed {name}", f"time since start ({label})",
                                    f"{name} ({unit})" if unit else name, markers=markers, spans=spans,
                                    span_label="fault windows left out of the drift checks"))
    return plots


def _metric_words(metric: str, unit: str) -> str:
    """"ttft_p99_ms" with unit "ms" → "TTFT p99"."""
    words = metric.split("_")
    if unit and words[-1:] == [unit.lower()] and len(words) > 1:
        words = words[:-1]
    return " ".join(word.upper() if word in ACRONYMS else word for word in words)


ACRONYMS = {"ttft", "itl", "tpot", "e2e", "rss", "kv", "gpu", "cpu"}
PLOTTERS = {"g1": _g1_plots, "g2": _g2_plots, "g3": _g3_plots, "g4": _g4_plots}
# a gate's tables of figures beside its verdicts: {title, columns, rows}
TABLERS = {"g2": lambda gate: g2_storage.model_load_tables(gate["measurements"])
           + g2_storage.checkpoint_tables(gate["measurements"])}


# ---------------------------------------------------------------- index.html

def fmt_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0 or abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}".rstrip("0").rstrip(".")
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "), default=str)
    return str(value)


def fmt_with_unit(value: Any, unit: Any) -> str:
    """A judged figure with its unit; "%" figures are fractions (0.312 -> "31.2%"), as in verdict reasons."""
    if unit == "%" and _number(value) is not None:
        return f"{_number(value) * 100:.1f}%"
    text = fmt_value(value)
    return f"{text} {unit}" if unit and text else text


def fmt_interval_with_unit(interval: Any, unit: Any) -> str:
    if unit == "%" and isinstance(interval, (list, tuple)) and len(interval) == 2:
        return f"[{fmt_with_unit(interval[0], unit)}, {fmt_with_unit(interval[1], unit)}]"
    return fmt_interval(interval)


def fmt_time(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    return "" if value is None else str(value)


def fmt_context(context: Any) -> str:
    """{"mode": "tiered", "context_tokens": 4096} → "mode=tiered, context_tokens=4096" (numbers as written)."""
    if isinstance(context, dict):
        return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in context.items())
    return fmt_value(context)


def fmt_interval(interval: Any) -> str:
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        return f"[{fmt_value(interval[0])}, {fmt_value(interval[1])}]"
    return fmt_value(interval)


def status_class(status: Any) -> str:
    text = str(status).lower()
    aliases = {"pass": "passed", "fail": "failed", "error": "failed", "not run": "not-run"}
    return aliases.get(text, text.replace(" ", "-"))


def pretty_json(value: Any) -> str:
    """One line when short, indented otherwise."""
    line = json.dumps(value, default=str, ensure_ascii=False, separators=(", ", ": "))
    return line if len(line) <= 100 else json.dumps(value, indent=2, default=str, ensure_ascii=False)


def fmt_field(value: Any, key: str) -> str:
    """A run record field: epoch seconds under a *_at key read as a UTC time."""
    return fmt_time(value) if str(key).endswith("_at") and isinstance(value, (int, float)) else fmt_value(value)


def render_html(results: dict, run_dir: Path, rendered_at: float) -> str:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(value=fmt_value, with_unit=fmt_with_unit, interval_with_unit=fmt_interval_with_unit,
                       time=fmt_time, context=fmt_context, interval=fmt_interval,
                       status_class=status_class, pretty_json=pretty_json, field=fmt_field)
    gates = [{**gate, "plots": [Markup(p) for p in PLOTTERS[gate["gate"]](gate)],
              "tables": TABLERS.get(gate["gate"], lambda g: [])(gate)} for gate in results["gates"]]
    run = results["run"]
    started = run.get("started_at")
    page = env.get_template("index.html.j2").render(
        results=results, run=run, gates=gates, run_id=run.get("run_id") or run_dir.name, started=started,
        environment=results["environment"], rendered_at=rendered_at,
        run_extra={k: v for k, v in run.items() if k not in ("environment", "run_id", "gates")},
    )
    # Nothing in the page may look like a link out (a target URL in the environment, say):
    # an entity for the colon shows the same text and leaves no literal scheme in the file.
    return page.replace("://", "&#58;//")


def render_run(run_dir: Path) -> dict:
    """Write results.json, junit.xml and index.html into `run_dir` from its raw data; return the results."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    store = RunStore(run_dir)
    results = collect_results(store)
    rendered_at = time.time()
    write_json(run_dir / "results.json", results)
    write_text_atomic(run_dir / "junit.xml", junit_xml(store, results))
    write_text_atomic(run_dir / "index.html", render_html(results, run_dir, rendered_at))
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports.render", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory to (re-)render")
    args = parser.parse_args(argv)
    try:
        results = render_run(args.run_dir)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{results['overall']['status']}: {results['overall']['summary']}")
    print(f"report: {args.run_dir / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
