"""G4: a short real soak with probes, drift detection, and a harness killed mid-soak that resumes losing nothing."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from gates.cli import main
from gates.g4_soak.soak import drift
from gates.runstore import RunStore

SOAK = {
    "targets": {"embedded": {"preset": "tiny", "max_running": 4, "device_capacity_blocks": 8,
                             "host_capacity": "64MiB", "disk_capacity": "256MiB"}},
    "g4": {"workload": {"kind": "multi_round_qa", "users": 6, "rounds": 3, "system_prompt_tokens": 256,
                        "document_tokens": 768, "question_tokens": 16, "answer_tokens": 32, "output_tokens": 8},
           "duration_s": 30, "window_s": 5, "concurrency": 3, "faults": []},
}


def _series(values):
    return [{"m": v} for v in values]


@pytest.mark.parametrize("values, trend", [
    ([10, 10.2, 9.9, 10.1, 9.8, 10.0, 10.1, 9.9, 10.2, 10.0], "no trend"),
    ([10, 11, 12.5, 13, 14.2, 15, 16.1, 17, 18, 19.5], "increasing"),
    (list(np.random.default_rng(0).normal(10, 3, 12) + 0.05 * np.arange(12)), "no trend"),  # noise, tiny slope
    (list(np.random.default_rng(1).normal(10, 1, 12) + 1.0 * np.arange(12)), "increasing"),  # noisy but rising
    ([20, 19, 18.5, 17, 16, 15.5, 14, 13, 12.5, 11], "decreasing"),
], ids=["flat", "rising", "noisy-flat", "noisy-rising", "falling"])
def test_drift_detection_on_synthetic_series(values, trend):
    assert drift(_series(values), "m")["trend"] == trend


def test_drift_needs_three_windows():
    assert drift(_series([1, 2]), "m")["trend"] == "too few windows"


def _soak_config(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({**SOAK, "storage": {"path": str(tmp_path / "storage")}}))
    return path


def _windows(run_dir):
    path = run_dir / "gates" / "g4" / "raw" / "windows.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_a_killed_harness_resumes_the_soak_without_losing_or_repeating_a_window(tmp_path):
    run_dir = tmp_path / "run"
    harness = subprocess.Popen([sys.executable, "-m", "gates.cli", "run", "g4", "--config", str(_soak_config(tmp_path)),
                                "--out", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(_windows(run_dir)) < 2:
        assert harness.poll() is None, "the soak ended before it could be killed"
        assert time.monotonic() < deadline, "no soak window within 120 s"
        time.sleep(0.2)
    harness.send_signal(signal.SIGKILL)
    harness.wait(10)
    before = _windows(run_dir)
    time.sleep(3)  # the servers, the gate suite and locust end with the harness
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])
                 and p.pid != os.getpid()]
    assert leftovers == [], [p.info["cmdline"] for p in leftovers]

    assert main(["run", "g4", "--resume", str(run_dir)]) in (0, 1)
    after = _windows(run_dir)
    assert after[: len(before)] == before                          # completed windows kept as they were
    indices = [json.loads(line)["index"] for line in after]
    assert indices == list(range(6))                               # none lost, none repeated
    store = RunStore(run_dir)
    assert {v["metric"] for v in store.verdicts("g4")} >= {"error_rate", "probe_identical_fraction"}
    probes = next(v for v in store.verdicts("g4") if v["metric"] == "probe_identical_fraction")
    assert probes["status"] == "PASS"                              # identical answers across the restart too
    assert json.loads((run_dir / "run.json").read_text())["resumed_at"]


def test_kvgate_report_renders_a_partial_soak_while_it_runs(tmp_path):
    run_dir = tmp_path / "run"
    harness = subprocess.Popen([sys.executable, "-m", "gates.cli", "run", "g4", "--config", str(_soak_config(tmp_path)),
                                "--out", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_windows(run_dir)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert main(["report", str(run_dir)]) == 0
        results = json.loads((run_dir / "results.json").read_text())
        g4 = next(g for g in results["gates"] if g["gate"] == "g4")
        assert g4["status"] == "running" and any(m["metric"].startswith("window_") for m in g4["measurements"])
        assert "<svg" in (run_dir / "index.html").read_text()
    finally:
        harness.send_signal(signal.SIGTERM)
        harness.wait(60)


FAULTS = [{"kind": "flip_byte", "at_s": 2}, {"kind": "read_error", "at_s": 10, "duration_s": 3},
          {"kind": "disk_full", "at_s": 18, "duration_s": 3}]


def test_a_fault_schedule_runs_during_the_soak_and_the_report_shows_what_the_system_did(tmp_path):
    config = tmp_path / "gates.yaml"
    soak = {**SOAK, "g4": {**SOAK["g4"], "faults": FAULTS}}
    config.write_text(yaml.safe_dump({**soak, "storage": {"path": str(tmp_path / "storage")}}))
    run_dir = tmp_path / "run"
    assert main(["run", "g4", "--config", str(config), "--out", str(run_dir)]) in (0, 1)
    rows = [json.loads(line) for line in (run_dir / "gates" / "g4" / "raw" / "faults.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["at_s"]) for r in rows] == [(f["kind"], f["at_s"]) for f in FAULTS]
    for row in rows:
        assert row["error"] is None
        assert row["detected"][row["detected_by"]] > 0, row          # the fault met blocks in use and was counted
        assert row["probe_during"]["identical"], row                  # no wrong answer while it lasted
        assert row["recovered_after_s"] is not None, row
    assert rows[0]["detail"]["key"] and rows[0]["probe_during"]["cached_tokens"] < rows[0]["probe_during"]["prompt_tokens"]
    store = RunStore(run_dir)
    verdicts = {v["metric"]: v for v in store.verdicts("g4")}
    assert verdicts["faults_handled_fraction"]["status"] == "PASS", verdicts["faults_handled_fraction"]["reason"]
    assert verdicts["probe_identical_fraction"]["status"] == "PASS"
    assert verdicts["error_rate"]["status"] == "PASS"
    html = (run_dir / "index.html").read_text()
    assert "served whole from cache again after" in html and "flip_byte" in html and ">faults<" in html
