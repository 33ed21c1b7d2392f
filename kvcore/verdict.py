"""Verdicts: a figure judged against a rule from the config, with a one-line reason.

A rule is data: a threshold `{metric, op, value}` or a band `{metric, min, max}`.
`judge` yields PASS, FAIL or INCONCLUSIVE (the step was invalid, nothing was
measured, or the figure's interval straddles the edge that decides). Reasons read
like `G3 TTFT p50 reduction at c=16: 31.2% [27.9, 34.0] ≥ 25% → PASS`.
Percent figures are fractions (0.312 is shown as 31.2%).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from kvcore.percent import format_percent
from kvcore.rules import Band, Rule, Threshold, parse_rule
from kvcore.rundata import FAIL, INCONCLUSIVE, PASS, Verdict

__all__ = ["Band", "Threshold", "Verdict", "judge", "parse_rule", "PASS", "FAIL", "INCONCLUSIVE"]

ABOVE_BAND_NOTE = "above the band: better than promised — check the measurement"

def _trim(number: float, decimals: int) -> str:
    text = f"{number:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _significant(number: float, digits: int = 3) -> str:
    """`digits` significant digits without an exponent for ordinary magnitudes (1.21, 0.98, 1234)."""
    if number == 0 or not math.isfinite(number):
        return f"{number:g}"
    magnitude = math.floor(math.log10(abs(number)))
    if magnitude >= 6 or magnitude < -4:
        return f"{number:.{digits}g}"
    return _trim(number, max(0, digits - 1 - magnitude))


class _Format:
    """How numbers appear in a reason: the figure, the interval ends, the rule's numbers."""

    def __init__(self, unit: str, display: Optional[Callable[[float], str]], signed: bool) -> None:
        self.unit, self.display, self.signed = unit, display, signed

    def _percent(self, fraction: float, fixed: bool) -> str:
        return format_percent(fraction, 1 if fixed else 2, trim=not fixed, signed=self.signed, symbol=False)

    def value(self, number: float) -> str:
        if self.display is not None:
            return self.display(number)
        if self.unit == "%":
            return self._percent(number, fixed=True) + "%"
        return f"{_significant(number)} {self.unit}".rstrip()

    def rule(self, number: float) -> str:
        if self.display is not None:
            return self.display(number)
        if self.unit == "%":
            return self._percent(number, fixed=False) + "%"
        return self.value(number)

    def interval(self, interval: Optional[tuple[float, float]]) -> str:
        if interval is None:
            return ""
        if self.display is not None:
            ends = [self.display(x) for x in interval]
        elif self.unit == "%":
            ends = [self._percent(x, fixed=True) for x in interval]
        else:
            ends = [_significant(x) for x in interval]
        return f" [{ends[0]}, {ends[1]}]"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def judge(gate: str, check: str, label: str, value: Optional[float], rule: Rule, *,
          unit: str = "", interval: Optional[tuple[float, float]] = None, valid: bool = True,
          invalid_reason: str = "", display: Optional[Callable[[float], str]] = None,
          context: Optional[Mapping[str, Any]] = None) -> Verdict:
    """Judge one figure against its rule.

    INCONCLUSIVE when the step was invalid, when nothing was measured (None or NaN), or when
    the interval holds both a passing and a failing figure (a threshold; a band's min edge;
    straddling a band's max edge only adds a note). Otherwise PASS or FAIL from `value`.
    `display` formats a number with its unit; the default gives 3 significant digits and the
    unit, or a percent when unit == "%" (values are fractions). `rule` is a parsed rule (TypeError otherwise):
    rules are parsed once, at config load or in the check table, never again on the way to a verdict.
    """
    if not isinstance(rule, (Threshold, Band)):   # parsed once, where it is read: the config, the check table
        raise TypeError(f"rule: expected a parsed rule (kvcore.rules.parse_rule), found {type(rule).__name__}")
    is_band = isinstance(rule, Band)
    fmt = _Format(unit, display, signed=is_band)
    if value is not None:
        value = float(value)
        if math.isnan(value):
            value = None
    if interval is not None:
        lo, hi = (float(interval[0]), float(interval[1]))
        if math.isnan(lo) or math.isnan(hi):
            interval = None
        else:
            if lo > hi:
                raise ValueError(f"interval: expected lo <= hi, found [{lo}, {hi}]")
            interval = (lo, hi)

    rule_text = rule.text(fmt.rule)

    def verdict(status: str, reason: str, note: str = "") -> Verdict:
        return Verdict(gate=gate, check=check, metric=rule.metric, status=status, reason=_one_line(reason),
                       value=value, unit=unit, rule=rule.to_dict(), interval=interval, note=note,
                       context=dict(context or {}), valid=valid,
                       invalid_reason="" if valid else _one_line(invalid_reason or "no reason given"))

    invalid = f" (invalid step: {invalid_reason or 'no reason given'})" if not valid else ""
    if value is None:
        needs = f"in {rule_text}" if is_band else rule_text
        return verdict(INCONCLUSIVE, f"{label}: no measurement (needs {needs}) → INCONCLUSIVE{invalid}")

    figure = fmt.value(value) + fmt.interval(interval)
    if isinstance(rule, Band):
        place = "below" if value < rule.min else ("above" if value > rule.max else "in")
        head = f"{label}: {figure} {place} {rule_text}"
    else:
        head = f"{label}: {figure} {rule_text}"

    if not valid:
        return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE{invalid}")

    if isinstance(rule, Band):
        if interval is not None and rule.straddles(*interval):
            return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE (interval straddles the band's minimum)")
        if value < rule.min:
            return verdict(FAIL, f"{head} → FAIL")
        note = ""
        if value > rule.max:
            note = ABOVE_BAND_NOTE
        elif interval is not None and interval[1] > rule.max:
            note = "interval reaches above the band: may be better than promised — check the measurement"
        return verdict(PASS, f"{head} → PASS", note)

    if interval is not None and rule.straddles(*interval):
        return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE (interval straddles the threshold)")
    status = PASS if rule.passes(value) else FAIL
    return verdict(status, f"{head} → {status}")
