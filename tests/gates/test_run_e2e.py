"""A real `kvgate run g1 g2` against the embedded servers: the report agrees with the raw data."""

import json
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from gates.cli import main
from kvcore.rundata import RunStore

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")]

class _Strict(HTMLParser):
    def error(self, message):  # pragma: no cover - html.parser calls it only on hard errors
        raise AssertionError(message)


@pytest.fixture(scope="module")
def run(g1_g2_run):
    """The session's `kvgate run g1 g2` (tests/gate_runs.py), shared with the sizing model's module."""
    return g1_g2_run.code, g1_g2_run.run_dir


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
    # two rounds of each: the second's hits ask for the prefix the first computed, placed again, each from its tier
    rounds = [(m["context"]["mode"], m["context"]["context_tokens"], m["context"]["round"])
              for m in store.measurements("g2") if m["metric"] == "ttft_round_ms"]
    assert sorted(rounds) == sorted((mode, context, r) for mode in ("recompute", "host-hit", "disk-cold")
                                    for context in (600, 1100) for r in (0, 1))
    placed = [m for m in store.measurements("g2") if m["metric"] == "placed_hit"]
    assert len(placed) == 8 and all(m["value"] is True for m in placed), placed


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


def test_g2_measures_every_loader_and_every_checkpoint_round_and_judges_them(run):
    _, run_dir = run
    store = RunStore(run_dir)
    rows = store.measurements("g2")
    loads = [m for m in rows if m["metric"] == "model_load_round" and m["check"] == "model_load_rounds"]
    loaders = {m["context"]["loader"] for m in loads}
    assert "safetensors" in loaders and len(loads) == (1 + 5) * len(loaders)      # a warm-up round, then 5
    assert sum(bool(m["context"].get("warmup")) for m in loads) == len(loaders)
    assert all(m["context"]["identical"] and m["value"] > 0 and m["context"]["fio_gbps"] > 0 for m in loads)
    assert sum(m["context"]["cold"] for m in loads) >= len(loads) // 2   # the pages were dropped before each
    starts = [m for m in rows if m["metric"] == "service_load"]
    assert {m["context"]["loader"] for m in starts} == loaders
    for start in starts:     # kvgate serve --weights said when its weights were loaded, in order
        phases = start["context"]["phases"]
        assert list(phases) == ["imports", "weights", "ready", "first_token"]
        assert start["context"]["weights"]["loader"] == start["context"]["loader"]
    assert "kvgate" in loaders and store.latest("g2", "model_load_vs_storage_best")["context"]["loader"] == "kvgate"
    saves = [m for m in rows if m["metric"] == "checkpoint_save_round"]
    for writer in ("kvgate", "dcp"):    # each writer: two warm-up saves, then 5, each beside fio
        own = [m for m in saves if m["context"]["writer"] == writer]
        assert len(own) == 7 and sum(bool(m["context"].get("warmup")) for m in own) == 2, own
    assert all(len(m["context"]["rank_seconds"]) == 2 for m in saves)
    assert all(m["context"]["slowest_s"] == max(m["context"]["rank_seconds"]) for m in saves)
    restores = [m for m in rows if m["metric"] == "checkpoint_restore_round"]
    # the judged (kvgate) writer's checkpoint by both readers, DCP's writer's by kvgate's reader, 3 times each
    assert sorted((m["context"]["writer"], m["context"]["reader"]) for m in restores) == sorted(
        [("kvgate", "kvgate"), ("kvgate", "dcp"), ("dcp", "kvgate")] * 3)
    assert all(m["context"]["equal"] for m in restores)
    assert store.latest("g2", "checkpoint_write_vs_storage_best")["context"]["writer"] == "kvgate"
    judged = {v["metric"]: v["status"] for v in store.verdicts("g2")}
    assert judged["model_load_identical"] == judged["checkpoint_restore_identical"] == "PASS"
    assert judged["checkpoint_saves_complete"] == judged["service_load_started"] == "PASS"
    assert {"model_load_vs_storage_best", "checkpoint_write_vs_storage_best"} <= set(judged)
    for metric in ("model_load_vs_storage_best", "checkpoint_write_vs_storage_best"):   # beside G1's best job
        figure = store.latest("g2", metric)["context"]
        assert figure["stopping"]["pairs"] == 5 and figure["best_source"] == "G1's sweep"
        assert set(figure["best_modes"]) == {"direct", "buffered"}
        reason = next(v["reason"] for v in store.verdicts("g2") if v["metric"] == metric)
        assert "the faster each round" in reason and "the faster: direct in " in reason, reason
    # one disk on both sides: about 1x, far below the vendor's 6.2-9.3x band, and the reason says where from
    speedup = next(v for v in store.verdicts("g2") if v["metric"] == "model_load_speedup_vs_baseline")
    assert speedup["status"] in ("FAIL", "INCONCLUSIVE") and 0.2 < speedup["value"] < 5
    assert str(run_dir.parent / "nfs") in speedup["reason"]
    paired = [m for m in rows if m["check"] == "model_load_speedup"]
    assert len(paired) == 10 and {m["context"]["storage"] for m in paired} == {"under test", "baseline"}
    not_run = {u["metric"]: u["reason"] for u in store.unjudged("g2")}
    assert "needs a baseline storage path (g2.checkpoint.baseline_path)" in not_run["checkpoint_speedup_vs_baseline"]
    for written in (run_dir.parent / "storage" / "model-load", run_dir.parent / "nfs" / "model-load"):
        assert not written.exists()                                   # the random checkpoints are gone


def test_g2_s_no_reuse_control_alternates_unique_prompts_and_judges_what_offload_costs(run):
    _, run_dir = run
    store = RunStore(run_dir)
    rounds = [m for m in store.measurements("g2") if m["metric"] == "no_reuse_round"]
    assert sorted(m["context"]["target"] for m in rounds) == ["baseline"] * 5 + ["candidate"] * 5
    # the pairs alternate which side goes first
    firsts = [next(m["context"]["target"] for m in rounds if m["context"]["pair"] == pair) for pair in range(5)]
    assert firsts == ["candidate", "baseline", "candidate", "baseline", "candidate"]
    # nothing was reused on either side: what the control measures is the store, not a hit
    assert all(m["context"]["cached_tokens"] == 0 and m["context"]["prompt_tokens"] >= 590 for m in rounds)
    judged = {v["metric"]: v for v in store.verdicts("g2")}
    for metric in ("no_reuse_ttft_cost", "no_reuse_throughput_cost"):
        assert judged[metric]["status"] in ("PASS", "FAIL", "INCONCLUSIVE")
        lo, hi = judged[metric]["interval"]
        assert lo <= judged[metric]["value"] <= hi and "≤ 5%" in judged[metric]["reason"]
