"""The gate plugin: only declared checks are judged, a figure without a rule is listed as not judged,
and a test that only records figures is not counted as a passing check (a real pytest run of a suite)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from gates.config import load_config
from kvcore.rundata import RunStore

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
def test_records_only(record):
    record("seq_read_gbps", 2.0, "GB/s")

def test_judges_a_configured_check(record, verdict):
    verdict("G1 fio sequential read", "seq_read_gbps", 2.0, unit="GB/s")

def test_judges_a_check_with_no_rule(verdict):
    verdict("G1 fio mixed 70/30 4 KiB", "mixed_70_30_iops", 41000.0, unit="IOPS")

def test_judges_a_default_rule(verdict):
    verdict("G1 fio crc32c verify", "fio_verify_errors", 1)

def test_judges_an_undeclared_metric(verdict):
    verdict("G1 something", "throughput_gian", 1.0)
'''


def _run_suite(tmp_path: Path) -> tuple[RunStore, dict]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(None, "quick")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "gates": ["g1"]}))
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_suite.py").write_text(SUITE)
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(suite), "-p", "gates.plugin", "-p", "no:cacheprovider",
                    "--rootdir", str(tmp_path), "--kvgate-run-dir", str(run_dir), "--kvgate-gate", "g1",
                    "--junitxml", str(junit), "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    cases = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("skipped", "failure", "error")), "passed")
        message = next((child.get("message", "") for child in case if child.tag != "system-out"), "")
        cases[case.get("name")] = (outcome, message)
    return RunStore(run_dir), cases


def test_only_declared_checks_are_judged_and_unjudged_figures_are_listed(tmp_path):
    store, cases = _run_suite(tmp_path)
    assert cases["test_judges_a_configured_check"][0] == "passed"
    assert cases["test_records_only"] == ("skipped", "recorded only: this test stores figures and judges nothing")
    outcome, message = cases["test_judges_a_check_with_no_rule"]
    assert outcome == "skipped" and "measured, not judged" in message
    assert cases["test_judges_a_default_rule"][0] == "failure"          # fio_verify_errors == 0 by default
    assert cases["test_judges_an_undeclared_metric"][0] == "failure"
    assert "g1 judges no metric 'throughput_gian'" in cases["test_judges_an_undeclared_metric"][1]
    assert [v["metric"] for v in store.verdicts("g1")] == ["seq_read_gbps", "fio_verify_errors"]
    [unjudged] = store.unjudged("g1")
    assert unjudged["metric"] == "mixed_70_30_iops" and unjudged["value"] == 41000.0
    assert "no threshold for 'mixed_70_30_iops' in g1.thresholds" in unjudged["reason"]
    # a verdict's own FAIL is not an error; judging an undeclared metric raised outside any verdict: it is
    [errored] = store.errors("g1")
    assert (errored["check"], errored["phase"]) == ("test_judges_an_undeclared_metric", "call")
    assert "g1 judges no metric 'throughput_gian'" in errored["reason"] and "\n" not in errored["reason"]


def test_every_metric_a_gate_suite_judges_is_declared():
    """Each `verdict(label, "metric", …)` in the gate suites names a check of its gate's table."""
    import re

    from kvcore.checks import CHECKS

    for gate, folder in (("g1", "g1_arrival"), ("g2", "g2_baseline"), ("g3", "g3_main"), ("g4", "g4_soak")):
        declared = {c.metric for c in CHECKS[gate]}
        source = "\n".join(p.read_text() for p in (ROOT / "gates" / folder).glob("*.py"))
        named = set(re.findall(r'verdict\([^)]*?,\s*"([a-z0-9_]+)"', source, re.S))
        assert named <= declared, f"{gate}: undeclared {sorted(named - declared)}"
    from gates.g1_arrival.test_g1_arrival import FIO_CHECKS

    assert {c[0] for c in FIO_CHECKS} <= {c.metric for c in CHECKS["g1"]}
