"""A check that errs outside its verdict (a fixture's setup error, an exception in the test) is a row with its
reason in the run store, the console, results.json, index.html, junit.xml and the claims table: never only in
pytest.log (a real `GateRunner.run` of a small gate suite in its own pytest process)."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml
from rich.console import Console

from gates.config import load_config
from gates.run import GateRunner
from kvcore.rundata import RunStore

ROOM = "G2 checkpoint: /mnt/small: expected room for 0.42 GB (two checkpoints), found 0.07 GB free"
EMPTY = "cold-read round 0: the load read nothing"

SUITE = f'''
import pytest

METRIC = "seq_write_gbps"


@pytest.fixture(scope="module")
def saves():
    pytest.fail({ROOM!r}, pytrace=False)


def test_write_reaches_the_spec(saves, verdict):
    verdict("G1 write", METRIC, 1.0, unit="GB/s")


def test_every_save_completed(saves, verdict):
    verdict("G1 saves", "seq_write_gbps", 1.0, unit="GB/s")


def test_read_reaches_the_spec(verdict):
    raise RuntimeError({EMPTY!r} + "\\nsecond line of the message")


def test_iops_reach_the_spec(verdict):
    verdict("G1 random read", "rand_read_iops", 5000.0, unit="IOPS")
'''


class _SuiteRunner(GateRunner):
    """The real runner, its gate suite a small one written for the test."""

    def __init__(self, suite: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.suite = suite

    def suite_path(self, gate: str) -> Path:
        return self.suite


def _run(tmp_path: Path) -> tuple[int, Path, str]:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["gates.plugin"]\n')
    (suite / "test_suite.py").write_text(SUITE)
    claim = {"id": "write_gbps", "label": "sequential write 3 GB/s", "gate": "g1", "metric": "seq_write_gbps",
             "min": 3.0, "unit": "GB/s", "needs": "fio write jobs"}
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump({"storage": {"path": str(tmp_path / "storage")},
                                                         "claims": [claim]}))
    out = io.StringIO()
    runner = _SuiteRunner(suite, config=load_config(tmp_path / "gates.yaml"), run_dir=tmp_path / "run", run_id="r",
                          gates=["g1"], continue_on_fail=False, console=Console(file=out, width=300))
    return runner.run(), tmp_path / "run", out.getvalue()


def test_every_errored_check_is_a_row_with_its_reason_in_the_store_console_json_html_junit_and_claims(tmp_path):
    code, run_dir, console = _run(tmp_path)
    assert code == 1
    errors = RunStore(run_dir).errors("g1")
    assert [(e["check"], e["phase"], e["reason"]) for e in errors] == [
        ("test_write_reaches_the_spec", "setup", ROOM),
        ("test_every_save_completed", "setup", ROOM),
        ("test_read_reaches_the_spec", "call", f"RuntimeError: {EMPTY}")]   # one line, no traceback
    assert errors[0]["metrics"] == ["seq_write_gbps"]      # what the check would have judged (its module's METRIC)

    # the console: each errored check as it happened, and the gate's status with the first one's reason
    assert f"ERROR        test_write_reaches_the_spec: {ROOM}" in console
    assert f"ERROR        test_read_reaches_the_spec: RuntimeError: {EMPTY}" in console
    assert "G1 arrival acceptance: ERROR" in console and "3 checks errored" in console
    assert "second line" not in console and "crashed outside its verdict" not in console

    results = json.loads((run_dir / "results.json").read_text())
    g1 = next(g for g in results["gates"] if g["gate"] == "g1")
    assert g1["status"] == "error" and g1["reason"].startswith(f"test_write_reaches_the_spec: {ROOM}")
    assert [e["reason"] for e in g1["errors"]] == [ROOM, ROOM, f"RuntimeError: {EMPTY}"]
    assert [v["metric"] for v in g1["verdicts"]] == ["rand_read_iops"]          # the judged check is still there

    page = (run_dir / "index.html").read_text()
    section = page[page.index('id="g1"'):page.index('id="g2"')]
    assert section.index("Errored") < section.index("<h3>Verdicts</h3>")
    assert "<td>test_read_reaches_the_spec</td>" in section and f"RuntimeError: {EMPTY}" in section
    assert "3 errored" in page[:page.index('id="g1"')]                           # the gate's card says so

    claim = results["claims"][0]
    assert claim["verdict"] == "not measured"
    assert claim["note"] == f"G1 test_write_reaches_the_spec errored: {ROOM}"
    assert claim["note"] in page

    cases = {c.get("name"): c for c in ET.parse(run_dir / "junit.xml").getroot().iter("testcase")}
    for name in ("test_write_reaches_the_spec", "test_every_save_completed"):     # pytest's own cases, kept
        assert ROOM in cases[name].find("error").get("message")
    assert EMPTY in cases["test_read_reaches_the_spec"].find("failure").get("message")
