"""A real `kvgate run g1 g2` against the embedded servers: the report agrees with the raw data."""

import json
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import yaml

from gates.cli import main
from kvcore.rundata import RunStore

pytestmark = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")

SMALL = {
    "profile": "quick",
    "targets": {"embedded": {"preset": "tiny", "max_running": 2, "device_capacity_blocks": 16,
                             "host_capacity": "64MiB", "disk_capacity": "256MiB"}},
    "inventory": {"min_cpu_cores": 1, "min_memory_gib": 1},
    "fio": {"size": "32M", "runtime_s": 1, "verify_size": "8M"},
    "g2": {"contexts": [600, 1100], "rounds": 1},
}


class _Strict(HTMLParser):
    def error(self, message):  # pragma: no cover - html.parser calls it only on hard errors
        raise AssertionError(message)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("kvgate-run")
    config = {**SMALL, "storage": {"path": str(work / "storage")}}
    (work / "gates.yaml").write_text(yaml.safe_dump(config))
    code = main(["run", "g1", "g2", "--config", str(work / "gates.yaml"), "--out", str(work / "run")])
    return code, work / "run"


def test_the_run_judges_g1_and_g2_and_its_exit_code_follows_the_verdicts(run):
    code, run_dir = run
    results = json.loads((run_dir / "results.json").read_text())
    statuses = {g["gate"]: g["status"] for g in results["gates"]}
    assert statuses["g1"] in ("passed", "failed", "inconclusive") and statuses["g2"] != "error"
    assert statuses["g3"] == statuses["g4"] == "not run"
    assert code == (0 if results["overall"]["status"] == "passed" else 1)
    store = RunStore(run_dir)
    assert len(store.verdicts("g1")) >= 7          # inventory, five fio figures, verify
    assert {m["context"]["mode"] for m in store.measurements("g2") if m["metric"] == "ttft_ms"} == {
        "recompute", "host-hit", "disk-cold"}


def test_results_json_holds_exactly_the_verdicts_the_checks_appended(run):
    _, run_dir = run
    results = json.loads((run_dir / "results.json").read_text())
    store = RunStore(run_dir)
    for gate in results["gates"]:
        stored = [(v["check"], v["status"], v["reason"]) for v in store.verdicts(gate["gate"])]
        assert [(v["check"], v["status"], v["reason"]) for v in gate["verdicts"]] == stored


def test_the_html_report_parses_has_no_external_urls_and_shows_every_verdict(run):
    _, run_dir = run
    html = (run_dir / "index.html").read_text()
    _Strict().feed(html)
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    for verdict in RunStore(run_dir).verdicts():
        assert verdict["check"] in html
    assert html.count("<svg") >= 2                   # G1 bars and G2 TTFT by context
    suites = ET.parse(run_dir / "junit.xml").getroot().findall("testsuite")
    assert len(suites) == 4


def test_kvgate_report_re_renders_the_same_results(run, capsys):
    _, run_dir = run
    before = (run_dir / "results.json").read_text()
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "results.json").read_text() == before
    assert "report:" in capsys.readouterr().out
