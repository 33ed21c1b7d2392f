"""G4: drift judged outside the fault windows; real soaks with probes and faults; a killed harness resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest
import yaml

from gates.benches.client_bench import _process
from gates.cli import main
from gates.config import ConfigError, load_config
from gates.g4_soak.analysis import (
    drift,
    drift_power,
    excluded_window_rows,
    fault_span,
    faults_summary,
    growth_horizon,
    growth_power,
    project_growth,
    windows_touched,
)
from kvcore.rules import Threshold
from kvcore.rundata import RunStore
from kvcore.stats import mann_kendall
from kvcore.verdict import judge
from workloads.probes.faults import AdminClient
from workloads.servers.server_behaviour import Behaviour
from workloads.traffic.processes import free_port

SOAK = {
    "targets": {"embedded": {"preset": "tiny", "max_running": 4, "device_capacity_blocks": 8,
                             "host_capacity": "64MiB", "disk_capacity": "256MiB"}},
    "g4": {"workload": {"kind": "multi_round_qa", "users": 6, "rounds": 3, "system_prompt_tokens": 256,
                        "document_tokens": 768, "question_tokens": 16, "answer_tokens": 32, "output_tokens": 8},
           "duration_s": 30, "window_s": 5, "warmup_s": 5, "concurrency": 3, "faults": [], "measured_only": []},
}


def _series(values):
    return [{"index": i, "start_s": 60.0 * i, "m": v} for i, v in enumerate(values)]


@pytest.mark.parametrize("values, trend", [
    ([10, 10.2, 9.9, 10.1, 9.8, 10.0, 10.1, 9.9, 10.2, 10.0], "no trend"),
    ([10, 11, 12.5, 13, 14.2, 15, 16.1, 17, 18, 19.5], "increasing"),
    (list(np.random.default_rng(0).normal(10, 3, 12) + 0.05 * np.arange(12)), "no trend"),  # noise, tiny slope
    (list(np.random.default_rng(1).normal(10, 1, 12) + 1.0 * np.arange(12)), "increasing"),  # noisy but rising
    ([20, 19, 18.5, 17, 16, 15.5, 14, 13, 12.5, 11], "decreasing"),
], ids=["flat", "rising", "noisy-flat", "noisy-rising", "falling"])
def test_drift_detection_on_synthetic_series(values, trend):
    assert drift(_series(values), "m").trend == trend


def test_drift_needs_three_windows():
    result = drift(_series([1, 2]), "m")
    assert (result.trend, result.fraction) == ("too few windows", None)
    assert "2 windows to judge" in result.invalid_reason


# --- the fault windows and drift judged by its size ----------------------

WINDOW_S = 60.0
ISSUE_FAULTS = [("flip_byte", 300), ("read_error", 600), ("slow_disk", 900), ("truncate", 1200), ("disk_full", 1500)]


def _fault_row(kind, at_s, recovered_after_s=1.5, duration_s=10.0, **extra):
    """A faults.jsonl row as FaultSchedule writes it: injected 0.2 s late, the probe back 1.5 s after the end."""
    io = kind in ("read_error", "slow_disk", "disk_full", "write_error")
    row = {"kind": kind, "at_s": at_s, "injected_at": 1.7e9 + at_s, "injected_s": at_s + 0.2,
           "ended_s": at_s + 0.5 + (duration_s if io else 0.0), "recovered_after_s": recovered_after_s,
           "recovery_timeout_s": 60.0, "error": None, "detail": {"duration_s": duration_s} if io else {}}
    return {**row, **extra}


def _soak_windows(level=280.0, change=0.0, noise=1.5, count=30, dips=None, seed=0):
    """Throughput windows of a 30-minute soak (60 s windows): `level` falling by `change` of it over the soak."""
    rng = np.random.default_rng(seed)
    values = level * (1.0 - change * np.arange(count) / (count - 1)) + rng.normal(0.0, noise, count)
    for index, value in (dips or {}).items():
        values[index] = value
    return [{"index": i, "start_s": WINDOW_S * i, "output_tokens_per_s": float(v)} for i, v in enumerate(values)]


def _judged(windows, faults, tolerance=0.05):
    """The drift verdict as the G4 suite gives it (gates/g4_soak/test_g4_soak.py)."""
    result = drift(windows, "output_tokens_per_s", "decreasing", excluded=windows_touched(windows, faults, WINDOW_S))
    verdict = judge("g4", "throughput", f"G4 decline in windowed throughput over the soak ({result.words('tokens/s')})",
                    result.fraction, Threshold("throughput_drift_fraction", "<=", tolerance),
                    unit="%", interval=result.interval, valid=not result.invalid_reason,
                    invalid_reason=result.invalid_reason)
    return result, verdict


def test_the_issue_soak_with_its_fault_windows_left_out_passes_the_throughput_drift_check():
    # a soak seen at ~280 tok/s throughout, the lowest windows (245, 259) the faults' own, in the later half
    windows = _soak_windows(change=0.006, dips={20: 245.0, 25: 259.0})
    faults = [_fault_row(kind, at) for kind, at in ISSUE_FAULTS]
    values = [w["output_tokens_per_s"] for w in windows]
    assert mann_kendall(values)["trend"] == "decreasing"     # what the p-value-only check judged: FAIL before
    assert mann_kendall(values)["p_value"] < 0.05
    result, verdict = _judged(windows, faults)
    assert verdict.status == "PASS", verdict.reason
    assert (result.windows, result.excluded) == (25, 5)
    assert "5 windows of warm-up, faults or errors left out" in verdict.reason and "Mann-Kendall p=" in verdict.reason
    assert 0 <= result.fraction < 0.02                        # a decline below 2% of the level: no drift to speak of


def test_a_real_ten_percent_decline_fails_with_the_fault_windows_left_out():
    windows = _soak_windows(change=0.10, dips={20: 220.0, 25: 230.0})
    result, verdict = _judged(windows, [_fault_row(kind, at) for kind, at in ISSUE_FAULTS])
    assert verdict.status == "FAIL", verdict.reason
    assert result.excluded == 5 and result.p_value < 0.05
    assert result.interval[0] > 0.05 and result.fraction == pytest.approx(0.10 / 0.95, abs=0.02)  # level: the median


def test_a_tiny_significant_decline_over_a_72_hour_soak_passes():
    # 72 h in 300 s windows: 864 windows; a 1% decline is "significant" and far inside the tolerance
    windows = _soak_windows(change=0.01, noise=3.0, count=864)
    result, verdict = _judged(windows, [])
    assert result.p_value < 0.05 and result.trend == "decreasing"
    assert verdict.status == "PASS", verdict.reason
    assert result.interval[1] < 0.05


def test_a_large_change_a_short_noisy_soak_cannot_confirm_is_inconclusive():
    # 6 windows, 8% noise, an 8% decline: not significant, so it is neither shown nor ruled out
    windows = _soak_windows(change=0.08, noise=22.0, count=6, seed=3)
    result, verdict = _judged(windows, [])
    assert result.p_value >= 0.05
    assert result.interval[0] <= 0 <= result.interval[1]     # not significant: "no change" stays in the interval
    assert verdict.status == "INCONCLUSIVE", verdict.reason


def test_too_few_windows_outside_the_faults_is_inconclusive_and_says_why():
    windows = _soak_windows(count=4)
    _, verdict = _judged(windows, [_fault_row("read_error", 60), _fault_row("flip_byte", 120)])
    assert verdict.status == "INCONCLUSIVE"
    assert "2 windows to judge outside the warm-up and fault windows: the trend needs at least 3" in verdict.reason


def test_an_upward_drift_is_positive_for_a_figure_that_must_not_rise():
    windows = [{"index": i, "start_s": WINDOW_S * i, "m": 100.0 + i} for i in range(11)]
    result = drift(windows, "m", "increasing")
    assert result.fraction == pytest.approx(10 / 105)  # +10 from the first window to the last, level 105
    assert drift(windows, "m", "decreasing").fraction == pytest.approx(-result.fraction)
    assert result.trend_at(0) == pytest.approx(100.0) and result.trend_at(10) == pytest.approx(110.0)


def test_the_change_is_measured_between_the_first_and_last_judged_window():
    # windows 0..9 rising by 1 per window; the last two left out: the line runs from window 0 to 7
    windows = [{"index": i, "start_s": WINDOW_S * i, "m": 100.0 + i} for i in range(10)]
    result = drift(windows, "m", excluded={8, 9})
    assert (result.sen_slope, result.change, result.level) == (pytest.approx(1.0), pytest.approx(7.0), 103.5)


def test_each_fault_touches_the_windows_from_its_injection_to_its_recovery():
    windows = _soak_windows(count=30)
    spans = {
        "flip_byte": _fault_row("flip_byte", 300),                                  # 300.2 .. 302.0: window 5
        "read_error": _fault_row("read_error", 590, duration_s=30.0),               # 590.2 .. 622.0: windows 9, 10
        "never": _fault_row("disk_full", 1500, recovered_after_s=None),             # to 1570.5 (timeout): 25, 26
        "failed": _fault_row("slow_disk", 1700, error="ConnectionError: refused"),  # planned end, then timeout
    }
    del spans["failed"]["ended_s"], spans["failed"]["recovered_after_s"]            # what a failed injection leaves
    touched = {name: sorted(windows_touched(windows, [row], WINDOW_S)) for name, row in spans.items()}
    assert touched == {"flip_byte": [5], "read_error": [9, 10], "never": [25, 26], "failed": [28, 29]}


def test_a_fault_injected_while_a_windows_server_figures_are_read_touches_that_window_too():
    """The 2-hour soak: faults due at multiples of the window are injected as the window before reads the server's
    memory (its end plus the probes, ~1 s); that window's memory measured the fault (386 vs 358-366 MiB)."""
    windows = [{**w, "sampled_s": w["start_s"] + WINDOW_S + 1.2} for w in _soak_windows(count=30)]
    row = _fault_row("disk_full", 1200)                                 # injected 1200.2 s: window 20 starts at 1200
    assert sorted(windows_touched(windows, [row], WINDOW_S)) == [19, 20]
    assert sorted(windows_touched(_soak_windows(count=30), [row], WINDOW_S)) == [20]   # rows without sampled_s


def test_a_fault_row_from_before_the_soak_clock_falls_back_to_its_schedule():
    old = {"kind": "read_error", "at_s": 600, "injected_at": 1.7e9, "error": None, "detail": {"duration_s": 5},
           "recovered_after_s": 1.0}
    span = fault_span(old)
    assert (span.start_s, span.end_s, span.recovered) == (600.0, 606.0, True)
    assert "read_error at 600 s" in span.describe() and "recovered" in span.describe()


def test_the_excluded_windows_are_listed_with_their_faults_and_figures():
    windows = _soak_windows(count=12, dips={5: 245.0})
    faults = [_fault_row("read_error", 300), _fault_row("flip_byte", 310)]
    rows = excluded_window_rows(windows, windows_touched(windows, faults, WINDOW_S), WINDOW_S)
    assert [(r["window"], r["window_start_s"], r["window_end_s"], r["kind"]) for r in rows] == [
        (5, 300.0, 360.0, "read_error, flip_byte")]
    assert rows[0]["output_tokens_per_s"] == 245.0 and "flip_byte at 310 s" in rows[0]["reason"]


@pytest.mark.parametrize("value, message", [
    (0, "g4.drift_tolerance: expected a value > 0.0, found 0"),
    (1, "g4.drift_tolerance: expected a value < 1.0, found 1"),
    ("a lot", "g4.drift_tolerance: expected a number, found 'a lot'"),
])
def test_the_drift_tolerance_is_a_fraction_between_0_and_1(tmp_path, value, message):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({"g4": {"drift_tolerance": value}}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    path.write_text(yaml.safe_dump({"g4": {"drift_tolerance": 0.1}}))
    assert load_config(path).g4.drift_tolerance == 0.1 and load_config().g4.drift_tolerance == 0.25


# --- memory growth projected over the horizon --------------------------------

def _memory_windows(slope=0.76, noise=2.0, count=30, seed=0):
    """rss_minus_cache_mib of a 30-minute soak in 60 s windows: 326 MiB rising by `slope` a window."""
    values = 326.0 + slope * np.arange(count) + np.random.default_rng(seed).normal(0.0, noise, count)
    return [{"index": i, "start_s": WINDOW_S * i, "rss_minus_cache_mib": float(v)} for i, v in enumerate(values)]


def _growth_verdict(windows, horizon_s, limit_mib=512.0):
    """The memory-growth verdict as the G4 suite gives it (gates/g4_soak/test_g4_soak.py)."""
    projection = project_growth(drift(windows, "rss_minus_cache_mib"), WINDOW_S, horizon_s)
    verdict = judge("g4", "memory", "G4 memory growth", projection.growth,
                    Threshold("memory_growth_mib", "<=", limit_mib), unit="MiB",
                    interval=projection.interval)
    return projection, verdict


def test_the_issue_soak_s_memory_slope_projected_to_72_hours_fails_the_limit_it_passed_over_30_minutes():
    windows = _memory_windows()
    over_the_soak, passed = _growth_verdict(windows, 30 * 60)
    assert passed.status == "PASS" and over_the_soak.growth == pytest.approx(0.76 * 30, rel=0.15)
    projection, verdict = _growth_verdict(windows, 72 * 3600)
    assert verdict.status == "FAIL", verdict.reason
    assert projection.growth == pytest.approx(0.76 * 72 * 60, rel=0.15)      # ~3.2 GiB, as the issue said
    assert projection.interval[0] > 512 and projection.interval[0] <= projection.growth <= projection.interval[1]
    assert projection.per_hour == pytest.approx(0.76 * 60, rel=0.15)
    assert projection.measured == pytest.approx(0.76 * 29, rel=0.15)          # first to last window
    words = projection.words("MiB")
    assert "MiB measured" in words and "MiB/h [" in words and "projected over 72 h" in words


def test_a_flat_memory_figure_projects_growth_whose_interval_holds_zero():
    projection, verdict = _growth_verdict(_memory_windows(slope=0.0, noise=0.5), 72 * 3600)
    assert projection.interval[0] == 0.0                                    # not significant: "no growth" kept
    assert verdict.status in ("PASS", "INCONCLUSIVE")                         # never FAIL on no trend


def test_falling_memory_projects_no_growth():
    projection = project_growth(drift(_memory_windows(slope=-1.0, noise=0.2), "rss_minus_cache_mib"), 60.0, 3600.0)
    assert projection.growth == 0.0 and projection.interval == (0.0, 0.0) and projection.per_hour < 0


def test_too_few_windows_have_no_projection():
    assert project_growth(drift(_memory_windows(count=2), "rss_minus_cache_mib"), 60.0, 3600.0) is None


def _horizon(config):
    return growth_horizon(config.g4.memory_growth_horizon_s, config.g4.duration_s)


def test_the_growth_horizon_is_72_hours_for_a_soak_of_30_minutes_or_more_and_says_which(tmp_path):
    path = tmp_path / "gates.yaml"
    assert _horizon(load_config(profile="full")).seconds == 72 * 3600
    quick = _horizon(load_config())
    assert quick.seconds == 120 and "a soak under 30 min certifies no longer uptime" in quick.words()
    path.write_text(yaml.safe_dump({"g4": {"duration_s": 1800, "window_s": 60}}))      # a 30-min soak
    long = _horizon(load_config(path))
    assert long.seconds == 72 * 3600
    assert long.words() == ("projected over 72 h (the uptime a soak of 30 min or more certifies, "
                            "g4.memory_growth_horizon_s unset)")
    path.write_text(yaml.safe_dump({"g4": {"duration_s": 1799, "window_s": 60}}))
    assert _horizon(load_config(path)).seconds == 1799
    path.write_text(yaml.safe_dump({"g4": {"duration_s": 1800, "window_s": 60, "memory_growth_horizon_s": 604800}}))
    week = _horizon(load_config(path))
    assert week.seconds == 604800 and "g4.memory_growth_horizon_s" in week.why
    path.write_text(yaml.safe_dump({"g4": {"duration_s": 1800, "window_s": 60, "memory_growth_horizon_s": 600}}))
    with pytest.raises(ConfigError, match=r"g4.memory_growth_horizon_s: expected at least duration_s \(1800\), "
                                          r"found 600"):
        load_config(path)
    path.write_text(yaml.safe_dump({"g4": {"memory_growth_horizon_s": 0}}))
    with pytest.raises(ConfigError, match="g4.memory_growth_horizon_s: expected a value > 0"):
        load_config(path)


# --- how long a soak would decide -------------------------------------------

def _noisy(count, level=100.0, noise=3.0, slope=0.0, seed=0, metric="m"):
    values = level + slope * np.arange(count) + np.random.default_rng(seed).normal(0.0, noise, count)
    return [{"index": i, "start_s": WINDOW_S * i, metric: float(v)} for i, v in enumerate(values)]


def _width(windows, worse="decreasing"):
    low, high = drift(windows, "m", worse).interval
    return high - low


def test_the_power_estimate_is_the_windows_at_which_the_interval_narrows_below_the_tolerance():
    """An INCONCLUSIVE throughput: 3% noise between windows. The estimate is checked against what it
    promises: soaks of the estimated length give intervals about as wide as the tolerance, shorter ones wider."""
    measured = drift(_noisy(200), "m", "decreasing")             # enough windows to know the noise to ~5%
    tolerance = 0.02
    power = drift_power(measured, tolerance, WINDOW_S)
    relative = measured.noise / measured.level
    assert power.windows == pytest.approx(48 * (1.05 * 1.96 * relative / tolerance) ** 2, rel=0.05)
    assert power.windows > 200 and power.soak_s == pytest.approx(power.windows * WINDOW_S)
    words = power.words()
    assert "needs ≈" in words and "judged windows" in words and "(this one judged 200)" in words
    at_estimate = np.median([_width(_noisy(power.windows, seed=seed)) for seed in range(1, 31)])
    at_half = np.median([_width(_noisy(power.windows // 2, seed=seed)) for seed in range(1, 31)])
    assert 0.85 * tolerance < at_estimate < 1.1 * tolerance and at_half > 1.2 * tolerance


def test_the_power_estimate_counts_the_windows_left_out_into_the_soak_it_asks_for():
    windows = _noisy(40)
    result = drift(windows, "m", excluded=list(range(10)))              # a quarter left out (warm-up, faults)
    power = drift_power(result, 0.05, WINDOW_S)
    assert power.soak_s == pytest.approx(power.windows / 0.75 * WINDOW_S)


def test_a_quiet_figure_decides_in_the_windows_it_has_and_says_so():
    power = drift_power(drift(_noisy(30, noise=0.1), "m"), 0.05, WINDOW_S)
    assert power.windows <= 30 and "this soak has 30" in power.words()


def test_the_growth_power_estimate_falls_with_the_horizon_and_the_noise():
    result = drift(_noisy(30, level=300.0, noise=2.0, metric="rss_minus_cache_mib"), "rss_minus_cache_mib")
    at_72h = growth_power(result, 512.0, "MiB", WINDOW_S, 72 * 3600)
    at_2h = growth_power(result, 512.0, "MiB", WINDOW_S, 2 * 3600)
    assert at_2h.windows <= at_72h.windows
    noisier = drift(_noisy(30, level=300.0, noise=8.0, metric="rss_minus_cache_mib"), "rss_minus_cache_mib")
    assert growth_power(noisier, 512.0, "MiB", WINDOW_S, 72 * 3600).windows > at_72h.windows


# --- the server's runtime, projected as memory is ---------------------------

def test_a_descriptor_leak_of_one_a_window_fails_the_projected_growth_and_a_steady_count_passes():
    leaking = [{"index": i, "start_s": WINDOW_S * i, "open_fds": 40 + i} for i in range(30)]
    steady = [{"index": i, "start_s": WINDOW_S * i, "open_fds": 40 + (i % 3)} for i in range(30)]
    rule = Threshold("open_fds_growth", "<=", 64)
    for windows, status in ((leaking, "FAIL"), (steady, "PASS")):
        projection = project_growth(drift(windows, "open_fds"), WINDOW_S, 72 * 3600)
        verdict = judge("g4", "open_fds", "G4 open descriptors growth", projection.growth, rule,
                        unit="descriptors", interval=projection.interval)
        assert verdict.status == status, verdict.reason
    assert project_growth(drift(leaking, "open_fds"), WINDOW_S, 72 * 3600).growth == pytest.approx(72 * 60)


def _soak_config(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({**SOAK, "storage": {"path": str(tmp_path / "storage")}}))
    return path


def _windows(run_dir):
    path = run_dir / "gates" / "g4" / "raw" / "windows.jsonl"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
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
    # the servers, the gate suite and locust end with the harness (a server may first drain its requests)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])
                 and p.pid != os.getpid()]
    _, alive = psutil.wait_procs(leftovers, timeout=60)
    assert alive == [], [p.info["cmdline"] for p in alive]

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_fault_schedule_runs_during_the_soak_and_the_report_shows_what_the_system_did(tmp_path):
    config = tmp_path / "gates.yaml"
    # TTFT p99's drift measured, not judged (as the quick profile has it); throughput's judged
    soak = {**SOAK, "g4": {**SOAK["g4"], "faults": FAULTS, "measured_only": ["ttft_p99_drift_fraction"]}}
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
        assert row["at_s"] <= row["injected_s"] <= row["ended_s"] and row["recovery_timeout_s"] > 0, row
    assert (
        rows[0]["detail"]["key"] and rows[0]["probe_during"]["cached_tokens"] < rows[0]["probe_during"]["prompt_tokens"]
    )
    store = RunStore(run_dir)
    verdicts = {v["metric"]: v for v in store.verdicts("g4")}
    assert verdicts["faults_handled_fraction"]["status"] == "PASS", verdicts["faults_handled_fraction"]["reason"]
    assert verdicts["probe_identical_fraction"]["status"] == "PASS"
    # which tier served the soak's hits: the faults' probes were loaded from disk, so the disk served some
    shares = {m["context"]["tier"]: m for m in store.measurements("g4") if m["metric"] == "hit_tier_share"}
    assert {"device", "host", "disk"} <= set(shares) and shares["disk"]["context"]["hits"] > 0
    assert (
        abs(sum(m["value"] for m in shares.values()) - 1) < 1e-9 and shares["disk"]["context"]["counted_in"] == "blocks"
    )
    assert verdicts["error_rate"]["status"] == "PASS"
    left_out = {m["context"]["window"] for m in store.measurements("g4") if m["metric"] == "drift_excluded_window"}
    assert {int(f["at_s"] // SOAK["g4"]["window_s"]) for f in FAULTS} <= left_out   # each fault's own window
    assert 0 in left_out  # the warm-up's window
    assert (
        f"{len(left_out)} windows of warm-up, faults or errors left out"
        in verdicts["throughput_drift_fraction"]["reason"]
    )
    unjudged = {u["metric"]: u for u in store.unjudged("g4")}
    assert "ttft_p99_drift_fraction" not in verdicts and "cannot power it (g4.measured_only)" in \
        unjudged["ttft_p99_drift_fraction"]["reason"]
    assert any(m["metric"] == "ttft_p99_drift_fraction" for m in store.measurements("g4"))   # measured all the same
    html = (run_dir / "index.html").read_text()
    assert "served whole from cache again after" in html and "flip_byte" in html and ">faults<" in html
    assert "windows left out of the drift checks" in html


def test_windows_starting_within_the_warm_up_are_left_out_with_the_reason():
    windows = [{"index": i, "start_s": 10.0 * i, "output_tokens_per_s": 100.0 + i} for i in range(6)]
    touched = windows_touched(windows, [_fault_row("read_error", 31, duration_s=3.0)], 10.0, warmup_s=15.0)
    assert sorted(touched) == [0, 1, 3]
    rows = excluded_window_rows(windows, touched, 10.0)
    assert [r["kind"] for r in rows] == ["warm-up", "warm-up", "read_error"]
    assert "warm-up (the soak's first 15 s, g4.warmup_s)" in rows[0]["reason"]
    assert drift(windows, "output_tokens_per_s", "decreasing", excluded=touched).windows == 3



def test_windows_whose_requests_failed_beyond_the_error_share_are_left_out_of_the_drift_with_their_errors():
    """A window where 43% of requests failed measures the failures: left out, with the errors by type and a sample."""
    failures = {"http_500": {"count": 30, "example": "internal error"}, "http_400": {"count": 13, "example": "bad"}}
    windows = [{"index": i, "start_s": 10.0 * i, "requests": 100, "errors": 0, "errors_by_type": {},
                "output_tokens_per_s": 100.0} for i in range(6)]
    windows[2].update(errors=43, errors_by_type=failures, output_tokens_per_s=57.0)
    windows[4].update(errors=1, errors_by_type={"timeout": {"count": 1, "example": "timed out"}})  # 1%: allowed
    touched = windows_touched(windows, [], 10.0, max_error_share=0.01)
    assert sorted(touched) == [2]
    row, = excluded_window_rows(windows, touched, 10.0)
    assert row["kind"] == "errors"
    assert row["reason"].startswith("43 of 100 requests failed (43.0% > 1% allowed, g4.max_error_share): "
                                    "30 http_500 (e.g. 'internal error'), 13 http_400")
    assert drift(windows, "output_tokens_per_s", "decreasing", excluded=touched).windows == 5
    assert windows_touched(windows, [], 10.0) == {}          # no share given: nothing judged by errors


def test_the_error_shares_are_fractions_and_a_bad_one_names_its_field(tmp_path):
    for gate, value, message in (("g3", 1.5, "g3.max_error_share: expected a value < 1"),
                                 ("g4", -0.1, "g4.max_error_share: expected a value >= 0"),
                                 ("g3", "many", "g3.max_error_share: expected a number, found 'many'")):
        path = tmp_path / f"{gate}.yaml"
        path.write_text(yaml.safe_dump({gate: {"max_error_share": value}}))
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            load_config(path)
    assert load_config(None).g3.max_error_share == 0.01 and load_config(None).g4.max_error_share == 0.01


def test_each_soak_window_is_said_in_one_line_for_the_console():
    from gates.g4_soak.soak import _window_row, window_line

    records = [{"ok": True, "ttft_s": 0.05 * (i + 1), "completion_tokens": 16, "error_type": None} for i in range(9)]
    records.append({"ok": False, "ttft_s": None, "completion_tokens": 0, "error_type": "http_500",
                    "error_message": "boom", "http_status": 500})
    row = _window_row(2, 20.0, records, {"rss_bytes": 600 << 20, "cache_memory_bytes": 256 << 20,
                                         "engine_kv_resident_bytes": 20 << 20}, [True, True, False], 10.0)
    assert row["engine_kv_resident_mib"] == 20
    line = window_line(row, 12)
    assert line.startswith("soak window 3 / 12 (20 s in): 10 requests, 1 errors, TTFT p50 250 / p99 446 ms")
    assert "14.4 tokens/s" in line and "probes 2 / 3 identical" in line and "memory 324 MiB outside the cache" in line
    assert _window_row(2, 20.0, records, {"rss_bytes": 600 << 20, "cache_memory_bytes": 256 << 20,
                                          "engine_kv_resident_bytes": None}, [], 10.0)["rss_minus_cache_mib"] == 344


def _outcome_row(kind: str, at_s: float, detected: float) -> dict:
    return {"kind": kind, "at_s": at_s, "error": None, "detected_by": "corrupt_blocks",
            "detected": {"corrupt_blocks": detected}, "recovered_after_s": 0.5,
            "probe_during": {"identical": True, "cached_tokens": 1536, "prompt_tokens": 1830}}


def test_the_faults_summary_leads_with_the_faults_not_handled():
    # the 2-hour soak's FAIL said its one undetected truncate last, after 28 handled faults
    rows = [_outcome_row("flip_byte", 240, 1), _outcome_row("truncate", 2160, 1), _outcome_row("truncate", 960, 0),
            _outcome_row("flip_byte", 1440, 1)]
    parts = faults_summary(rows).split("; ")
    assert parts[0] == "truncate at 960 s: NOT detected (no corrupt_blocks)", parts
    names = [p for p in parts if " at " in p and " s: " in p]
    assert [n.split(":")[0] for n in names] == ["truncate at 960 s", "flip_byte at 240 s", "flip_byte at 1440 s",
                                               "truncate at 2160 s"], names


def test_memory_outside_the_cache_leaves_out_the_engines_kv_pages_up_to_their_bound_only():
    from gates.g4_soak.soak import engine_kv_memory

    def samples(resident, limit=None):
        found = {("kvgate_engine_kv_buffer_resident_bytes",): resident}
        return found if limit is None else {**found, ("kvgate_engine_kv_buffer_limit_bytes",): limit}

    assert engine_kv_memory(samples(60 << 20, 528 << 20)) == 60 << 20          # pages, within the bound
    assert engine_kv_memory(samples(900 << 20, 528 << 20)) == 528 << 20        # a pool past its bound shows
    assert engine_kv_memory(samples(60 << 20)) == 60 << 20
    assert engine_kv_memory({("process_resident_memory_bytes",): 1.0}) is None  # a server without them


def test_the_reference_server_leaks_a_descriptor_per_request_when_told_and_its_metrics_show_it():
    """The known-bad candidate of `kvgate selftest`'s h-leak control: what G4's open_fds_growth must FAIL."""
    assert [Behaviour(leak_fd_every=3).leaks(n) for n in range(1, 7)] == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="leak_fd_every: expected 0"):
        Behaviour(leak_fd_every=-1)
    port = free_port()
    command = [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), "--ttft-ms", "1",
               "--itl-ms", "1", "--tokens", "2", "--leak-fd-every", "1"]
    with _process(command, port, "/health"):
        admin = AdminClient(f"http://127.0.0.1:{port}", timeout_s=10)
        before = admin.metrics()[("process_open_fds",)]
        for _ in range(5):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=10, trust_env=False).raise_for_status()
        assert admin.metrics()[("process_open_fds",)] == before + 5
