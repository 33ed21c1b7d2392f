"""Rules as data, parsed in one place: a threshold `{metric, op, value}` or a band `{metric, min, max}`.

A rule is parsed once, where it is read: the config's thresholds at load (gates/config.py's
RuleField), the checks' defaults where they are declared (kvcore/checks.py), a rule the config
sets elsewhere built as a typed rule by the suite that reads it. From there the typed rule goes
down to the sampling (`kvcore.sequential.decides`) and the verdict (`kvcore.verdict.judge`, which
refuses anything else); the renderer reads a stored verdict's rule back with `stored_rule`. Error messages
name the rule's own field (`value: expected a finite number, found 'x'`), so the config's
error can prefix the rule's place (`g3.thresholds[1].value: …`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12),
}
SYMBOLS = {">=": "≥", "<=": "≤", ">": ">", "<": "<", "==": "="}


def _number(field: str, found: Any) -> float:
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
        raise ValueError(f"{field}: expected a finite number, found {found!r} ({type(found).__name__})")
    return float(found)


def _metric(found: Any) -> str:
    if not isinstance(found, str) or not found:
        raise ValueError(f"metric: expected a non-empty string, found {found!r}")
    return found


@dataclass(frozen=True)
class Threshold:
    """PASS when `figure op value` holds."""

    metric: str
    op: str
    value: float

    def __post_init__(self) -> None:
        _metric(self.metric)
        if self.op not in OPS:
            raise ValueError(f"op: expected one of {', '.join(OPS)}, found {self.op!r}")
        object.__setattr__(self, "value", _number("value", self.value))

    def to_dict(self) -> dict:
        return {"metric": self.metric, "op": self.op, "value": self.value}

    def passes(self, figure: float) -> bool:
        return OPS[self.op](figure, self.value)

    def straddles(self, lo: float, hi: float) -> bool:
        """Whether [lo, hi] holds both a figure that passes and one that fails."""
        if self.op == "==":
            return lo < hi and (lo <= self.value <= hi or self.passes(lo) or self.passes(hi))
        return self.passes(lo) != self.passes(hi)

    def text(self, number: Callable[[float], str] = str) -> str:
        return f"{SYMBOLS[self.op]} {number(self.value)}"


@dataclass(frozen=True)
class Band:
    """PASS when `min <= figure` (edges inclusive); above `max` still passes, with a note."""

    metric: str
    min: float
    max: float

    def __post_init__(self) -> None:
        _metric(self.metric)
        object.__setattr__(self, "min", _number("min", self.min))
        object.__setattr__(self, "max", _number("max", self.max))
        if self.min > self.max:
            raise ValueError(f"max: expected max >= min ({self.min:g}), found {self.max:g}")

    def to_dict(self) -> dict:
        return {"metric": self.metric, "min": self.min, "max": self.max}

    def straddles(self, lo: float, hi: float) -> bool:
        """Whether [lo, hi] straddles the edge that decides, the minimum (straddling the maximum still passes)."""
        return lo < self.min <= hi

    def text(self, number: Callable[[float], str] = str) -> str:
        return f"[{number(self.min)}, {number(self.max)}]"


Rule = Threshold | Band


def parse_rule(mapping: Any) -> Rule:
    """A Threshold from {metric, op, value} or a Band from {metric, min, max}; ValueError otherwise."""
    if isinstance(mapping, (Threshold, Band)):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ValueError(f"expected a mapping {{metric, op, value}} or {{metric, min, max}}, "
                         f"found {type(mapping).__name__}")
    keys = set(mapping)
    if keys == {"metric", "op", "value"}:
        return Threshold(metric=mapping["metric"], op=mapping["op"], value=mapping["value"])
    if keys == {"metric", "min", "max"}:
        return Band(metric=mapping["metric"], min=mapping["min"], max=mapping["max"])
    raise ValueError(f"expected keys {{metric, op, value}} (threshold) or {{metric, min, max}} (band), "
                     f"found {{{', '.join(sorted(map(str, keys)))}}}")


def stored_rule(mapping: Any) -> Optional[Rule]:
    """A rule read back from run data: the parsed rule, or None when the row holds none."""
    try:
        return parse_rule(mapping)
    except ValueError:
        return None
