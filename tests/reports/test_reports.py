"""The report renderer: results.json outcome logic, merged junit.xml, a self-contained index.html."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvcore.rundata import RunStore
from reports.render import main, render_run

HOSTILE = "seq read <b>&amp; friends"  # a check name that must never become markup

PYTEST_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="12.5"
 timestamp="2025-05-01T10:00:00" hostname="node-a">
<testcase classname="gates.g1_arrival.test_fio" name="test_seq_read_bandwidth" time="5.0"/>
<testcase classname="gates.g1_arrival.test_fio" name="test_rand_read_iops" time="4.0"/>
<testcase classname="gates.g1_arrival.test_inventory" name="test_nic_present" time="0.1">
 <failure message="no 200G NIC found">AssertionError</failure></testcase>
<testcase classname="gates.g1_arrival.test_fio" name="test_fio_verify" time="0.0">
 <skipped message="verify disabled in quick profile"/></testcase>
</testsuite></testsuites>
"""


def verdict(gate: str, check: str, status: str, reason: str, value, unit: str, rule, **extra) -> dict:
    return {"gate": gate, "check": check, "metric": rule.get("metric", check), "status": status, "reason": reason,
            "value": value, "unit": unit, "rule": rule, **extra}


def write_g1(store: RunStore) -> None:
    store.record("g1", "seq read", "seq_read_gbps", 6.8, "GB/s", job="seqread", bs="1MiB")
    store.record("g1", "seq write", "seq_write_gbps", 3.1, "GB/s", job="seqwrite", bs="1MiB")
    store.record("g1", "4k random read", "rand_read_iops", 820_000, "IOPS", job="randread", bs="4KiB")
    store.record("g1", "capacity", "capacity_tb", 30.7, "TB")
    store.add_verdict(verdict("g1", HOSTILE, "PASS", "G1 seq read: 6.8 GB/s ≥ 6.0 GB/s → PASS", 6.8, "GB/s",
                              {"metric": "seq_read_gbps", "op": ">=", "value": 6.0}, interval=[6.7, 6.9]))
    store.add_verdict(verdict("g1", "seq write", "PASS", "G1 seq write: 3.1 GB/s ≥ 3.0 GB/s → PASS", 3.1, "GB/s",
                              {"metric": "seq_write_gbps", "op": ">=", "value": 3.0}))
    store.add_verdict(verdict("g1", "4k random read", "PASS", "G1 4 KiB random read: 820k IOPS ≥ 700k → PASS",
                              820_000, "IOPS", {"metric": "rand_read_iops", "op": ">=", "value": 700_000}))
    store.add_verdict(verdict("g1", "capacity", "PASS", "G1 capacity: 30.7 TB ≥ 30 TB → PASS", 30.7, "TB",
                              {"metric": "capacity_tb", "op": ">=", "value": 30}))


def write_g2(store: RunStore, ttft: bool = True) -> None:
    base = {"recompute": 0.075, "device-only": 0.07, "tiered": 0.012}
    for mode, per_token in base.items():
        for tokens in (4096, 16384, 65536):
            if ttft:
                store.record("g2", "ttft by context", "ttft_ms", round(40 + per_token * tokens, 1), "ms",
                             mode=mode, context_tokens=tokens)
    store.record("g2", "disk cold read", "disk_read_gbps", 5.9, "GB/s", context_tokens=65536)
    store.add_verdict(verdict("g2", "disk cold-read bandwidth", "PASS",
                              "G2 disk cold-read: 5.9 GB/s ≥ 80% of fio 6.8 GB/s (5.44) → PASS", 5.9, "GB/s",
                              {"metric": "disk_read_gbps", "op": ">=", "value": 5.44}))
    store.add_verdict(verdict("g2", "disk-hit TTFT ratio", "PASS",
                              "G2 disk-hit TTFT at 64k: 0.16 × recompute ≤ 0.25 → PASS", 0.16, "ratio",
                              {"metric": "ttft_ratio", "op": "<=", "value": 0.25}))


def write_g3(store: RunStore) -> None:
    for c in (1, 4, 16, 64):
        store.record("g3", "sweep", "ttft_p50_ms", 180 + 9 * c, "ms", target="device-only", concurrency=c)
        store.record("g3", "sweep", "ttft_p50_ms", 110 + 5 * c, "ms", target="tiered", concurrency=c)
        store.record("g3", "sweep", "output_tokens_per_s", 90.0 * c ** 0.8, "tokens/s", target="device-only",
                     concurrency=c)
        store.record("g3", "sweep", "output_tokens_per_s", 90.0 * c ** 0.8 * 1.34, "tokens/s", target="tiered",
                     concurrency=c)
        store.add_verdict(verdict("g3", f"TTFT p50 reduction at c={c}", "PASS",
                                  f"G3 TTFT p50 reduction at c={c}: 38.0% [35.1, 40.2] ≥ 25% → PASS", 0.38, "%",
                                  {"metric": "ttft_p50_reduction", "op": ">=", "value": 0.25},
                                  interval=[0.351, 0.402], context={"concurrency": c}))
        store.add_verdict(verdict("g3", f"throughput gain at c={c}", "PASS",
                                  f"G3 throughput gain at c={c}: 34.0% in [29, 40] → PASS", 0.34, "%",
                                  {"metric": "throughput_gain", "min": 0.29, "max": 0.4}, context={"concurrency": c}))


def write_g4(store: RunStore) -> None:
    for i in range(24):
        store.record("g4", "soak", "window_ttft_p99_ms", 420 + (60 if 8 <= i <= 9 else 0) + i % 3, "ms",
                     window_start_s=i * 900)
    store.record("g4", "fault injection", "fault", 1, "", at_s=7300, kind="disk detach & <reattach>")
    store.add_verdict(verdict("g4", "error rate", "PASS", "G4 error rate: 0.02% ≤ 0.1% → PASS", 0.02, "%",
                              {"metric": "error_rate_pct", "op": "<=", "value": 0.1}))
    store.add_verdict(verdict("g4", "p99 TTFT trend", "PASS", "G4 p99 TTFT trend: +0.3 ms/h, not significant → PASS",
                              0.3, "ms/h", {"metric": "ttft_p99_slope", "op": "<=", "value": 0}))


def build_run(root: Path, gates=("g1", "g2", "g3", "g4"), g2_ttft: bool = True) -> RunStore:
    """A run in which every requested gate passed; tests then change what they need."""
    store = RunStore(root)
    store.write_run_info({
        "run_id": "20250501-100000-ab12", "profile": "quick", "gates": list(gates), "started_at": 1746093600.0,
        "environment": {"versions": {"python": "3.11.7", "torch": "2.13.0", "kvgate": "0.1.0"},
                        "inventory": {"hosts": 1, "gpus": ["H200"], "nvme": [{"model": "PM1743", "tb": 30.7}]},
                        "config_digest": "sha256:9f2c…", "git_sha": "a9b8f0b",
                        "target_url": "http://10.0.0.5:8000/v1"},
    })
    writers = {"g1": write_g1, "g2": lambda s: write_g2(s, g2_ttft), "g3": write_g3, "g4": write_g4}
    for gate in gates:
        writers[gate](store)
        store.set_status(gate, "passed", f"{gate.upper()}: all checks passed", started_at=1746093600.0,
                         ended_at=1746097200.0, pytest_exit_code=0)
    (store.gate_dir("g1") / "junit.xml").write_text(PYTEST_JUNIT)
    return store


@pytest.fixture
def run_dir(tmp_path) -> Path:
    build_run(tmp_path / "run")
    return tmp_path / "run"


def gate_row(results: dict, gate: str) -> dict:
    return next(g for g in results["gates"] if g["gate"] == gate)


class StrictHTML(HTMLParser):
    """Fails on end tags that do not close the innermost open element."""

    VOID = frozenset({"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


# ---------------------------------------------------------------- results.json

def test_all_requested_gates_passed_gives_overall_passed(run_dir):
    results = render_run(run_dir)
    assert results["overall"]["status"] == "passed"
    assert [g["status"] for g in results["gates"]] == ["passed"] * 4
    assert json.loads((run_dir / "results.json").read_text())["overall"]["status"] == "passed"


def test_results_json_lists_gates_in_order_with_titles_verdicts_measurements_and_environment(run_dir):
    results = json.loads(json.dumps(render_run(run_dir)))
    assert results == json.loads((run_dir / "results.json").read_text())
    assert [g["gate"] for g in results["gates"]] == ["g1", "g2", "g3", "g4"]
    assert gate_row(results, "g1")["title"] == "G1 arrival acceptance"
    assert len(gate_row(results, "g3")["verdicts"]) == 8
    assert len(gate_row(results, "g2")["measurements"]) == 10
    assert results["environment"]["git_sha"] == "a9b8f0b"
    assert results["run"]["run_id"] == "20250501-100000-ab12"
    assert isinstance(results["overall"]["summary"], str) and "\n" not in results["overall"]["summary"]


def test_one_failed_gate_fails_the_run_and_stopped_gates_show_not_run_with_the_stop_reason(run_dir):
    store = RunStore(run_dir)
    store.add_verdict(verdict("g3", "TTFT p50 reduction at c=64", "FAIL",
                              "G3 TTFT p50 reduction at c=64: 12.0% < 25% → FAIL", 12.0, "%",
                              {"metric": "ttft_p50_reduction_pct", "op": ">=", "value": 25}))
    store.set_status("g3", "failed", "1 of 9 checks failed")
    (store.gate_dir("g4") / "verdicts.jsonl").unlink()
    (store.gate_dir("g4") / "measurements.jsonl").unlink()
    store.set_status("g4", "not run", "not run: stopped at G3")
    results = render_run(run_dir)
    assert results["overall"]["status"] == "failed"
    assert results["overall"]["summary"].startswith("G3 failed: 1 of 9 checks failed")
    g4 = gate_row(results, "g4")
    assert (g4["status"], g4["reason"]) == ("not run", "not run: stopped at G3")


def test_a_gate_in_error_fails_the_run(run_dir):
    RunStore(run_dir).set_status("g2", "error", "target did not start")
    assert render_run(run_dir)["overall"]["status"] == "failed"


def test_a_damaged_status_file_is_a_gate_in_error_saying_so_and_damaged_rows_are_left_out(run_dir):
    status = run_dir / "gates" / "g2" / "status.json"
    status.write_text(status.read_text()[:10])                           # torn: a damaged copy of the run
    with open(run_dir / "gates" / "g3" / "verdicts.jsonl", "a") as rows:
        rows.write('[1, 2]\n{"metric": null}\n{"status": "PA\n')        # rows of no verdict's shape
    results = render_run(run_dir)
    g2 = gate_row(results, "g2")
    assert g2["status"] == "error" and g2["reason"].startswith("its status cannot be read (") and str(status) in \
        g2["reason"]
    assert results["overall"]["status"] == "failed"
    assert gate_row(results, "g3")["status"] == "passed"                  # the whole rows read as before


@pytest.mark.parametrize("damage, said", [
    (lambda run: (run / "run.json").unlink() or (run / "run.json").mkdir(),
     "expected a run's JSON object, found a directory"),
    (lambda run: (run / "sizing.json").write_text('{"compar'), "expected a JSON object, found unreadable JSON"),
    (lambda run: (run / "preflight.json").write_text('{"a": 1}'), "expected a JSON list, found a dict"),
])
def test_kvgate_report_on_a_damaged_run_file_is_exit_2_naming_it(run_dir, capsys, damage, said):
    damage(run_dir)
    assert main([str(run_dir)]) == 2
    assert said in capsys.readouterr().err


def test_a_report_kvgate_cannot_write_is_exit_2_naming_the_run_and_leaves_no_temp_file(run_dir, capsys):
    (run_dir / "index.html").mkdir()                     # the report's place taken: it cannot be replaced
    assert main([str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert "expected a run directory kvgate can write its report into" in error and str(run_dir) in error
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_inconclusive_gate_without_a_failure_makes_the_run_inconclusive(run_dir):
    store = RunStore(run_dir)
    store.add_verdict(verdict("g4", "memory trend", "INCONCLUSIVE", "G4 memory trend: interval straddles 0",
                              1.2, "MB/h", {"metric": "rss_slope", "op": "<=", "value": 0}, interval=[-0.4, 2.8]))
    store.set_status("g4", "inconclusive", "memory trend inconclusive")
    assert render_run(run_dir)["overall"]["status"] == "inconclusive"


def test_failure_outranks_inconclusive(run_dir):
    store = RunStore(run_dir)
    store.set_status("g2", "inconclusive", "too few requests")
    store.set_status("g3", "failed", "throughput gain below band")
    assert render_run(run_dir)["overall"]["status"] == "failed"


def test_a_run_killed_mid_gate_is_said_interrupted_while_a_live_one_is_running(run_dir):
    from gates.run_claim import claim_run_dir

    (RunStore(run_dir).gate_dir("g3") / "status.json").unlink()      # killed in G3: verdicts, no status
    (RunStore(run_dir).gate_dir("g4") / "status.json").unlink()      # and G4 never started
    shutil.rmtree(RunStore(run_dir).gate_dir("g4"))
    with claim_run_dir(run_dir, "live", new=False):                  # while the run holds its directory
        results = render_run(run_dir)
        assert gate_row(results, "g3")["status"] == "running" and gate_row(results, "g4")["reason"] == "not run yet"
    results = render_run(run_dir)                                    # its lock let go, no end written: killed
    assert gate_row(results, "g3")["status"] == "interrupted"
    assert gate_row(results, "g3")["reason"].startswith("the run ended mid-gate (") and "verdicts" in \
        gate_row(results, "g3")["reason"]
    assert gate_row(results, "g4")["reason"] == "interrupted: the run ended before this gate started"
    assert results["overall"]["status"] == "incomplete"


def test_gate_with_verdicts_but_no_status_is_running_and_the_run_incomplete(run_dir):
    (RunStore(run_dir).gate_dir("g4") / "status.json").unlink()
    results = render_run(run_dir)
    assert gate_row(results, "g4")["status"] == "running"
    assert results["overall"]["status"] == "incomplete"
    assert "G4 running" in results["overall"]["summary"]


def test_a_running_gate_with_a_failed_verdict_names_it_in_the_summary(run_dir):
    store = RunStore(run_dir)
    (store.gate_dir("g4") / "status.json").unlink()
    store.add_verdict(verdict("g4", "consistency probes", "FAIL", "G4 consistency: 2 of 500 probes differ → FAIL",
                              99.6, "%", {"metric": "probe_identical_pct", "op": ">=", "value": 100}))
    results = render_run(run_dir)
    assert results["overall"]["status"] == "incomplete"
    assert "3 verdicts (1 FAIL)" in results["overall"]["summary"]


def test_requested_gate_never_started_makes_the_run_incomplete(tmp_path):
    build_run(tmp_path, gates=("g1", "g2"))
    info = RunStore(tmp_path).run_info()
    RunStore(tmp_path).write_run_info({**info, "gates": ["g1", "g2", "g3"]})
    results = render_run(tmp_path)
    assert gate_row(results, "g3")["status"] == "not run"
    assert results["overall"]["status"] == "incomplete"


def test_gates_not_requested_do_not_keep_the_run_from_passing(tmp_path):
    build_run(tmp_path, gates=("g1", "g2"))
    results = render_run(tmp_path)
    assert results["overall"]["status"] == "passed"
    assert (gate_row(results, "g4")["status"], gate_row(results, "g4")["reason"]) == ("not run", "not requested")


def test_rerendering_gives_the_same_results_json(run_dir):
    render_run(run_dir)
    first = (run_dir / "results.json").read_text()
    render_run(run_dir)
    assert (run_dir / "results.json").read_text() == first


# ---------------------------------------------------------------- junit.xml

def test_junit_has_one_testsuite_per_gate_with_failure_and_skipped_counts(run_dir):
    store = RunStore(run_dir)
    store.add_verdict(verdict("g3", "throughput gain at c=128", "FAIL",
                              "G3 throughput gain at c=128: 21% < 29% → FAIL",
                              21.0, "%", {"metric": "throughput_gain_pct", "min": 29, "max": 40}))
    store.add_verdict(verdict("g3", "TTFT p50 reduction at c=128", "INCONCLUSIVE", "interval [22, 28] straddles 25%",
                              25.5, "%", {"metric": "ttft_p50_reduction_pct", "op": ">=", "value": 25}))
    store.set_status("g3", "failed", "throughput gain below band")
    for name in ("verdicts.jsonl", "measurements.jsonl"):
        (store.gate_dir("g4") / name).unlink()
    store.set_status("g4", "not run", "not run: stopped at G3")
    render_run(run_dir)
    root = ET.parse(run_dir / "junit.xml").getroot()
    suites = root.findall("testsuite")
    assert root.tag == "testsuites"
    assert [s.get("name").split()[0] for s in suites] == ["g1", "g2", "g3", "g4"]
    counts = {s.get("name").split()[0]: (int(s.get("tests")), int(s.get("failures")), int(s.get("skipped")))
              for s in suites}
    assert counts == {"g1": (4, 1, 1), "g2": (2, 0, 0), "g3": (10, 2, 0), "g4": (1, 0, 1)}
    g3_messages = [f.get("message") for f in suites[2].iter("failure")]
    assert "INCONCLUSIVE: interval [22, 28] straddles 25%" in g3_messages
    assert suites[3].find("testcase/skipped").get("message") == "not run: stopped at G3"
    assert int(root.get("failures")) == 3 and int(root.get("tests")) == 17


def test_junit_keeps_the_pytest_testcases_of_a_gate_that_has_its_own_report(run_dir):
    render_run(run_dir)
    g1 = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    assert g1.get("name") == "g1 arrival acceptance" and g1.get("hostname") == "node-a"
    assert g1.find("testcase").get("name") == "test_seq_read_bandwidth"


def test_junit_of_a_running_gate_marks_the_unfinished_gate_skipped(run_dir):
    (RunStore(run_dir).gate_dir("g4") / "status.json").unlink()
    render_run(run_dir)
    g4 = ET.parse(run_dir / "junit.xml").getroot().findall("testsuite")[3]
    assert (int(g4.get("tests")), int(g4.get("skipped"))) == (3, 1)


# ---------------------------------------------------------------- index.html

def test_index_html_is_well_formed_and_self_contained(run_dir):
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    parser = StrictHTML()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    for forbidden in ("http://", "https://", "<script", "@import", "<link", "xlink:", "xmlns", "<!DOCTYPE svg"):
        assert forbidden not in page
    assert not re.search(r"url\((?!#)", page)       # only references inside the page (a chart's clip paths)
    assert "10.0.0.5:8000/v1" in page  # the target URL is shown, just not as a literal link
    ids = re.findall(r'\sid="([^"]+)"', page)
    assert len(ids) == len(set(ids))                  # no two charts share an id their references resolve to
    for reference in set(re.findall(r'(?:href="#|url\(#)([^")]+)', page)):
        assert reference in ids


def test_index_html_shows_the_overall_verdict_before_the_first_gate_section(run_dir):
    store = RunStore(run_dir)
    store.set_status("g2", "failed", "disk cold-read too slow")
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    first_gate = page.index('<section class="gate')
    assert page.index('class="overall failed"') < page.index(">FAILED<") < first_gate
    assert page.index("20250501-100000-ab12") < first_gate
    assert page.index('id="g1"') < page.index('id="g2"') < page.index('id="g3"') < page.index('id="g4"') \
        < page.index('id="environment"')


def test_index_html_shows_every_verdict_reason_and_the_environment(run_dir):
    results = render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    for gate in results["gates"]:
        for v in gate["verdicts"]:
            assert v["reason"].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in page
    for text in ("a9b8f0b", "sha256:9f2c…", "2.13.0", "PM1743"):
        assert text in page


def test_index_html_has_a_plot_for_each_gate_with_plot_data(run_dir):
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    titles = ("G1 headroom over the spec sheet", "G2 TTFT by context length", "G3 TTFT p50 reduction by concurrency",
              "G3 throughput gain by concurrency", "G3 TTFT p50 by concurrency",
              "G3 output throughput by concurrency", "G4 windowed TTFT p99")
    for title in titles:
        assert f"<title>{title}</title>" in page
    svgs = re.findall(r"<svg\b.*?</svg>", page, flags=re.S)
    assert len(svgs) == len(titles)                   # one chart per titled figure, inline
    assert all('class="chart' in chart and "<text" in chart for chart in svgs)   # text stays text
    assert "disk detach &amp; &lt;reattach&gt;" in svgs[-1]                      # the G4 fault marker's label


def test_rerendering_draws_the_same_charts_byte_for_byte(run_dir):
    render_run(run_dir)
    first = re.findall(r"<svg\b.*?</svg>", (run_dir / "index.html").read_text(), flags=re.S)
    render_run(run_dir)
    assert re.findall(r"<svg\b.*?</svg>", (run_dir / "index.html").read_text(), flags=re.S) == first


def test_index_html_skips_a_plot_whose_data_is_absent(tmp_path):
    build_run(tmp_path, g2_ttft=False)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "G2 TTFT by context length" not in page
    g2 = page[page.index('id="g2"'):page.index('id="g3"')]
    assert "<svg" not in g2 and "disk-hit TTFT ratio" in g2


def test_index_html_plots_g2_cold_read_pairs_round_by_round_and_lists_each_pair(tmp_path):
    store = build_run(tmp_path, gates=("g1", "g2"), g2_ttft=False)
    for i, (tier, fio) in enumerate([(1.1, 2.0), (2.6, 3.4), (0.9, 1.3)]):
        store.record("g2", "cold read", "cold_read_pair", tier / fio, round=i, tier_gbps=tier, fio_gbps=fio,
                     tier_bytes=33554432, tier_seconds=33554432 / tier / 1e9, fio_bytes=33554432,
                     fio_seconds=33554432 / fio / 1e9)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    g2 = page[page.index('id="g2"'):page.index('id="g3"')]
    assert g2.count("<svg") == 1 and "G2 cold-read bandwidth, sequential pairs" in g2
    assert "disk tier cold load" in g2 and "the storage's best read job" in g2
    assert "own pattern" not in g2                          # no same-pattern leg recorded: no such line drawn
    assert g2.count("cold_read_pair") == 3 and "round=2, tier_gbps=0.9, fio_gbps=1.3" in g2


def test_g2_model_load_and_checkpoint_figures_are_tables_with_phases_and_bars_against_the_best_job(tmp_path):
    store = build_run(tmp_path, gates=("g1", "g2"), g2_ttft=False)
    for i in range(5):
        for loader, gbps, fio in (("safetensors", 0.6, 1.5), ("runai_streamer", 1.3, 1.45)):
            store.record("g2", "model_load_rounds", "model_load_round", gbps, "GB/s", loader=loader, round=i,
                         seconds=1.07 / gbps, bytes=1_073_741_824, fio_gbps=fio, ratio=gbps / fio, cold=i > 0,
                         identical=True, phases={"open": 0.01, "read": 1.5 + i, "deserialize": 0.0, "copy": 0.2},
                         storage="under test")
    store.record("g2", "model_load_rounds", "model_load_loader", 0.9, "%", loader="runai_streamer",
                 interval=[0.85, 0.95], pairs=5, warm_gbps=1.37, warm_read_device=True)
    store.record("g2", "model_load_rounds", "model_load_loader", 0.5, "%", loader="safetensors",
                 interval=[0.4, 0.6], pairs=5, warm_gbps=5.2, warm_read_device=False)
    store.record("g2", "service", "service_load", 4.2, "s", loader="safetensors", round=0,
                 phases={"imports": 3.1, "weights": 0.3, "ready": 0.7, "first_token": 0.1},
                 weights={"loader": "safetensors", "seconds": 0.05, "nbytes": 5_000_000})
    for i in range(2):
        store.record("g2", "checkpoint_saves", "checkpoint_save_round", 1.1, "GB/s", round=i, slowest_s=0.51,
                     rank_seconds=[0.5, 0.51], bytes=560_000_000, fio_gbps=1.4, ratio=0.79, storage="under test",
                     **({"warmup": True} if i == 0 else {}))
    store.record("g2", "checkpoint_restores", "checkpoint_restore_round", 1.8, "GB/s", round=0, slowest_s=0.31,
                 rank_seconds=[0.3, 0.31], bytes=560_000_000, equal=True, cold=True, storage="under test")
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    g2 = page[page.index('id="g2"'):page.index('id="g3"')]
    assert "Model load: cold rounds per loader (medians)" in g2
    table = g2[g2.index("Model load: cold rounds per loader"):g2.index("Service load")]
    # runai_streamer's row: median GB/s 1.30, fio 1.45, its judged ratio with interval, read phase median 3.5 s
    assert "<td>runai_streamer</td>" in table and "90.0% [85.0%, 95.0%]" in table and ">3.500<" in table
    assert ">4 / 5<" in table and ">5 / 5<" in table            # cold rounds, identical rounds
    assert ">1.37 (read the device: O_DIRECT)<" in table and ">5.20<" in table     # warm loads, apart
    assert "Service load: process start to first token" in g2 and ">3.100<" in g2 and ">0.10<" in g2   # 5 MB in 0.05 s
    assert "Checkpoint save: each round" in g2 and "0.500, 0.510" in g2 and ">79.0%<" in g2
    assert g2.count("(warm-up, not judged)") == 1
    assert "Checkpoint restore: each round" in g2 and ">yes<" in g2
    assert "G2 model load: cold GB/s per loader (medians)" in g2 and "the best read job, same files" in g2
    assert "G2 checkpoint: save and cold restore GB/s per round" in g2 and "the best fsync'd write job" in g2


def test_user_controlled_strings_are_escaped_in_html_and_svg(run_dir):
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    assert HOSTILE not in page and "<reattach>" not in page
    assert "seq read &lt;b&gt;&amp;amp; friends" in page
    assert "disk detach &amp; &lt;reattach&gt;" in page  # the G4 fault marker label
    ET.fromstring(ET.tostring(ET.parse(run_dir / "junit.xml").getroot()))  # the hostile name survives in XML too


def test_main_rerenders_a_run_directory_and_reports_a_missing_one(run_dir, capsys):
    assert main([str(run_dir)]) == 0
    assert "report:" in capsys.readouterr().out and (run_dir / "index.html").exists()
    assert main([str(run_dir / "missing")]) == 2


def test_the_g4_plots_shade_the_windows_left_out_of_the_drift_checks(run_dir):
    store = RunStore(run_dir)
    store.record("g4", "fault windows left out of the drift checks", "drift_excluded_window", 7200, "s",
                 window=8, window_start_s=7200, window_end_s=8100, kind="read_error",
                 reason="read_error at 7300 s (s 7300.2 to 7312.0, recovered)")
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    g4 = page[page.index('id="g4"'):page.index('id="environment"')]
    assert "left out of the drift checks (warm-up, faults)" in g4   # the shaded spans' legend entry
    assert "#6b7280; opacity: 0.15" in g4.replace("fill-opacity", "opacity")   # the span itself, shaded grey


def test_a_check_measured_but_not_judged_is_shown_at_the_top_of_its_gate_section(tmp_path):
    from kvcore.rundata import Unjudged

    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g1"], "started_at": 1.7e9})
    store.add_verdict(verdict("g1", "seq read", "PASS", "G1 fio sequential read: 2 GB/s ≥ 0.1 GB/s → PASS", 2.0,
                              "GB/s", {"metric": "seq_read_gbps", "op": ">=", "value": 0.1}))
    store.add_unjudged(Unjudged("g1", "mixed", "mixed_70_30_iops", "G1 fio mixed 70/30 4 KiB",
                                "no threshold for 'mixed_70_30_iops' in g1.thresholds", value=41000.0, unit="IOPS"))
    store.set_status("g1", "passed", "1 checks passed")
    results = render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    section = page[page.index('id="g1"'):]
    assert section.index("Not judged") < section.index("<h3>Verdicts</h3>")
    assert "G1 fio mixed 70/30 4 KiB: 41,000 IOPS" in section
    assert "no threshold for &#39;mixed_70_30_iops&#39; in g1.thresholds" in section
    assert results["gates"][0]["unjudged"][0]["metric"] == "mixed_70_30_iops"


def test_g3s_section_says_which_replay_ran(run_dir):
    sentence = "G3 replayed the trace open loop at 1×, 2× its arrival rate (32 users); each level its own 150 ..."
    RunStore(run_dir).record("g3", "test_the_replay_is_stated", "replay", sentence, mode="rate_multipliers")
    render_run(run_dir)
    page = (run_dir / "index.html").read_text()
    g3 = page[page.index('id="g3"'):]
    assert f'<p class="gate-replay">{sentence}</p>' in g3 and g3.index(sentence) < g3.index("<h3>Verdicts</h3>")


def test_the_report_shows_each_targets_pre_flight(tmp_path):
    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g3"], "started_at": 1.7e9})
    store.write_preflight([
        {"role": "baseline", "url": "http://127.0.0.1:9/v1", "model": "m", "ok": False,
         "problem": "connection refused", "ttft_s": None},
        {"role": "candidate", "url": "http://127.0.0.1:8001/v1", "model": "m", "ok": True, "problem": "",
         "ttft_s": 0.0421, "sizer": "tokenizer /models/m",
         "abilities": {"clear_device_cache": {"available": True, "how": "POST /reset_prefix_cache"},
                       "clear_lower_tiers": {"available": False, "how": "not applicable: kv_offloading_size=None"}},
         "absent_tiers": {"disk": "vLLM alone keeps no KV on disk"}}])
    results = render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    start = page.index('<section class="preflight">')
    section = page[start:page.index("</section>", start)]
    assert "<td>baseline</td>" in section and "<td>connection refused</td>" in section
    assert "<td>candidate</td>" in section and "42.1 ms" in section and "<td>tokenizer /models/m</td>" in section
    assert "no clear_lower_tiers: not applicable: kv_offloading_size=None" in section
    assert "no disk tier: vLLM alone keeps no KV on disk" in section and "no clear_device_cache" not in section
    assert [row["role"] for row in results["preflight"]] == ["baseline", "candidate"]


def test_a_rate_multiplier_sweep_is_plotted_by_its_multipliers(tmp_path):
    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g3"], "started_at": 1.7e9})
    for m in (1, 2, 4):
        store.record("g3", "sweep", "ttft_p50_ms", 100 * m, "ms", target="baseline", multiplier=m)
        store.record("g3", "sweep", "ttft_p50_ms", 40 * m, "ms", target="candidate", multiplier=m)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "<title>G3 TTFT p50 by rate multiplier</title>" in page
    assert "rate multiplier (× the trace's arrival rate)" in page


def test_the_claims_table_opens_the_report_with_promised_measured_and_verdict(tmp_path):
    store = build_run(tmp_path, gates=("g1", "g2"), g2_ttft=False)
    store.record("g2", "disk", "disk_hit_ttft_vs_recompute", 0.075, context_tokens=8192)
    store.add_verdict(verdict("g2", "disk", "PASS", "G2 disk-hit TTFT: 7.5% ≤ 25% → PASS", 0.075, "%",
                              {"metric": "disk_hit_ttft_vs_recompute", "op": "<=", "value": 0.25},
                              context={"context_tokens": 8192}))        # a claim takes judged verdicts only
    results = render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    claims = page[page.index('<section class="claims"'):page.index("</section>", page.index('<section class="claims"'))]
    assert page.index('<section class="claims"') < page.index('id="g1"')
    assert "a cache hit 8.6–20× faster than recompute" in claims and ">8.6× – 20.0×<" in claims
    assert ">13.3×<" in claims and "<td>met</td>" in claims
    # G3 did not run: its claims are not measured, and the table says why
    assert "G3 did not run" in claims and "not measured" in claims
    row = next(r for r in results["claims"] if r["id"] == "speedup_over_recompute")
    assert row["verdict"] == "met" and abs(row["measured"] - 1 / 0.075) < 1e-9


def test_the_storage_sweep_and_g2s_sequential_pairs_are_tables_with_the_best_job_and_why_sampling_stopped(tmp_path):
    store = build_run(tmp_path, gates=("g1", "g2"), g2_ttft=False)
    shape = {"direct": True, "ioengine": "io_uring", "iodepth": 32, "numjobs": 4, "bs": "16M"}
    for i, gbps in enumerate([0.7, 1.9, 1.2]):
        store.record("g1", "storage_sweep", "storage_sweep_point", gbps, "GB/s", index=i, kind="read",
                     raw=f"fio-sweep-{i:02d}-read.json", **{**shape, "iodepth": [1, 32, 4][i]})
    store.record("g1", "storage_sweep", "storage_best_read_gbps", 1.9, "GB/s", kind="read", **shape)
    store.record("g2", "cold read", "cold_read_vs_storage_best", 0.42, "%", pairs=7, interval=[0.3, 0.6],
                 stopping={"pairs": 7, "decided": True, "why": "decided after 7 pairs"}, best=shape,
                 best_source="G1's sweep", same_pattern_ratio=0.98, aa=False)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    g1 = page[page.index('id="g1"'):page.index('id="g2"')]
    g2 = page[page.index('id="g2"'):page.index('id="g3"')]
    assert "Storage sweep: every point" in g1 and "fio-sweep-01-read.json" in g1 and g1.count(">best<") == 1
    table = g2[g2.index("sequential pairs (Lai"):]
    assert "decided after 7 pairs" in table and "[0.30, 0.60]" in table and ">0.98<" in table
    assert "direct, io_uring, iodepth 32, 4 jobs, 16M" in table        # no picks recorded: the sweep's winner
    streaming = {
        "direct": {**shape, "numjobs": 1, "bs": "1M", "sweep_gbps": 1.7},
        "buffered": {**shape, "direct": False, "ioengine": "psync", "iodepth": 1, "bs": "1M", "sweep_gbps": 1.5},
    }
    store.record("g2", "model load", "model_load_vs_storage_best", 0.7, "%", pairs=5, interval=[0.5, 0.9],
                 stopping={"pairs": 5, "decided": False, "why": "budget"}, best=shape, best_modes=streaming,
                 best_source="G1's sweep", aa=False)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    row = page[page.index("model_load_vs_storage_best</td>"):]
    row = row[:row.index("</tr>")]
    # the jobs that ran beside the loaders, not the sweep's 16 MiB winner
    assert "direct, io_uring, iodepth 32, 1 jobs, 1M or buffered, psync, iodepth 1, 4 jobs, 1M" in row
    assert "16M" not in row


def test_g3s_section_shows_the_block_sampling_each_block_and_the_aa_count(tmp_path):
    from kvcore.aa import AA_FALSE_DECISION
    from kvcore.rundata import Verdict

    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g3"], "started_at": 1.7e9})
    about = {"concurrency": 2, "blocks": 4, "decided": False, "pairs_used": 3, "pairs_left_out": 1,
             "stopped": "not decided after 4 pairs (the most allowed)", "method": "Lai's t confidence sequence"}
    store.add_verdict(Verdict("g3", "c2", "ttft_p50_reduction", "INCONCLUSIVE", "straddles", 0.24, "%",
                              {"metric": "ttft_p50_reduction", "op": ">=", "value": 0.25}, (0.1, 0.4), context=about))
    for k, (target, position) in enumerate([("baseline", 0), ("candidate", 1), ("candidate", 0), ("baseline", 1)]):
        store.record("g3", "sweep", "g3_block", 100.0 + k, "ms", target=target, block=k // 2, position=position,
                     started_at=1000.0 + 10 * k, ttft_p50_ms=100.0 + k, output_tokens_per_s=50.0, requests=9,
                     valid=k != 3, reasons="" if k != 3 else "client saturated", concurrency=2)
    for value in (0, 1):
        store.record("g3", "aa", AA_FALSE_DECISION, value, judged="ttft_p50_reduction", concurrency=2)
    store.set_status("g3", "inconclusive", "straddles")
    render_run(tmp_path)
    g3 = (tmp_path / "index.html").read_text()
    g3 = g3[g3.index('id="g3"'):]
    assert "A/A: 1 of 2 intervals excluded 0" in g3
    assert "Block pairs per level" in g3 and "Lai&#39;s t confidence sequence" in g3
    assert "not decided after 4 pairs (the most allowed)" in g3 and "3 used, 1 left out" in g3
    assert "24.0% [10.0, 40.0]" in g3
    assert "Each block: baseline and candidate in turn" in g3 and "NO: client saturated" in g3


def test_kvgate_report_skips_a_jsonl_line_of_invalid_utf8_as_a_bad_line(run_dir, capsys):
    """Before: bytes that are not UTF-8 in a run's JSONL ended `kvgate report` in a UnicodeDecodeError traceback."""
    from gates.cli import main as kvgate

    measurements = run_dir / "gates" / "g1" / "measurements.jsonl"
    with open(measurements, "ab") as handle:
        handle.write(b'{"gate": "g1", "check": "bad \xff\xfe bytes", "metric": "x", "value": 1}\n')
    RunStore(run_dir).record("g1", "after the bad line", "seq_read_gbps", 7.0, "GB/s")
    assert kvgate(["report", str(run_dir)]) == 0
    assert "report: " in capsys.readouterr().out
    checks = [m["check"] for m in RunStore(run_dir).measurements("g1")]
    assert "after the bad line" in checks and "seq read" in checks and not any("bytes" in c for c in checks)
