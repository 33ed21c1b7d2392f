"""Verdicts: rules as data, PASS/FAIL/INCONCLUSIVE at and around the edges, one-line reasons."""

from __future__ import annotations

import json

import pytest

from kvcore.verdict import Band, Threshold, Verdict, judge, parse_rule

EPS = 1e-6


def threshold(op: str, value: float = 10.0) -> Threshold:
    return Threshold("m", op, value)


BAND = Band("throughput_gain", 0.29, 0.40)


def status(value, rule, **kwargs) -> str:
    return judge("g1", "check", "G1 label", value, rule, **kwargs).status


# --- thresholds: each op at, above and below -------------------------------------------------

@pytest.mark.parametrize("op, below, at, above", [
    (">=", "FAIL", "PASS", "PASS"),
    (">", "FAIL", "FAIL", "PASS"),
    ("<=", "PASS", "PASS", "FAIL"),
    ("<", "PASS", "FAIL", "FAIL"),
    ("==", "FAIL", "PASS", "FAIL"),
])
def test_each_op_judges_below_at_and_above_the_threshold(op, below, at, above):
    assert status(10.0 - 0.5, threshold(op)) == below
    assert status(10.0, threshold(op)) == at
    assert status(10.0 + 0.5, threshold(op)) == above


def test_equality_tolerates_float_rounding_but_not_a_real_difference():
    assert status(0.1 + 0.2, threshold("==", 0.3)) == "PASS"
    assert status(0.3 + 1e-6, threshold("==", 0.3)) == "FAIL"


# --- bands -----------------------------------------------------------------------------------

def test_band_passes_exactly_at_min_and_exactly_at_max_without_a_note():
    at_min = judge("g3", "tp", "G3 gain", 0.29, BAND, unit="%")
    at_max = judge("g3", "tp", "G3 gain", 0.40, BAND, unit="%")
    assert (at_min.status, at_min.note) == ("PASS", "")
    assert (at_max.status, at_max.note) == ("PASS", "")


def test_band_fails_just_below_min_and_says_below():
    verdict = judge("g3", "tp", "G3 gain", 0.29 - EPS, BAND, unit="%")
    assert verdict.status == "FAIL"
    assert "below" in verdict.reason


def test_band_above_max_passes_with_a_non_empty_note():
    verdict = judge("g3", "tp", "G3 gain", 0.40 + EPS, BAND, unit="%")
    assert verdict.status == "PASS"
    assert "above the band" in verdict.note


# --- intervals -------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [">=", ">", "<=", "<"])
def test_threshold_interval_straddling_the_threshold_is_inconclusive(op):
    verdict = judge("g3", "c", "G3 x", 10.5, threshold(op), interval=(9.0, 11.0))
    assert verdict.status == "INCONCLUSIVE"
    assert "straddles" in verdict.reason


def test_equality_interval_containing_the_threshold_is_inconclusive():
    assert status(10.0, threshold("=="), interval=(9.0, 11.0)) == "INCONCLUSIVE"


@pytest.mark.parametrize("value, interval, expected", [
    (12.0, (11.0, 13.0), "PASS"),   # fully above a >= threshold
    (8.0, (7.0, 9.0), "FAIL"),      # fully below
    (10.0, (10.0, 12.0), "PASS"),   # lower end exactly at the threshold still passes >=
])
def test_interval_fully_on_one_side_keeps_the_outcome(value, interval, expected):
    assert status(value, threshold(">="), interval=interval) == expected
    assert status(value, threshold(">=")) == expected


def test_strict_op_interval_ending_at_the_threshold_straddles():
    # > fails at equality, so [10, 12] holds a failing and a passing figure
    assert status(11.0, threshold(">"), interval=(10.0, 12.0)) == "INCONCLUSIVE"


def test_band_interval_straddling_min_is_inconclusive():
    verdict = judge("g3", "tp", "G3 gain", 0.31, BAND, unit="%", interval=(0.27, 0.33))
    assert verdict.status == "INCONCLUSIVE"
    assert "minimum" in verdict.reason


def test_band_interval_straddling_max_still_passes_with_a_note():
    inside = judge("g3", "tp", "G3 gain", 0.38, BAND, unit="%", interval=(0.35, 0.43))
    above = judge("g3", "tp", "G3 gain", 0.42, BAND, unit="%", interval=(0.38, 0.46))
    assert inside.status == "PASS" and inside.note
    assert above.status == "PASS" and "above the band" in above.note


def test_band_interval_fully_inside_or_below_keeps_the_outcome():
    assert status(0.35, BAND, unit="%", interval=(0.31, 0.38)) == "PASS"
    assert status(0.20, BAND, unit="%", interval=(0.15, 0.25)) == "FAIL"


def test_interval_with_lo_above_hi_is_rejected():
    with pytest.raises(ValueError, match="lo <= hi"):
        judge("g3", "c", "G3 x", 10.0, threshold(">="), interval=(11.0, 9.0))


# --- invalid steps and missing figures -------------------------------------------------------

def test_invalid_step_is_inconclusive_and_gives_the_reason_even_when_the_figure_passes():
    verdict = judge("g3", "c", "G3 x", 20.0, threshold(">="), valid=False, invalid_reason="client CPU at 98%")
    assert verdict.status == "INCONCLUSIVE"
    assert "client CPU at 98%" in verdict.reason
    assert verdict.value == 20.0


def test_none_value_is_inconclusive_with_no_measurement():
    verdict = judge("g2", "c", "G2 x", None, threshold(">="))
    assert verdict.status == "INCONCLUSIVE"
    assert "no measurement" in verdict.reason
    assert verdict.value is None


def test_nan_value_counts_as_no_measurement():
    assert status(float("nan"), threshold(">=")) == "INCONCLUSIVE"


# --- reasons ---------------------------------------------------------------------------------

def test_threshold_reason_matches_the_design_example_exactly():
    verdict = judge("g3", "ttft_c16", "G3 TTFT p50 reduction at c=16", 0.312,
                    Threshold("ttft_p50_reduction", ">=", 0.25), unit="%", interval=(0.279, 0.340))
    assert verdict.reason == "G3 TTFT p50 reduction at c=16: 31.2% [27.9, 34.0] ≥ 25% → PASS"


def test_plain_unit_reason_uses_three_significant_digits():
    verdict = judge("g2", "cold_read", "G2 cold-read bandwidth", 1.2149,
                    Threshold("cold_read_gbps", ">=", 0.98), unit="GB/s")
    assert verdict.reason == "G2 cold-read bandwidth: 1.21 GB/s ≥ 0.98 GB/s → PASS"


def test_band_reason_matches_an_exact_example():
    verdict = judge("g3", "tp_c8", "G3 throughput gain at c=8", 0.35, BAND, unit="%")
    assert verdict.reason == "G3 throughput gain at c=8: +35.0% in [+29%, +40%] → PASS"


@pytest.mark.parametrize("op, symbol", [(">=", "≥"), ("<=", "≤"), (">", ">"), ("<", "<"), ("==", "=")])
def test_reason_holds_label_value_rule_symbol_and_status_on_one_line(op, symbol):
    verdict = judge("g1", "p99", "G1 p99 latency", 3.0, threshold(op, 2.0), unit="ms",
                    valid=True)
    assert verdict.reason.startswith("G1 p99 latency: 3 ms ")
    assert f"{symbol} 2 ms" in verdict.reason
    assert verdict.reason.endswith(f"→ {verdict.status}")
    assert "\n" not in verdict.reason


def test_invalid_reason_with_newlines_stays_on_one_line():
    verdict = judge("g3", "c", "G3 x", 1.0, threshold(">="), valid=False, invalid_reason="too few\nrequests")
    assert "\n" not in verdict.reason and "too few requests" in verdict.reason


def test_custom_display_formats_value_and_rule():
    verdict = judge("g1", "iops", "G1 random read", 523_000.0, threshold(">=", 500_000.0),
                    display=lambda x: f"{x / 1000:.0f}k IOPS")
    assert verdict.reason == "G1 random read: 523k IOPS ≥ 500k IOPS → PASS"


# --- rules as data ---------------------------------------------------------------------------

def test_parse_rule_builds_threshold_and_band():
    assert parse_rule({"metric": "m", "op": ">=", "value": 5}) == Threshold(metric="m", op=">=", value=5.0)
    assert parse_rule({"metric": "throughput_gain", "min": 0.29, "max": 0.40}) == BAND


@pytest.mark.parametrize("mapping, fragment", [
    ({"metric": "m", "op": ">="}, "found {metric, op}"),
    ({"metric": "m", "value": 1}, "found {metric, value}"),
    ({"metric": "m", "min": 1}, "found {metric, min}"),
    ({"metric": "m", "op": ">=", "value": 1, "min": 0}, "found {metric, min, op, value}"),
    ({"op": ">=", "value": 1}, "{metric, op, value}"),
    ([("metric", "m")], "found list"),
])
def test_parse_rule_names_what_was_expected_and_found(mapping, fragment):
    with pytest.raises(ValueError) as error:
        parse_rule(mapping)
    assert "expected" in str(error.value) and fragment in str(error.value)


def test_parse_rule_rejects_an_unknown_op_naming_the_choices():
    with pytest.raises(ValueError, match=r"^op: expected one of >=, <=, >, <, ==, found '=>'"):
        parse_rule({"metric": "m", "op": "=>", "value": 10.0})


@pytest.mark.parametrize("bad", ["25%", None, True, float("nan")])
def test_parse_rule_rejects_a_non_numeric_value(bad):
    with pytest.raises(ValueError, match=r"^value: expected a finite number"):
        parse_rule({"metric": "m", "op": ">=", "value": bad})


def test_band_with_min_above_max_names_the_field():
    with pytest.raises(ValueError, match=r"^max: expected max >= min"):
        parse_rule({"metric": "m", "min": 0.5, "max": 0.4})


def test_judge_accepts_a_parsed_rule_and_records_its_dict_form():
    verdict = judge("g1", "c", "G1 x", 11.0, Threshold(metric="m", op=">=", value=10))
    assert verdict.metric == "m"
    assert verdict.rule == {"metric": "m", "op": ">=", "value": 10.0}


def test_judge_refuses_a_rule_not_parsed_once_at_its_edge():
    with pytest.raises(TypeError, match=r"^rule: expected a parsed rule \(kvcore.rules.parse_rule\), found dict"):
        judge("g1", "c", "G1 x", 11.0, {"metric": "m", "op": ">=", "value": 10})


# --- storage form ----------------------------------------------------------------------------

def test_to_dict_is_json_serialisable_and_round_trips():
    for verdict in (
        judge("g3", "tp", "G3 gain", 0.45, BAND, unit="%", interval=(0.41, 0.49)),
        judge("g2", "c", "G2 x", None, threshold(">=")),
    ):
        row = json.loads(json.dumps(verdict.to_dict(), allow_nan=False))
        assert Verdict.from_dict(row) == verdict
        assert set(row) >= {"gate", "check", "metric", "status", "reason", "value", "unit", "rule"}


def test_to_dict_follows_the_run_store_format():
    with_extras = judge("g3", "tp", "G3 gain", 0.45, BAND, unit="%", interval=(0.41, 0.49)).to_dict()
    plain = judge("g1", "c", "G1 x", 11.0, threshold(">=")).to_dict()
    assert with_extras["interval"] == [0.41, 0.49] and with_extras["note"]
    assert "interval" not in plain and "note" not in plain
