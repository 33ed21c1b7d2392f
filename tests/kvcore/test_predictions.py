"""A verdict beside the sizing model's prediction for it: which prediction counts, the error's rule,
and where it shows (results.json's verdicts, the report, the console line)."""

from __future__ import annotations

import json
import math

import pytest

from kvcore.predictions import beside, beside_text, error, prediction_for
from kvcore.rundata import RunStore


def _store(tmp_path) -> RunStore:
    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "r", "gates": ["g3"]})
    store.set_status("g3", "passed", "")
    store.add_predictions("before g3", [
        {"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.849, "unit": "%", "status": "PASS",
         "context": {"concurrency": 2}},
        {"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.879, "unit": "%", "status": "PASS",
         "context": {"concurrency": 4}},
        {"gate": "g3", "metric": "ttft_p50_ms", "value": 230.0, "unit": "ms", "context": {"concurrency": 4,
                                                                                          "target": "candidate"}}])
    # made before another gate (from less data): never the one a G3 figure is held to
    store.add_predictions("before g2", [{"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.10,
                                         "context": {"concurrency": 2}}])
    return store


def test_a_figure_is_held_to_the_prediction_made_before_its_gate_at_its_own_level(tmp_path):
    store = _store(tmp_path)
    predictions = store.predictions()
    at_2 = {"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.871, "context": {"concurrency": 2}}
    assert prediction_for(at_2, predictions)["value"] == 0.849
    assert prediction_for({**at_2, "context": {"concurrency": 8}}, predictions) is None
    assert prediction_for({**at_2, "metric": "throughput_gain"}, predictions) is None
    shown = beside(at_2, predictions)
    # a reduction is compared in points: 84.9% predicted, 87.1% measured
    assert shown["error"] == pytest.approx(0.849 - 0.871) and shown["error_text"] == "-2.2 points"
    assert beside_text(shown, "%") == "predicted 84.9% (PASS), error -2.2 points"
    # a TTFT as a relative error: 230 ms predicted, 200 measured
    ttft = {"gate": "g3", "metric": "ttft_p50_ms", "value": 200.0, "context": {"concurrency": 4,
                                                                               "target": "candidate"}}
    assert beside(ttft, predictions)["error_text"] == "+15.0%"
    assert beside({**ttft, "context": {"concurrency": 4, "target": "baseline"}}, predictions) is None


def test_the_error_rule_in_points_and_relative():
    assert error("hit_ratio", 0.966, 0.936) == (pytest.approx(0.03), "+3.0 points")
    assert error("output_tokens_per_s", 90.0, 100.0) == (pytest.approx(-0.1), "-10.0%")
    # a capacity of 0 measured: exact when predicted 0, else no relative error (it printed "+nan%")
    assert error("capacity_rate", 0.0, 0.0) == (0.0, "+0.0%")
    value, text = error("capacity_rate", 0.5, 0.0)
    assert math.isnan(value) and text == "no relative error (measured 0)"


def test_results_json_and_the_report_carry_the_prediction_beside_each_verdict(tmp_path):
    from reports.render import render_run

    store = _store(tmp_path)
    store.add_verdict({"gate": "g3", "check": "reduction[c2]", "metric": "ttft_p50_reduction", "status": "PASS",
                       "reason": "G3 TTFT p50 reduction at c=2: 87.1% ≥ 25% → PASS", "value": 0.871, "unit": "%",
                       "context": {"concurrency": 2}})
    store.add_verdict({"gate": "g3", "check": "reduction[c8]", "metric": "ttft_p50_reduction", "status": "PASS",
                       "reason": "G3 TTFT p50 reduction at c=8: 96.6% ≥ 25% → PASS", "value": 0.966, "unit": "%",
                       "context": {"concurrency": 8}})
    render_run(tmp_path)
    g3 = next(g for g in json.loads((tmp_path / "results.json").read_text())["gates"] if g["gate"] == "g3")
    c2, c8 = g3["verdicts"]
    assert c2["predicted"]["predicted"] == 0.849 and c2["predicted"]["error_text"] == "-2.2 points"
    assert c8["predicted"] is None            # nothing was predicted at c=8
    page = (tmp_path / "index.html").read_text()
    assert "84.9% (PASS)" in page and "error -2.2 points" in page


def test_the_console_line_of_a_verdict_shows_its_prediction(tmp_path):
    import io

    from rich.console import Console

    from gates.config import load_config
    from gates.run import GateRunner

    store = _store(tmp_path)
    store.add_verdict({"gate": "g3", "check": "reduction[c4]", "metric": "ttft_p50_reduction", "status": "PASS",
                       "reason": "G3 TTFT p50 reduction at c=4: 90.2% ≥ 25% → PASS", "value": 0.902, "unit": "%",
                       "context": {"concurrency": 4}})
    out = io.StringIO()
    runner = GateRunner(load_config(), tmp_path, "r", ["g3"], False, Console(file=out, width=200))
    assert runner._print_new_verdicts("g3", 0) == 1
    assert "90.2% ≥ 25% → PASS  (predicted 87.9% (PASS), error -2.3 points)" in out.getvalue()


def test_an_inconclusive_verdict_shows_its_prediction_but_no_error(tmp_path):
    """An invalid step's figure measures the failure, not the model: no error, and the report says why."""
    from reports.render import render_run

    store = _store(tmp_path)
    store.add_verdict({"gate": "g3", "check": "reduction[c2]", "metric": "ttft_p50_reduction", "status": "INCONCLUSIVE",
                       "reason": "…", "value": 0.407, "unit": "%", "context": {"concurrency": 2}, "valid": False,
                       "invalid_reason": "candidate: 43 of 100 measured requests failed"})
    store.add_verdict({"gate": "g3", "check": "reduction[c4]", "metric": "ttft_p50_reduction", "status": "INCONCLUSIVE",
                       "reason": "…", "value": 0.30, "interval": [0.2, 0.4], "unit": "%",
                       "context": {"concurrency": 4}})
    invalid, undecided = store.verdicts("g3")
    shown = beside(invalid, store.predictions())
    assert shown["predicted"] == 0.849 and shown["error"] is None
    assert shown["error_text"] == "not compared (invalid: candidate: 43 of 100 measured requests failed)"
    assert beside(undecided, store.predictions())["error_text"] == \
        "not compared (inconclusive: its interval straddles the rule)"
    assert beside_text(shown, "%") == ("predicted 84.9% (PASS), not compared (invalid: candidate: 43 of 100 "
                                       "measured requests failed)")
    render_run(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "not compared (invalid: candidate: 43 of 100 measured requests failed)" in page
    assert "error not compared" not in page


def test_a_measurement_of_an_invalid_step_or_of_an_unjudged_verdict_is_not_a_judged_figure():
    from kvcore.judged import measurement_not_judged

    steps = [{"metric": "step_valid", "value": False, "context": {"target": "candidate", "concurrency": 8,
                                                                   "reasons": "client saturated: CPU p90 99% > 90%"}},
             {"metric": "step_valid", "value": True, "context": {"target": "candidate", "concurrency": 2}}]
    hits_8 = {"metric": "hit_ratio", "value": 0.9, "context": {"target": "candidate", "concurrency": 8}}
    hits_2 = {"metric": "hit_ratio", "value": 0.9, "context": {"target": "candidate", "concurrency": 2}}
    assert measurement_not_judged(hits_8, [], steps) == "invalid: client saturated: CPU p90 99% > 90%"
    assert measurement_not_judged(hits_2, [], steps) is None
    reduction = {"metric": "ttft_p50_reduction", "value": 0.3, "context": {"concurrency": 8}}   # both targets' steps
    assert measurement_not_judged(reduction, [], steps).startswith("invalid: client saturated")
    verdict = {"metric": "disk_hit_ttft_vs_recompute", "status": "INCONCLUSIVE", "value": 0.2, "valid": False,
               "invalid_reason": "too few rounds", "context": {"context_tokens": 8192}}
    g2 = {"metric": "disk_hit_ttft_vs_recompute", "value": 0.2, "context": {"context_tokens": 8192}}
    assert measurement_not_judged(g2, [verdict], []) == "invalid: too few rounds"
    assert measurement_not_judged(g2, [{**verdict, "status": "PASS", "valid": True}], []) is None


def test_a_figure_is_written_to_three_significant_figures_without_an_exponent():
    from kvcore.predictions import format_figure

    assert format_figure(1360.4, "ms") == "1,360 ms" and format_figure(999.6, "ms") == "1,000 ms"
    assert format_figure(62372, "IOPS") == "62,400 IOPS" and format_figure(136, "ms") == "136 ms"
    assert format_figure(1.214, "GB/s") == "1.21 GB/s" and format_figure(0.3125, "") == "0.312"
