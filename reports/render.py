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
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Optional

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from kvcore.aa import false_decision_line
from kvcore.claims import claim_text, claims_table, run_claims
from kvcore.files import write_json, write_text_atomic
from kvcore.outcome import PROBLEM, overall
from kvcore.percent import format_percent
from kvcore.predictions import beside, format_figure
from kvcore.printable import printable
from kvcore.rundata import GATE_TITLES, GATES, RunStore
from kvcore.settings import ConfigError

from . import g1_arrival, g2_cache, g2_storage, g3_capacity, g3_main, g4_soak, plots, storage_yardstick
from .environment import environment_tables
from .rows import GateRows, gate_rows, number

TEMPLATES = Path(__file__).parent / "templates"


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
            "sizing": {**sizing, "comparison": comparison, "term_sources": term_shares(comparison)}, "gates": gates,
            "preflight": store.preflight(),
            "environment": run.get("environment", {})}


def term_shares(comparison: list[dict]) -> list[dict]:
    """Each TTFT term once, with its constant's source and its mean share of the errors it is in (in |ms| of the
    error: each term's absolute contribution over all the terms' absolute contributions)."""
    found: dict[str, dict] = {}
    for row in comparison:
        total = sum(abs(t["error_s"]) for t in row.get("terms") or ())
        for t in row.get("terms") or ():
            entry = found.setdefault(t["term"], {"term": t["term"], "source": t["source"], "shares": []})
            if total:
                entry["shares"].append(abs(t["error_s"]) / total)
    return [{"term": e["term"], "source": e["source"],
             "share_text": format_percent(sum(e["shares"]) / len(e["shares"])) if e["shares"] else "–"}
            for e in found.values()]


def _gate_result(store: RunStore, gate: str, requested: bool, predictions: list[dict]) -> dict:
    """A gate's status, verdicts (each with the sizing model's prediction beside it, or None) and figures."""
    record = store.status(gate)
    verdicts = [{**v, "predicted": beside(v, predictions)} for v in store.verdicts(gate)]
    measurements = store.measurements(gate)
    interrupted = not record and requested and store.ended_unfinished()
    if record:
        status, reason = str(record.get("status", "unknown")), str(record.get("reason", ""))
    elif verdicts or measurements:
        status, reason = "running", _progress(verdicts, measurements)
        if interrupted:
            status, reason = "interrupted", f"the run ended mid-gate ({reason.removeprefix('in progress: ')})"
    elif interrupted:
        status, reason = "not run", "interrupted: the run ended before this gate started"
    else:
        status, reason = "not run", "not run yet" if requested else "not requested"
    return {"gate": gate, "title": GATE_TITLES[gate], "status": status, "reason": reason, "requested": requested,
            "status_record": record, "verdicts": verdicts, "errors": store.errors(gate),
            "unjudged": store.unjudged(gate), "measurements": measurements}


def _progress(verdicts: list[dict], measurements: list[dict]) -> str:
    """"in progress: 12 verdicts (1 FAIL), 340 measurements so far": a known failure is not hidden."""
    judged = [str(v.get("status", "")).upper() for v in verdicts]
    bad = ", ".join(f"{judged.count(s)} {s}" for s in ("FAIL", "INCONCLUSIVE") if s in judged)
    return (f"in progress: {len(verdicts)} verdicts" + (f" ({bad})" if bad else "")
            + f", {len(measurements)} measurements so far")


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
    for element in root.iter():       # text from a target: a control character would leave XML that does not parse
        element.attrib.update({key: printable(value) for key, value in element.attrib.items()})
        element.text = element.text and printable(element.text)
        element.tail = element.tail and printable(element.tail)
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
    for errored in gate["errors"]:
        case = ET.SubElement(suite, "testcase", classname=classname, name=str(errored.get("check", "check")), time="0")
        ET.SubElement(case, "error", message=str(errored.get("reason", "")), type=str(errored.get("phase", "")))
    _outcome_case(suite, gate, classname)
    return _count(suite)


def _outcome_case(suite: ET.Element, gate: dict, classname: str) -> None:
    """A testcase for the gate itself when its verdicts alone would not tell its outcome."""
    status, reason = gate["status"], gate["reason"]
    statuses = {str(v.get("status", "")).upper() for v in gate["verdicts"]}
    if status in ("not run", "running"):
        case = ET.SubElement(suite, "testcase", classname=classname, name=f"{gate['gate']} {status}", time="0")
        ET.SubElement(case, "skipped", message=reason)
    elif status in PROBLEM and "FAIL" not in statuses and not gate["errors"]:   # errored checks are their cases
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


# ---------------------------------------------------------------- plots and tables

# Each gate's charts (inline SVG) and tables of figures ({title, columns, rows} and optionally statuses,
# text_columns, badge_column) from its rows; the builders live one module per gate.
PLOTTERS: dict[str, Callable[[GateRows], list[str]]] = {
    "g1": g1_arrival.headroom_plots,
    "g2": lambda rows: g2_cache.cache_plots(rows) + g2_storage.storage_plots(rows.measurements),
    "g3": lambda rows: g3_main.g3_plots(rows) + g3_capacity.capacity_plots(rows),
    "g4": g4_soak.window_plots,
}
TABLERS: dict[str, Callable[[GateRows], list[dict]]] = {
    "g1": lambda rows: g1_arrival.spec_table(rows) + storage_yardstick.sweep_tables(rows.measurements),
    "g2": lambda rows: (
        storage_yardstick.pairs_tables(rows.measurements)
        + g2_storage.model_load_tables(rows.measurements)
        + g2_storage.checkpoint_tables(rows.measurements)
        + storage_yardstick.sweep_tables(rows.measurements)
    ),
    "g3": lambda rows: g3_main.g3_tables(rows) + g3_capacity.capacity_tables(rows),
    "g4": g4_soak.fault_tables,
}

# lines a reviewer should not miss, shown at the top of the gate's section
WARNERS: dict[str, Callable[[GateRows], list[str]]] = {
    "g2": lambda rows: [line for line in [false_decision_line(rows.measurements)] if line],   # an A/A run's count
    "g3": g3_main.g3_warnings,
}


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
    fraction = number(value) if unit == "%" else None
    if fraction is not None:
        return format_percent(fraction)
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
    aliases = {"pass": "passed", "fail": "failed", "error": "failed", "not run": "not-run",
               "interrupted": "incomplete"}      # a gate a killed run left: styled as the run it leaves incomplete
    return aliases.get(text, text.replace(" ", "-"))


def render_html(results: dict, run_dir: Path, rendered_at: float) -> str:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(value=fmt_value, with_unit=fmt_with_unit, interval_with_unit=fmt_interval_with_unit,
                       time=fmt_time, context=fmt_context, interval=fmt_interval,
                       status_class=status_class)
    store = RunStore(run_dir)
    predictions = store.predictions()
    gates = []
    for gate in results["gates"]:
        rows = gate_rows(gate, store, predictions)
        gates.append({**gate, "plots": [Markup(p) for p in PLOTTERS[gate["gate"]](rows)],
                      "tables": TABLERS.get(gate["gate"], lambda r: [])(rows),
                      "warnings": WARNERS.get(gate["gate"], lambda r: [])(rows)})
    run = results["run"]
    started = run.get("started_at")
    page = env.get_template("index.html.j2").render(
        results=results, run=run, gates=gates, run_id=run.get("run_id") or run_dir.name, started=started,
        environment_tables=environment_tables(results["environment"], run), rendered_at=rendered_at,
        chart_css=plots.CHART_CSS,
    )
    # Nothing in the page may look like a link out (a target URL in the environment, say):
    # an entity for the colon shows the same text and leaves no literal scheme in the file.
    # A target's control characters and lone surrogates are shown as escapes (the latter UTF-8 cannot write).
    return printable(page.replace("://", "&#58;//"))


def render_run(run_dir: Path) -> dict:
    """Write results.json, junit.xml and index.html into `run_dir` from its raw data; return the results."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    store = RunStore(run_dir)
    results = collect_results(store)
    rendered_at = time.time()
    try:
        write_json(run_dir / "results.json", results)
        write_text_atomic(run_dir / "junit.xml", junit_xml(store, results))
        write_text_atomic(run_dir / "index.html", render_html(results, run_dir, rendered_at))
    except OSError as error:     # a read-only or full filesystem: the run's data stay as they were
        raise ConfigError(f"run_dir: expected a run directory kvgate can write its report into, found {run_dir} "
                          f"refused ({error.strerror or error}{': ' + error.filename if error.filename else ''})") \
            from None
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports.render", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory to (re-)render")
    args = parser.parse_args(argv)
    try:
        results = render_run(args.run_dir)
    except (FileNotFoundError, ConfigError) as error:     # no run here, or a run file damaged (named)
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{results['overall']['status']}: {results['overall']['summary']}")
    print(f"report: {args.run_dir / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
