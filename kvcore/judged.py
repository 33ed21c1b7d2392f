"""Which figures of a run were judged: the only ones a claim, a summary or a prediction's error may use.

A verdict's figure counts as measured when the verdict is PASS or FAIL (a valid step, an interval
that decided). An INCONCLUSIVE verdict's figure does not: from an invalid step (`valid: False`,
with its `invalid_reason`: errors, client lag, too few requests) it is not a measurement of the
target; with an interval straddling the rule it is not decided. With all four G3 verdicts
INCONCLUSIVE, the claims sheet once read "met" at 40.7% and 29.2% from them; now it reads
"not measured (invalid: <reason>)". Read from typed fields (status, valid, invalid_reason,
value), never from the reason text. Torch-free.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .rundata import FAIL, PASS, finite_number

PLACE_KEYS = ("concurrency", "multiplier", "context_tokens", "target")


def judged(verdict: dict) -> bool:
    """Whether a verdict row's figure is a judged measurement: PASS or FAIL, from a valid step, with a value."""
    return (verdict.get("status") in (PASS, FAIL) and verdict.get("valid", True) is not False
            and finite_number(verdict.get("value")) is not None)


def not_judged_reason(verdict: dict) -> str:
    """Why a verdict's figure is not taken: "invalid: <reason>", "no measurement" or "inconclusive: …"."""
    if verdict.get("valid", True) is False:
        return f"invalid: {verdict.get('invalid_reason') or 'no reason given'}"
    if finite_number(verdict.get("value")) is None:
        return "no measurement"
    return "inconclusive: its interval straddles the rule"


def same_place(a: dict, b: dict) -> bool:
    """Two rows (verdicts, measurements) at the same place: every place key agrees (absent on both counts)."""
    here, there = a.get("context") or {}, b.get("context") or {}
    return all(here.get(key) == there.get(key) for key in PLACE_KEYS)


def verdicts_of(verdicts: Iterable[dict], metric: str) -> list[dict]:
    return [v for v in verdicts if v.get("metric") == metric]


def judged_rows(rows: Iterable[dict], verdicts: Iterable[dict]) -> list[dict]:
    """The measurement `rows` that a judged verdict of their metric stands at (same place)."""
    found = [v for v in verdicts if judged(v)]
    return [row for row in rows
            if any(v.get("metric") == row.get("metric") and same_place(v, row) for v in found)]


def first_not_judged(verdicts: Iterable[dict]) -> Optional[str]:
    """The reason the first unjudged verdict gives (invalid ones first: the cause a reader must see), or None."""
    rows = [v for v in verdicts if not judged(v)]
    rows.sort(key=lambda v: v.get("valid", True) is not False)
    return not_judged_reason(rows[0]) if rows else None


LEVEL_KEYS = ("concurrency", "multiplier")


def _in_step(step: dict, row: dict) -> bool:
    """Whether measurement `row` comes from G3 step `step` (a `step_valid` row): same level, and same target
    when the row names one (a figure of both targets, like a reduction, comes from each target's step)."""
    here, there = row.get("context") or {}, step.get("context") or {}
    levels = [key for key in LEVEL_KEYS if key in here]
    return bool(levels) and all(here[key] == there.get(key) for key in levels) and (
        "target" not in here or here["target"] == there.get("target"))


def measurement_not_judged(row: dict, verdicts: Iterable[dict], measurements: Iterable[dict]) -> Optional[str]:
    """Why a measurement is not a judged figure (None when it is): the verdicts of its metric at its place were
    none of them judged, or a step it comes from was recorded invalid (`step_valid` False)."""
    here = [v for v in verdicts if v.get("metric") == row.get("metric") and same_place(v, row)]
    if here and not any(judged(v) for v in here):
        return first_not_judged(here)
    for step in measurements:
        if step.get("metric") == "step_valid" and step.get("value") is False and _in_step(step, row):
            return f"invalid: {(step.get('context') or {}).get('reasons') or 'no reason given'}"
    return None
