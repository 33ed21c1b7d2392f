"""The run's overall outcome, decided once in kvcore.outcome from the gates' statuses (kvgate run's exit code and
results.json's `overall` both read it)."""

from __future__ import annotations

import pytest

from kvcore.outcome import exit_code, overall, overall_status


def _gates(*statuses: str, reasons: dict[int, str] | None = None, requested: int | None = None) -> list[dict]:
    """G1..Gn with these statuses, the first `requested` of them requested (default: all)."""
    count = len(statuses) if requested is None else requested
    return [{"gate": f"g{i + 1}", "status": status, "reason": (reasons or {}).get(i, f"reason {i + 1}"),
             "requested": i < count} for i, status in enumerate(statuses)]


@pytest.mark.parametrize("statuses, expected, deciding", [
    (("passed", "passed", "passed", "passed"), "passed", None),
    (("passed", "failed", "not run", "not run"), "failed", "g2"),
    (("passed", "error", "passed", "passed"), "failed", "g2"),               # an error is a failure
    (("passed", "inconclusive", "failed", "passed"), "failed", "g3"),        # failed before inconclusive
    (("inconclusive", "passed", "passed", "passed"), "inconclusive", "g1"),
    (("inconclusive", "running", "passed", "passed"), "inconclusive", "g1"),  # inconclusive before incomplete
    (("passed", "running", "passed", "passed"), "incomplete", "g2"),
    (("passed", "passed", "not run", "passed"), "incomplete", "g3"),
])
def test_the_overall_status_is_failed_then_inconclusive_then_incomplete_then_passed(statuses, expected, deciding):
    status, first = overall_status(_gates(*statuses))
    assert status == expected
    assert (first["gate"] if first is not None else None) == deciding


def test_a_gate_stopped_by_an_earlier_one_is_not_named_as_the_reason_a_run_is_incomplete():
    gates = _gates("passed", "passed", "not run", "running",
                   reasons={2: "not run: stopped at G2", 3: "in progress"})
    assert overall_status(gates)[0] == "incomplete" and overall_status(gates)[1]["gate"] == "g4"
    only_stopped = _gates("passed", "not run", reasons={1: "stopped at G1"})
    assert overall_status(only_stopped) == ("incomplete", only_stopped[1])


def test_gates_not_requested_do_not_decide_a_pass_but_a_failure_anywhere_fails_the_run():
    assert overall_status(_gates("passed", "passed", "not run", "not run", requested=2)) == ("passed", None)
    assert overall_status(_gates("passed", "not run", requested=0)) == ("incomplete", None)
    assert overall_status(_gates("passed", "failed", requested=1))[0] == "failed"


def test_the_summary_names_the_deciding_gate_its_first_reason_line_and_every_requested_gate():
    gates = _gates("passed", "failed", "not run", requested=3, reasons={1: "1 of 9 checks failed\nmore detail"})
    assert overall(gates) == {"status": "failed", "summary": "G2 failed: 1 of 9 checks failed — "
                                                            "G1 passed · G2 failed · G3 not run"}
    assert overall(_gates("passed", requested=1)) == {"status": "passed",
                                                      "summary": "all requested gates passed — G1 passed"}
    assert overall(_gates("passed", requested=0)) == {"status": "incomplete", "summary": "no gates requested"}
    assert overall(_gates("running", reasons={0: " "}))["summary"] == "G1 running — G1 running"


@pytest.mark.parametrize("status, code", [("passed", 0), ("failed", 1), ("inconclusive", 1), ("incomplete", 1)])
def test_kvgate_run_exits_0_only_when_the_overall_status_passed(status, code):
    assert exit_code(status) == code
