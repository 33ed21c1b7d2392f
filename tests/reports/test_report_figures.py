"""The report's per-gate figures from recorded run data: G1 against the spec, G3's distributions from the raw
records and its predictions, G4's faults table, the environment as tables."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gates.g4_soak.analysis import fault_facts
from kvcore.rundata import RunStore, Unjudged
from reports import g1_arrival, g3_main, g4_soak
from reports.environment import environment_tables
from reports.render import render_run
from reports.rows import GateRows, gate_rows


def rows_of(store: RunStore, gate: str) -> GateRows:
    entry = {"gate": gate, "verdicts": store.verdicts(gate), "measurements": store.measurements(gate),
             "unjudged": store.unjudged(gate)}
    return gate_rows(entry, store, store.predictions())


def g1_verdict(metric: str, value: float, unit: str, op: str, spec: float, status: str = "PASS") -> dict:
    return {"gate": "g1", "check": f"test[{metric}]", "metric": metric, "status": status, "reason": "…",
            "value": value, "unit": unit, "rule": {"metric": metric, "op": op, "value": spec}}


# ---------------------------------------------------------------- G1

def test_g1_ratio_and_headroom_by_hand():
    assert g1_arrival.ratio(6.8, 6.0) == pytest.approx(1.1333, abs=1e-4)          # 6.8 / 6.0
    assert g1_arrival.ratio(0.0, 0.0) is None                                      # a ratio to nothing
    assert g1_arrival.headroom(0.758, "<=", 50.0) == pytest.approx(65.963, abs=1e-3)   # ceiling: 50 / 0.758
    assert g1_arrival.headroom(2.0, ">=", 1.0) == 2.0
    assert g1_arrival.headroom(0.0, "==", 0.0) is None


def test_g1_spec_table_has_measured_spec_ratio_and_verdict_per_check(tmp_path):
    store = RunStore(tmp_path)
    for row in (g1_verdict("seq_read_gbps", 6.8, "GB/s", ">=", 6.0),
                g1_verdict("rand_read_iops", 72_465.0, "IOPS", ">=", 1000.0),
                g1_verdict("rand_read_p99_ms", 0.758, "ms", "<=", 50.0),
                g1_verdict("fio_verify_errors", 0.0, "", "==", 0.0),
                g1_verdict("seq_write_gbps", 2.0, "GB/s", ">=", 3.0, "FAIL")):
        store.add_verdict(row)
    store.add_unjudged(Unjudged("g1", "t", "mixed_70_30_iops", "G1 fio mixed", "no threshold", value=54986.0,
                                unit="IOPS"))
    [table] = g1_arrival.spec_table(rows_of(store, "g1"))
    assert table["columns"] == ["check", "metric", "measured", "spec", "measured / spec", "verdict"]
    by_metric = {row[1]: row for row in table["rows"]}
    assert by_metric["seq_read_gbps"] == ["fio sequential read, 1 MiB requests", "seq_read_gbps", "6.8 GB/s",
                                          "≥ 6 GB/s", "1.13×", "PASS"]
    assert by_metric["rand_read_iops"][2:5] == ["72.5k IOPS", "≥ 1000 IOPS", "72.5×"]
    assert by_metric["rand_read_p99_ms"][3:5] == ["≤ 50 ms", "0.0152×"]             # 0.758 / 50
    assert by_metric["fio_verify_errors"][3:5] == ["= 0", ""]                       # no ratio to 0
    assert by_metric["mixed_70_30_iops"][3:] == ["no rule", "", "not judged"]
    assert table["statuses"] == ["PASS", "PASS", "PASS", "PASS", "FAIL", "not judged"]


def test_g1_headroom_chart_leaves_out_exact_checks_and_puts_ceilings_the_right_way_round(tmp_path):
    store = RunStore(tmp_path)
    for row in (g1_verdict("cpu_cores", 2.0, "", ">=", 1.0), g1_verdict("rand_read_p99_ms", 0.5, "ms", "<=", 50.0),
                g1_verdict("fio_verify_errors", 0.0, "", "==", 0.0)):
        store.add_verdict(row)
    [chart] = g1_arrival.headroom_plots(rows_of(store, "g1"))
    words = ["".join(t.itertext()) for t in ET.fromstring(chart).iter("text")]
    assert {"cpu_cores", "rand_read_p99_ms", "2", "100"} <= set(words)    # 2 / 1; 50 / 0.5
    assert "fio_verify_errors" not in words


# ---------------------------------------------------------------- G3

def write_step(store: RunStore, target: str, level: int, ttfts: list[float], warmup: list[float],
               failed: int, recorded: bool = True) -> Path:
    """A step's records: `warmup` sent before the window, `ttfts` in it, `failed` errors in it."""
    directory = store.raw_dir("g3") / "sweep" / target / f"c{level}" / "records"
    directory.mkdir(parents=True)
    start = 1000.0
    rows = [{"sent_at": start - 1 - i, "ok": True, "ttft_s": t, "e2e_s": 2 * t} for i, t in enumerate(warmup)]
    rows += [{"sent_at": start + i, "ok": True, "ttft_s": t, "e2e_s": 2 * t} for i, t in enumerate(ttfts)]
    rows += [{"sent_at": start + 50 + i, "ok": False, "ttft_s": None, "e2e_s": 0.1} for i in range(failed)]
    (directory / "records-w0-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    window = {"window_start": start, "records_dir": str(directory.relative_to(store.root))} if recorded else {}
    store.record("g3", "sweep", "step_valid", True, target=target, reasons="", concurrency=level, **window)
    store.record("g3", "sweep", "ttft_p50_ms", 1e3 * sorted(ttfts)[len(ttfts) // 2], "ms", target=target,
                 concurrency=level)
    return directory


def test_g3_distributions_hold_exactly_the_measured_windows_completed_requests(tmp_path):
    store = RunStore(tmp_path)
    write_step(store, "baseline", 2, [0.3, 0.31, 0.32, 0.29, 0.35], warmup=[0.9, 0.8], failed=2)
    write_step(store, "candidate", 2, [0.03] * 9, warmup=[0.5], failed=0)
    rows = rows_of(store, "g3")
    steps = g3_main.step_records(rows, g3_main.level_of(rows.measurements))
    records, warm = steps[("baseline", 2.0)]
    assert sorted(r["ttft_s"] for r in records) == [0.29, 0.3, 0.31, 0.32, 0.35] and not warm
    assert len(steps[("candidate", 2.0)][0]) == 9
    ttft, e2e = g3_main.distribution_plots(rows, g3_main.level_of(rows.measurements))
    assert "<title>G3 TTFT distribution per concurrency (CDF)</title>" in ttft
    assert "baseline (n=5)" in ttft and "candidate (n=9)" in ttft and "warm-up included" not in ttft
    assert "E2E latency (ms)" in e2e and "baseline (n=5)" in e2e


def test_g3_distributions_of_a_run_without_recorded_windows_say_the_warm_up_is_in(tmp_path):
    store = RunStore(tmp_path)
    write_step(store, "baseline", 4, [0.3, 0.31], warmup=[0.9], failed=1, recorded=False)
    rows = rows_of(store, "g3")
    ttft, _ = g3_main.distribution_plots(rows, g3_main.level_of(rows.measurements))
    assert "c=4 (warm-up included)" in ttft and "baseline (n=3)" in ttft       # 2 in the window + 1 warm-up


def test_g3_draws_the_predictions_made_before_g3_beside_the_measured_figures(tmp_path):
    store = RunStore(tmp_path)
    for level in (2, 4):
        store.record("g3", "sweep", "ttft_p50_ms", 300.0 + level, "ms", target="baseline", concurrency=level)
        store.record("g3", "sweep", "hit_ratio", 0.93, target="candidate", concurrency=level)
    store.add_predictions("before g3", [
        {"gate": "g3", "metric": "ttft_p50_ms", "value": 280.0, "unit": "ms", "label": "…",
         "context": {"target": "baseline", "concurrency": 2}},
        {"gate": "g3", "metric": "hit_ratio", "value": 0.97, "unit": "%", "label": "…",
         "context": {"target": "candidate", "concurrency": 2}}])
    store.add_predictions("before g2", [{"gate": "g3", "metric": "ttft_p50_ms", "value": 1.0, "unit": "ms",
                                         "label": "…", "context": {"target": "stale", "concurrency": 2}}])
    rows = rows_of(store, "g3")
    assert len(rows.predictions) == 2                                   # only those made before G3 ran
    ttft, hits = g3_main.figure_plots(rows, g3_main.level_of(rows.measurements))
    assert "baseline (predicted)" in ttft and "stale" not in ttft
    assert "candidate (predicted)" in hits and "100%" in hits           # hit ratios as percents


def test_g3_judged_figures_show_their_intervals_the_accepted_band_and_the_prediction(tmp_path):
    store = RunStore(tmp_path)
    for level, value in ((2, 0.87), (4, 0.90)):
        store.add_verdict({"gate": "g3", "check": f"r[c{level}]", "metric": "ttft_p50_reduction", "status": "PASS",
                           "reason": "…", "value": value, "unit": "%", "interval": [value - 0.02, value + 0.01],
                           "rule": {"metric": "ttft_p50_reduction", "op": ">=", "value": 0.25},
                           "context": {"concurrency": level}})
    store.add_predictions("before g3", [{"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.85, "unit": "%",
                                         "label": "…", "context": {"concurrency": 2}}])
    rows = rows_of(store, "g3")
    [chart] = g3_main.judged_plots(rows, g3_main.level_of(rows.measurements))
    assert "<title>G3 TTFT p50 reduction by concurrency</title>" in chart
    assert {"measured (95% interval)", "predicted", "passes"} <= set(re.findall(r">([^<>]+)</text>", chart))


# ---------------------------------------------------------------- G4

def test_fault_facts_are_the_rows_typed_outcome():
    row = {"kind": "flip_byte", "at_s": 12.0, "error": None, "detected_by": "corrupt_blocks",
           "detected": {"corrupt_blocks": 1.0, "read_errors": 0.0},
           "probe_during": {"ok": True, "identical": True, "cached_tokens": 1536, "prompt_tokens": 1830},
           "recovered_after_s": 1.09}
    assert fault_facts(row) == {"detected_by": "corrupt_blocks", "detected_count": 1.0, "answer_unchanged": True,
                                "probe_cached_tokens": 1536, "probe_prompt_tokens": 1830, "error": None, "reprobes": 0}
    # a probe asked again past an upper tier's whole copy of the damaged block is counted
    again = fault_facts({**row, "reprobes": [{"held_by": ["device"], "probe": row["probe_during"]}]})
    assert again["reprobes"] == 1
    failed = fault_facts({"kind": "read_error", "at_s": 30.0, "error": "admin said 500"})
    assert failed == {"detected_by": None, "detected_count": None, "answer_unchanged": None,
                      "probe_cached_tokens": None, "probe_prompt_tokens": None, "error": "admin said 500",
                      "reprobes": 0}


def test_g4_faults_table_reads_the_recorded_fields_and_marks_older_rows_not_recorded(tmp_path):
    store = RunStore(tmp_path)
    handled = {"kind": "flip_byte", "at_s": 12.0, "detected_by": "corrupt_blocks", "detected": {"corrupt_blocks": 1.0},
               "probe_during": {"identical": True, "cached_tokens": 1536, "prompt_tokens": 1830},
               "recovered_after_s": 1.09, "error": None}
    missed = {"kind": "read_error", "at_s": 30.0, "detected_by": "read_errors", "detected": {"read_errors": 0.0},
              "probe_during": {"identical": False, "cached_tokens": 0, "prompt_tokens": 1830},
              "recovered_after_s": None, "error": None}
    store.record("g4", "faults", "fault", 0, kind="slow_disk", at_s=50.0, outcome="words", recovered_after_s=2.5)
    for row, ok in ((missed, 0), (handled, 1)):
        store.record("g4", "faults", "fault", ok, kind=row["kind"], at_s=row["at_s"], outcome="words the table ignores",
                     recovered_after_s=row["recovered_after_s"], detected=row["detected"], **fault_facts(row))
    [table] = g4_soak.fault_tables(rows_of(store, "g4"))
    assert table["columns"] == ["fault", "at", "detected by", "answer unchanged", "recovered after", "injection error",
                                "handled"]
    assert table["rows"] == [
        [
            "flip_byte",
            "12 s",
            "corrupt_blocks (+1)",
            "yes (1536 of 1830 prompt tokens from cache)",
            "1.1 s",
            "",
            "PASS",
        ],
        [
            "read_error",
            "30 s",
            "NOT detected (read_errors did not move)",
            "NO (0 of 1830 prompt tokens from cache)",
            "not recovered",
            "",
            "FAIL",
        ],
        ["slow_disk", "50 s", "not recorded", "not recorded", "2.5 s", "", "FAIL"],
    ]
    assert table["statuses"] == ["PASS", "FAIL", "FAIL"]


def test_g4_window_plots_mark_faults_and_shade_the_windows_left_out(tmp_path):
    store = RunStore(tmp_path)
    for i in range(6):
        store.record("g4", "soak", "window_ttft_p99_ms", 120.0 + i, "", target="candidate", window_start_s=10.0 * i,
                     window=i)
    store.record("g4", "faults", "fault", 1, kind="flip_byte", at_s=12.0)
    store.record("g4", "left out", "drift_excluded_window", 10.0, "s", window=1, window_start_s=10.0,
                 window_end_s=20.0, reason="…")
    rows = rows_of(store, "g4")
    assert g4_soak.fault_markers(rows.measurements) == [(12.0, "flip_byte")]
    assert g4_soak.left_out_spans(rows.measurements) == [(10.0, 20.0, "window 1")]
    [chart] = g4_soak.window_plots(rows)
    assert "<title>G4 windowed TTFT p99</title>" in chart and "TTFT p99 (ms)" in chart   # unit from the name
    assert "flip_byte" in chart and "left out of the drift checks (warm-up, faults)" in chart
    assert ">fault</text>" in chart                                       # the markers' legend entry


# ---------------------------------------------------------------- environment

ENVIRONMENT = {"versions": {"python": "3.11.7", "torch": "2.13.0+cpu"}, "config_digest": "sha256:39f3",
               "git_sha": "f28bc8d", "memory": {"available": True, "total_bytes": 25276059648},
               "gpus": {"available": False, "reason": "nvidia-smi not found on PATH"},
               "inventory": {"nvme": [{"model": "PM1743", "size_bytes": 30_720_000_000_000}]}}
RUN = {"run_id": "r1", "started_at": 1796141276.6, "gates": ["g1", "g2"], "environment": ENVIRONMENT,
       "targets": {"baseline": {"url": "http://127.0.0.1:9/v1", "mode": "device-only"},
                   "candidate": {"url": "http://127.0.0.1:10/v1", "mode": "tiered", "nodes": ["a", "b"]}}}


def test_environment_tables_follow_the_data_shape():
    tables = {t["title"]: t for t in environment_tables(ENVIRONMENT, RUN)}
    assert tables["Run"]["rows"] == [["run id", "r1"], ["started at", "2026-12-01 16:07:56 UTC"],
                                     ["gates", "g1, g2"], ["config digest", "sha256:39f3"], ["git sha", "f28bc8d"]]
    assert tables["Versions"]["rows"] == [["python", "3.11.7"], ["torch", "2.13.0+cpu"]]
    assert tables["Memory"]["rows"] == [["total", "23.5 GiB (25,276,059,648 bytes)"]]     # 25276059648 / 2^30
    assert tables["GPUs"]["rows"] == [["not available", "nvidia-smi not found on PATH"]]
    assert tables["Inventory: nvme"]["columns"] == ["model", "size bytes"]
    assert tables["Targets"]["columns"] == ["name", "url", "mode", "nodes"]
    assert tables["Targets"]["rows"][1] == ["candidate", "http://127.0.0.1:10/v1", "tiered", "a, b"]
    assert tables["Targets"]["rows"][0][3] == "—"


def test_the_page_shows_the_environment_as_tables_not_json(tmp_path):
    store = RunStore(tmp_path)
    store.write_run_info(RUN)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    section = page[page.index('id="environment"'):]
    assert "<h4>Versions</h4>" in section and "<td>2.13.0+cpu</td>" in section and "<td>PM1743</td>" in section
    assert '{"' not in section and "<pre>" not in section


# ---------------------------------------------------------------- G2

def test_g2_draws_each_judged_ratio_with_its_interval_beside_the_prediction_made_before_g2(tmp_path):
    from reports import g2_cache

    store = RunStore(tmp_path)
    store.add_verdict({"gate": "g2", "check": "disk hit", "metric": "disk_hit_ttft_vs_recompute", "status": "PASS",
                       "reason": "…", "value": 0.075, "unit": "%", "interval": [0.072, 0.078],
                       "rule": {"metric": "disk_hit_ttft_vs_recompute", "op": "<=", "value": 0.25}})
    store.add_verdict({"gate": "g2", "check": "saves", "metric": "checkpoint_saves_complete", "status": "PASS",
                       "reason": "…", "value": 1.0, "unit": "%",
                       "rule": {"metric": "checkpoint_saves_complete", "op": "==", "value": 1.0}})
    store.add_predictions("before g2", [{"gate": "g2", "metric": "disk_hit_ttft_vs_recompute", "value": 0.06,
                                         "unit": "%", "label": "…", "context": {"context_tokens": 8192}}])
    [chart] = g2_cache.judged_ratio_plots(rows_of(store, "g2"))
    words = set(re.findall(r">([^<>]+)</text>", chart))
    assert {"disk hit ttft vs recompute", "predicted before the gate", "threshold"} <= words
    assert "checkpoint saves complete" not in words          # an exact rule with no interval: the table says it


def test_g3_step_table_lists_each_steps_recorded_figures_and_why_a_step_was_invalid(tmp_path):
    store = RunStore(tmp_path)
    for target, ttft, hits, valid in (("baseline", 294.86, 0.1293, True), ("candidate", 38.1, 0.9291, False)):
        store.record("g3", "sweep", "ttft_p50_ms", ttft, "ms", target=target, concurrency=2)
        store.record("g3", "sweep", "hit_ratio", hits, target=target, concurrency=2)
        store.record("g3", "sweep", "error_rate", 0.0, target=target, concurrency=2)
        store.record("g3", "sweep", "step_valid", valid, target=target, reasons="" if valid else "client saturated",
                     concurrency=2, due=107, sent=98 if valid else 107, finished=91 if valid else 107)
    [table] = g3_main.step_tables(rows_of(store, "g3"))
    first, second = table["rows"]
    assert first[:3] == ["c=2", "baseline", "294.9"] and first[-4:] == ["12.9%", "0.0%", "107 / 98 / 91", "yes"]
    assert second[1:3] == ["candidate", "38.1"] and second[-2:] == ["107 / 107 / 107", "NO: client saturated"]
    assert table["statuses"] == ["", "inconclusive"]


def test_a_candidates_hit_ratio_far_below_its_workloads_bound_is_a_warning_at_the_top_of_g3(tmp_path):
    from reports.render import render_run

    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g3"]})
    store.set_status("g3", "passed", "")
    for target, measured, far in (("candidate", 0.41, True), ("baseline", 0.12, True), ("candidate", 0.93, False)):
        store.record("g3", "figures", "hit_ratio_bound", 0.966, target=target, measured=measured, far_below=far,
                     far_below_points=0.2, concurrency=4 if measured != 0.93 else 8)
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert page.count('<div class="warnings">') == 1
    assert "candidate at c=4: hit ratio 41.0%, far below the 96.6% its workload allows" in page
    assert "baseline at c=4" not in page and "c=8: hit ratio" not in page      # the baseline's is by design


def test_g3_capacity_charts_draw_each_targets_probes_against_the_slos_limits_and_the_table_lists_them(tmp_path):
    from reports import g3_capacity

    store = RunStore(tmp_path)
    limits = {"slo": "TTFT p90 ≤ 95 ms, errors ≤ 0.1%", "ttft_limit_ms": 95.0, "tpot_limit_ms": None,
              "percentile": 90.0}
    probes = [("baseline", 1, "meets", 41.0, 1.0), ("candidate", 1, "meets", 40.5, 1.0),
              ("candidate", 2, "meets", 41.2, 0.98), ("baseline", 2, "misses", 150.0, 0.5),
              ("baseline", 3, "undecided", 96.0, 0.88)]
    for target, users, decision, ttft, goodput in probes:
        store.record("g3", "probe", "capacity_probe", decision == "meets", target=target, load=users, load_unit="users",
                     decision=decision, requests=40, misses=round(40 * (1 - goodput)), interval=[0.0, 0.08],
                     ttft_p90_ms=ttft, tpot_p90_ms=10.0, goodput=goodput, late=0, seconds=3.5, **limits)
    store.record("g3", "capacity", "capacity_users", 1, "users", target="baseline", line="1 (meets at 1, misses at 2)")
    store.record("g3", "capacity", "capacity_users", None, "users", target="candidate",
                 line="between 2 and ? (met up to 2)")
    rows = rows_of(store, "g3")
    ttft, tpot, goodput = g3_capacity.capacity_plots(rows)
    assert "<svg" in ttft and "within the SLO" in ttft and "baseline: 1" in ttft and "candidate" in ttft
    assert "TPOT p90" in tpot and "the SLO" in goodput and "percentile" in goodput
    probe_table, capacities = g3_capacity.capacity_tables(rows)
    assert [row[:3] for row in probe_table["rows"]] == [[t, str(u), d] for t, u, d, _, _ in probes]
    assert probe_table["statuses"] == ["", "", "", "", "inconclusive"]      # a probe that misses is no failure
    assert "TTFT p90 ≤ 95 ms" in probe_table["title"]
    assert capacities["rows"] == [["baseline", "1 (meets at 1, misses at 2)", "", ""],
                                  ["candidate", "between 2 and ? (met up to 2)", "", ""]]
    assert "users (closed loop)" in ttft and probe_table["columns"][1] == "users (closed loop)"
    assert g3_capacity.capacity_plots(rows_of(RunStore(tmp_path / "none"), "g3")) == []   # no search: nothing
    # open loop: loads are multiples of the trace's rate, and the capacity is `capacity_rate`
    rates = RunStore(tmp_path / "rates")
    rates.record("g3", "probe", "capacity_probe", True, target="baseline", load=0.5, load_unit="x the trace's rate",
                 decision="meets", requests=40, misses=0, interval=[0.0, 0.08], ttft_p90_ms=30.0, goodput=1.0, **limits)
    rates.record("g3", "capacity", "capacity_rate", 0.5, "x the trace's rate", target="baseline", line="0.5 (…)")
    charts = g3_capacity.capacity_plots(rows_of(rates, "g3"))
    assert "x the trace's rate (open loop)" in charts[0] and "baseline: 0.5" in charts[0]
    assert g3_capacity.capacity_tables(rows_of(rates, "g3"))[1]["rows"] == [["baseline", "0.5 (…)", "", ""]]
    # the sizing model's capacity, made before G3, beside the measured one with its error
    store.add_predictions("before g3", [{"gate": "g3", "metric": "capacity_users", "value": 1.5, "unit": "users",
                                         "context": {"target": "baseline"}}])
    rows = rows_of(store, "g3")
    assert g3_capacity.capacity_tables(rows)[1]["rows"][0][2:] == ["1.5", "+50.0%"]
    assert "baseline predicted: 1.5" in g3_capacity.capacity_plots(rows)[0]
    store.add_predictions("before g3", [{"gate": "g3", "metric": "capacity_users", "value": 1.0, "unit": "users",
                                         "context": {"target": "candidate"}}])
    # a prediction on a measured capacity's load shares its line, both named
    assert "baseline, candidate predicted: 1" in g3_capacity.capacity_plots(rows_of(store, "g3"))[0]
