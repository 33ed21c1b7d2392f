"""G4 stability: a constant-load soak without errors, drift, leaks or wrong answers.

The soak runs against the candidate, measured in windows; fixed probes at
temperature 0 are re-asked every window and must answer exactly as at the
start (the check that catches corrupt KV served from a tier). Windows are
appended as they complete, so a soak killed with the harness resumes with
`kvgate run g4 --resume RUN_DIR` and loses no completed window.

The configured fault schedule (g4.faults) is injected into the candidate's
cache during the soak (the embedded candidate, or vLLM with kvgate's connector); each fault must be detected, must not
change any
probe's answer, and the probe must be served from the cache again afterwards.
"""

from __future__ import annotations

from typing import Optional

import pytest

from engines import cache_admin, hit_reader
from gates.g4_soak.analysis import (
    RUNTIME_GROWTH,
    drift,
    drift_power,
    excluded_window_rows,
    fault_facts,
    fault_outcome,
    faults_summary,
    growth_horizon,
    growth_power,
    project_growth,
    windows_touched,
)
from gates.g4_soak.soak import RUNTIME_GAUGES, Soak, SoakSettings, window_line
from kvcore.files import read_jsonl_file as read_jsonl
from kvcore.rules import Threshold
from workloads.probes.faults import AdminClient, CacheAdmin
from workloads.probes.tier_hits import tier_difference, tier_shares
from workloads.traffic.datasets import build_workload, sizer_for
from workloads.traffic.errors import describe_errors, merge_error_summaries


@pytest.fixture(scope="module")
def soak_run(gate_context, endpoints, adapters):
    """The soak's windows, and the candidate's hits per tier over it (None without tier accounting)."""
    candidate = endpoints.get("candidate")
    if candidate is None:
        pytest.skip("G4 needs a candidate endpoint")
    config = gate_context.config.g4   # a fault schedule needs kvgate's cache: the config checks it
    workload = build_workload(config.workload, sizer_for(candidate.tokenizer), seed=4)
    store = gate_context.store
    planned = max(1, round(config.duration_s / config.window_s))

    def on_window(row: dict) -> None:
        for metric in ("ttft_p99_ms", "ttft_p50_ms", "output_tokens_per_s", "rss_mib", "rss_minus_cache_mib",
                       "probes_identical", *RUNTIME_GAUGES):
            if row.get(metric) is not None:
                store.record("g4", "soak", f"window_{metric}", row[metric], target="candidate",
                             window_start_s=row["start_s"], window=row["index"])
        store.set_progress("g4", window_line(row, planned))

    # where faults go and the cache's figures come from: kvgate's admin routes (kvgate serve's, or its connector's
    # sidecar inside vLLM); for another cache, the engine's own page (its figures only: no faults, by the config)
    cache = cache_admin(gate_context.config, candidate) or CacheAdmin(AdminClient(candidate.server_root))
    soak = Soak(store.raw_dir("g4"), candidate.target("candidate"), cache, workload,
                SoakSettings(config.duration_s, config.window_s, config.concurrency), config.faults)
    read_hits, unit = hit_reader(candidate, adapters["candidate"], gate_context.config)
    before = read_hits()
    rows = soak.run(on_window=on_window, on_live=lambda live: store.set_progress("g4", live.line(), kind="live"))
    return rows, (tier_difference(before, read_hits()), unit)


@pytest.fixture(scope="module")
def windows(soak_run):
    return soak_run[0]


def test_hits_by_tier_over_the_soak(soak_run, record):
    """Which tier served the candidate's hits over the soak (this run of it: a resumed soak counts from the resume)."""
    hits, unit = soak_run[1]
    if hits is None:
        pytest.skip("the candidate's engine has no tier accounting to read its hits by tier from")
    for tier, share in tier_shares(hits).items():
        record("hit_tier_share", share, target="candidate", tier=tier, hits=hits[tier], soak_hits=sum(hits.values()),
               counted_in=unit)


@pytest.fixture(scope="module")
def faults(gate_context, windows) -> list[dict]:
    """The scheduled faults' rows, once the soak is over."""
    return read_jsonl(gate_context.store.raw_dir("g4") / "faults.jsonl")


@pytest.fixture(scope="module")
def fault_windows(gate_context, windows, faults) -> dict[int, list]:
    """The windows of the warm-up, those whose requests failed more than g4.max_error_share and those the faults
    touched (left out of the drift checks), each recorded with why."""
    config = gate_context.config.g4
    touched = windows_touched(windows, faults, config.window_s, config.warmup_s, config.max_error_share)
    for row in excluded_window_rows(windows, touched, config.window_s):
        gate_context.store.record("g4", "windows left out of the drift checks", "drift_excluded_window",
                                  row["window_start_s"], "s", **row)
    return touched


def test_error_rate_stays_under_the_limit(windows, record, verdict):
    requests = sum(w["requests"] for w in windows)
    errors = sum(w["errors"] for w in windows)
    rate = errors / requests if requests else None
    by_type = merge_error_summaries(w.get("errors_by_type") for w in windows)
    record("error_rate", rate, requests=requests, errors=errors, errors_by_type=by_type)
    kinds = f": {describe_errors(by_type)}" if by_type else ""
    verdict(f"G4 error rate over {len(windows)} windows ({errors} of {requests}{kinds})", "error_rate", rate,
            unit="%", valid=requests > 0, invalid_reason="no request completed in the soak")


def test_consistency_probes_answer_identically_throughout(windows, record, verdict):
    asked = sum(w["probes"] for w in windows)
    same = sum(w["probes_identical"] for w in windows)
    fraction = same / asked if asked else None
    record("probe_identical_fraction", fraction, asked=asked, identical=same)
    verdict(f"G4 consistency probes identical ({same} of {asked})", "probe_identical_fraction", fraction, unit="%",
            valid=asked > 0, invalid_reason="no probe was asked")


# (window figure, its unit, the direction that is worse, the judged metric, what it watches);
# each judged figure is the trend's change over the soak as a fraction of its level, positive when worse
DRIFT_CHECKS = [
    ("ttft_p99_ms", "ms", "increasing", "ttft_p99_drift_fraction", "rise in windowed TTFT p99"),
    ("output_tokens_per_s", "tokens/s", "decreasing", "throughput_drift_fraction", "decline in windowed throughput"),
    ("rss_minus_cache_mib", "MiB", "increasing", "memory_drift_fraction",
     "rise in server memory outside the cache pools"),
]


@pytest.mark.parametrize("metric, unit, worse, judged, label", DRIFT_CHECKS, ids=["ttft_p99", "throughput", "memory"])
def test_no_drift_beyond_the_tolerance_outside_the_fault_windows(gate_context, windows, fault_windows, record,
                                                                 verdict, metric, unit, worse, judged, label):
    result = drift(windows, metric, worse, excluded=fault_windows)
    record(judged, result.fraction, "%", **result.context())
    _record_trend_line(record, windows, metric, result)
    config = gate_context.config.g4
    power = drift_power(result, config.drift_tolerance, config.window_s)
    if power is not None:
        record(f"{judged}_power", power.windows, "windows", **power.context())
    measured_only = judged in config.measured_only
    verdict(
        f"G4 {label} over the soak ({result.words(unit)}" + (f"; {power.words()}" if power else "") + ")",
        judged,
        result.fraction,
        rule=None if measured_only else Threshold(judged, "<=", config.drift_tolerance),
        unjudged_reason=(
            f"this profile's soak cannot power it (g4.measured_only){'; ' + power.words() if power else ''}"
            if measured_only
            else ""
        ),
        unit="%",
        interval=result.interval,
        valid=not result.invalid_reason,
        invalid_reason=result.invalid_reason,
    )


def _record_trend_line(record, windows, metric: str, result) -> None:
    """The Theil-Sen line drawn across the soak beside the windowed figure (none without a slope)."""
    if result.sen_slope is not None:
        for w in windows:
            record(f"window_{metric}", result.trend_at(w["index"]), target="trend (Theil-Sen)",
                   window_start_s=w["start_s"], window=w["index"])


def _judge_growth(gate_context, windows, fault_windows, record, verdict, figure: str, unit: str, judged: str,
                  label: str, rule_from_config: Optional[Threshold] = None, trend_line: bool = False) -> None:
    """A windowed figure's Theil-Sen slope projected over the uptime the run certifies, against its rule
    (`rule_from_config` for a check whose rule a config field sets, else the gate's threshold or default);
    `trend_line`: also draw its line beside the windowed figure (one no drift check draws)."""
    config = gate_context.config.g4
    limit = rule_from_config or gate_context.rule(judged)
    horizon = growth_horizon(config.memory_growth_horizon_s, config.duration_s)
    result = drift(windows, figure, excluded=fault_windows)
    if trend_line:
        _record_trend_line(record, windows, figure, result)
    projection = project_growth(result, config.window_s, horizon.seconds)
    if projection is None:
        verdict(f"G4 {label} growth ({result.words(unit)})", judged, None, rule=rule_from_config, valid=False,
                invalid_reason=result.invalid_reason)
        return
    power = growth_power(result, limit.value, unit, config.window_s, horizon.seconds) if limit is not None else None
    record(judged, projection.growth, unit, sen_slope_per_window=result.sen_slope, windows=result.windows,
           excluded_windows=result.excluded, horizon_why=horizon.why, noise=result.noise, **projection.context(),
           **(power.context() if power else {}))
    verdict(f"G4 {label} growth ({projection.words(unit)} ({horizon.why}); {result.words(unit)}"
            + (f"; {power.words()}" if power else "") + ")", judged, projection.growth, rule=rule_from_config,
            unit=unit, interval=projection.interval)


def test_memory_growth_projected_over_the_horizon_stays_under_the_limit(gate_context, windows, fault_windows,
                                                                         record, verdict):
    rule = Threshold("memory_growth_mib", "<=", gate_context.config.g4.memory_growth_limit_mib)
    _judge_growth(gate_context, windows, fault_windows, record, verdict, "rss_minus_cache_mib", "MiB",
                  "memory_growth_mib", "memory", rule_from_config=rule)


@pytest.mark.parametrize("figure, unit, judged, label", RUNTIME_GROWTH, ids=[row[0] for row in RUNTIME_GROWTH])
def test_runtime_growth_projected_over_the_horizon_stays_under_the_limit(gate_context, windows, fault_windows,
                                                                          record, verdict, not_run, figure, unit,
                                                                          judged, label):
    """Descriptors, threads, event-loop tasks and temp files, each projected as memory is (a leak of any ends a
    long uptime); a figure the candidate's /metrics does not give is not measured, and the report says so."""
    if not any(w.get(figure) is not None for w in windows):
        not_run(f"G4 {label} growth", judged, f"the candidate's /metrics gives no {label} ({figure})")
    _judge_growth(gate_context, windows, fault_windows, record, verdict, figure, unit, judged, label,
                  trend_line=True)


def test_every_scheduled_fault_is_detected_harmless_and_recovered(gate_context, faults, record, verdict):
    scheduled = gate_context.config.g4.faults
    if not scheduled:
        pytest.skip("no fault schedule (g4.faults) in this run")
    rows = {(row["kind"], row["at_s"]): row for row in faults}
    missing = [f"{f.kind} at {f.at_s:g} s" for f in scheduled if (f.kind, f.at_s) not in rows]
    handled = 0
    for row in rows.values():
        ok, words = fault_outcome(row)
        handled += ok
        record("fault", int(ok), kind=row["kind"], at_s=row["at_s"], outcome=words,
               recovered_after_s=row.get("recovered_after_s"), detected=row.get("detected"), **fault_facts(row))
    fraction = handled / len(scheduled)
    summary = faults_summary(rows.values())
    verdict(f"G4 faults handled ({handled} of {len(scheduled)}"
            + (f"; never ran: {', '.join(missing)}" if missing else "") + f"): {summary}",
            "faults_handled_fraction", fraction, unit="%")
