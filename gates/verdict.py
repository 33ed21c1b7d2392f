"""Verdicts: a figure judged against a rule from the config, with a one-line reason.

A rule is data: a threshold `{metric, op, value}` or a band `{metric, min, max}`.
`judge` yields PASS, FAIL or INCONCLUSIVE (the step was invalid, nothing was
measured, or the figure's interval straddles the edge that decides). Reasons read
like `G3 TTFT p50 reduction at c=16: 31.2% [27.9, 34.0] ≥ 25% → PASS`.
Percent figures are fractions (0.312 is shown as 31.2%).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
STATUSES = (PASS, FAIL, INCONCLUSIVE)
ABOVE_BAND_NOTE = "above the band: better than promised — check the measurement"

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12),
}
_SYMBOLS = {">=": "≥", "<=": "≤", ">": ">", "<": "<", "==": "="}


def _number(kind: str, field: str, found: Any) -> float:
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
        raise ValueError(f"{kind}.{field}: expected a finite number, found {found!r} ({type(found).__name__})")
    return float(found)


def _metric(kind: str, found: Any) -> str:
    if not isinstance(found, str) or not found:
        raise ValueError(f"{kind}.metric: expected a non-empty string, found {found!r}")
    return found


@dataclass(frozen=True)
class Threshold:
    """PASS when `figure op value` holds."""

    metric: str
    op: str
    value: float

    def __post_init__(self) -> None:
        _metric("Threshold", self.metric)
        if self.op not in _OPS:
            raise ValueError(f"Threshold.op: expected one of {', '.join(_OPS)}, found {self.op!r}")
        object.__setattr__(self, "value", _number("Threshold", "value", self.value))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Threshold":
        return cls(metric=data.get("metric"), op=data.get("op"), value=data.get("value"))

    def to_dict(self) -> dict:
        return {"metric": self.metric, "op": self.op, "value": self.value}

    def passes(self, figure: float) -> bool:
        return _OPS[self.op](figure, self.value)


@dataclass(frozen=True)
class Band:
    """PASS when `min <= figure` (edges inclusive); above `max` still passes, with a note."""

    metric: str
    min: float
    max: float

    def __post_init__(self) -> None:
        _metric("Band", self.metric)
        object.__setattr__(self, "min", _number("Band", "min", self.min))
        object.__setattr__(self, "max", _number("Band", "max", self.max))
        if self.min > self.max:
            raise ValueError(f"Band.max: expected max >= min ({self.min}), found {self.max}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Band":
        return cls(metric=data.get("metric"), min=data.get("min"), max=data.get("max"))

    def to_dict(self) -> dict:
        return {"metric": self.metric, "min": self.min, "max": self.max}


Rule = Threshold | Band


def parse_rule(mapping: Mapping[str, Any]) -> Rule:
    """A Threshold from {metric, op, value} or a Band from {metric, min, max}; ValueError otherwise."""
    if isinstance(mapping, (Threshold, Band)):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ValueError(f"rule: expected a mapping {{metric, op, value}} or {{metric, min, max}}, "
                         f"found {type(mapping).__name__}")
    keys = set(mapping)
    if keys == {"metric", "op", "value"}:
        return Threshold.from_dict(mapping)
    if keys == {"metric", "min", "max"}:
        return Band.from_dict(mapping)
    raise ValueError(f"rule: expected keys {{metric, op, value}} (threshold) or {{metric, min, max}} (band), "
                     f"found {{{', '.join(sorted(map(str, keys)))}}}")


@dataclass(frozen=True)
class Verdict:
    """One judged check, as stored in `gates/<gate>/verdicts.jsonl` (see gates/runstore.py)."""

    gate: str
    check: str
    metric: str
    status: str
    reason: str
    value: Optional[float]
    unit: str
    rule: dict
    interval: Optional[tuple[float, float]] = None
    note: str = ""

    def to_dict(self) -> dict:
        row: dict[str, Any] = {"gate": self.gate, "check": self.check, "metric": self.metric,
                               "status": self.status, "reason": self.reason,
                               "value": None if self.value is None else float(self.value),
                               "unit": self.unit, "rule": dict(self.rule)}
        if self.interval is not None:
            row["interval"] = [float(self.interval[0]), float(self.interval[1])]
        if self.note:
            row["note"] = self.note
        return row

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        interval = data.get("interval")
        return cls(gate=data["gate"], check=data["check"], metric=data["metric"], status=data["status"],
                   reason=data["reason"], value=data.get("value"), unit=data.get("unit", ""),
                   rule=dict(data.get("rule", {})), interval=None if interval is None else tuple(interval),
                   note=data.get("note", ""))


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
        text = f"{100 * fraction:.1f}" if fixed else _trim(100 * fraction, 2)
        return ("+" + text) if self.signed and fraction >= 0 else text

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


def judge(gate: str, check: str, label: str, value: Optional[float], rule: Union[Rule, Mapping[str, Any]], *,
          unit: str = "", interval: Optional[tuple[float, float]] = None, valid: bool = True,
          invalid_reason: str = "", display: Optional[Callable[[float], str]] = None) -> Verdict:
    """Judge one figure against its rule.

    INCONCLUSIVE when the step was invalid, when nothing was measured (None or NaN), or when
    the interval holds both a passing and a failing figure (a threshold; a band's min edge;
    straddling a band's max edge only adds a note). Otherwise PASS or FAIL from `value`.
    `display` formats a number with its unit; the default gives 3 significant digits and the
    unit, or a percent when unit == "%" (values are fractions).
    """
    rule = parse_rule(rule)
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

    if is_band:
        rule_text = f"[{fmt.rule(rule.min)}, {fmt.rule(rule.max)}]"
    else:
        rule_text = f"{_SYMBOLS[rule.op]} {fmt.rule(rule.value)}"

    def verdict(status: str, reason: str, note: str = "") -> Verdict:
        return Verdict(gate=gate, check=check, metric=rule.metric, status=status, reason=_one_line(reason),
                       value=value, unit=unit, rule=rule.to_dict(), interval=interval, note=note)

    invalid = f" (invalid step: {invalid_reason or 'no reason given'})" if not valid else ""
    if value is None:
        needs = f"in {rule_text}" if is_band else rule_text
        return verdict(INCONCLUSIVE, f"{label}: no measurement (needs {needs}) → INCONCLUSIVE{invalid}")

    figure = fmt.value(value) + fmt.interval(interval)
    if is_band:
        place = "below" if value < rule.min else ("above" if value > rule.max else "in")
        head = f"{label}: {figure} {place} {rule_text}"
    else:
        head = f"{label}: {figure} {rule_text}"

    if not valid:
        return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE{invalid}")

    if is_band:
        if interval is not None and interval[0] < rule.min <= interval[1]:
            return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE (interval straddles the band's minimum)")
        if value < rule.min:
            return verdict(FAIL, f"{head} → FAIL")
        note = ""
        if value > rule.max:
            note = ABOVE_BAND_NOTE
        elif interval is not None and interval[1] > rule.max:
            note = "interval reaches above the band: may be better than promised — check the measurement"
        return verdict(PASS, f"{head} → PASS", note)

    if interval is not None and _straddles(rule, *interval):
        return verdict(INCONCLUSIVE, f"{head} → INCONCLUSIVE (interval straddles the threshold)")
    status = PASS if rule.passes(value) else FAIL
    return verdict(status, f"{head} → {status}")


def _straddles(rule: Threshold, lo: float, hi: float) -> bool:
    """Whether [lo, hi] holds both a figure that passes and one that fails."""
    if rule.op == "==":
        return lo < hi and (lo <= rule.value <= hi or rule.passes(lo) or rule.passes(hi))
    return rule.passes(lo) != rule.passes(hi)
