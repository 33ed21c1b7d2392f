"""What a control's verdicts must be, and whether a run's `results.json` met it.

An expectation reads the run's typed results (its gates' verdict rows and the claims sheet's rows,
`reports/render.collect_results`), never a reason string. A control that produced no verdict of the
metric it tests proves nothing, and is WRONG: a gate that crashed or skipped the check cannot count
as "did not pass".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.percent import format_percent

PASS = "PASS"
MET = "met"


@dataclass(frozen=True)
class Finding:
    """What one expectation found: the verdict rows (or claim rows) it read, and the problem, if any."""

    expected: str
    rows: tuple[dict, ...]
    problem: str = ""
    kind: str = "verdict"        # what the rows are: "verdict" rows of the gates, or "claim" rows of the claims sheet

    @property
    def ok(self) -> bool:
        return not self.problem

    def got(self) -> list[str]:
        """Each row in words: 'ttft_p50_reduction c=2: FAIL 1.7% [1.2%, 2.1%]' or 'claim x: met 49.6%'."""
        return [format_claim(r) if self.kind == "claim" else format_verdict(r) for r in self.rows]


def invalid_steps(results: dict) -> list[dict]:
    """The G3 steps the run recorded as invalid (`step_valid` false), each {"step": "candidate c=2", "reasons": …}:
    a verdict that is INCONCLUSIVE for one of them may rest on the machine (a saturated client), not the control."""
    rows = [m for gate in results.get("gates") or [] for m in gate.get("measurements") or []
            if m.get("metric") == "step_valid" and m.get("value") is False]
    return [{"step": f"{(m.get('context') or {}).get('target')}{_level(m.get('context') or {})}",
             "reasons": (m.get("context") or {}).get("reasons", "")} for m in rows]


def verdict_rows(results: dict) -> list[dict]:
    """Every verdict row of every gate in a results.json."""
    return [v for gate in results.get("gates") or [] for v in gate.get("verdicts") or []]


# a metric's former names (issue 22 §1 renamed G2's cold-read ratio): a run of older gates is read under those
FORMER_NAMES: dict[str, tuple[str, ...]] = {"cold_read_vs_storage_best": ("cold_read_vs_fio",)}


def judged(results: dict, metric: str) -> list[dict]:
    """The verdicts of `metric`, else of the first of its former names the run judged."""
    rows = verdict_rows(results)
    for name in (metric, *FORMER_NAMES.get(metric, ())):
        found = [v for v in rows if v.get("metric") == name]
        if found:
            return found
    return []


@dataclass(frozen=True)
class MustNotPass:
    """No verdict of any of `metrics` may PASS (FAIL or INCONCLUSIVE); each must have at least one verdict."""

    metrics: tuple[str, ...]

    def describe(self) -> str:
        return "no PASS of " + ", ".join(self.metrics)

    def check(self, results: dict) -> Finding:
        found = {metric: judged(results, metric) for metric in self.metrics}
        rows = [v for verdicts in found.values() for v in verdicts]
        passed = [v for v in rows if v.get("status") == PASS]
        problem = _missing([m for m, verdicts in found.items() if not verdicts]) or (
            f"{len(passed)} PASS: " + ", ".join(_where(v) for v in passed) if passed else "")
        return Finding(self.describe(), tuple(rows), problem)


@dataclass(frozen=True)
class MustPass:
    """Every verdict of `metric` must PASS (a band's "above it: PASS with a note" included); at least one."""

    metric: str

    def describe(self) -> str:
        return f"PASS of {self.metric}"

    def check(self, results: dict) -> Finding:
        rows = judged(results, self.metric)
        others = [v for v in rows if v.get("status") != PASS]
        problem = _missing([self.metric] if not rows else []) or (
            ", ".join(f"{_where(v)} {v.get('status')}" for v in others) if others else "")
        return Finding(self.describe(), tuple(rows), problem)


@dataclass(frozen=True)
class MustFail:
    """Every verdict of `metric` must FAIL, decided: an INCONCLUSIVE is not a FAIL (the candidate's error rate at
    every level where it failed 40% of its requests; an A/A's compared verdicts at every level, as a null gain
    must be told from the claimed one); at least one."""

    metric: str

    def describe(self) -> str:
        return f"FAIL of {self.metric}"

    def check(self, results: dict) -> Finding:
        rows = judged(results, self.metric)
        others = [v for v in rows if v.get("status") != "FAIL"]
        problem = _missing([self.metric] if not rows else []) or (
            ", ".join(f"{_where(v)} {v.get('status')}" for v in others) if others else "")
        return Finding(self.describe(), tuple(rows), problem)


@dataclass(frozen=True)
class ClaimNotMet:
    """The claims sheet's row `claim_id` must not say "met" (not met, or not measured: invalid)."""

    claim_id: str

    def describe(self) -> str:
        return f"claim {self.claim_id} not met"

    def check(self, results: dict) -> Finding:
        rows = tuple(c for c in results.get("claims") or [] if c.get("id") == self.claim_id)
        if not rows:
            return Finding(self.describe(), rows, f"no claims row {self.claim_id!r}", "claim")
        met = [c for c in rows if c.get("verdict") == MET]
        problem = f"claim {self.claim_id} says met at {met[0].get('measured_text') or met[0].get('measured')}" \
            if met else ""
        return Finding(self.describe(), rows, problem, "claim")


Expectation = MustNotPass | MustPass | MustFail | ClaimNotMet

def _missing(metrics: list[str]) -> str:
    return "not judged: " + ", ".join(metrics) + " (the control proves nothing)" if metrics else ""


def _where(verdict: dict) -> str:
    """'ttft_p50_reduction c=2': a verdict's metric and its level, from its typed context."""
    return f"{verdict.get('metric')}{_level(verdict.get('context') or {})}"


def _level(context: dict) -> str:
    """' c=2' or ' 1.5x' from a row's typed context ('' when it names no level)."""
    return (f" c={context['concurrency']}" if "concurrency" in context else
            f" {context['multiplier']:g}x" if "multiplier" in context else "")


def format_verdict(verdict: dict) -> str:
    """'ttft_p50_reduction c=2: FAIL 1.7% [1.2%, 2.1%]' (the value and interval in the verdict's unit)."""
    value, interval, unit = verdict.get("value"), verdict.get("interval"), verdict.get("unit") or ""
    text = f"{_where(verdict)}: {verdict.get('status')}"
    if value is not None:
        text += " " + _number(value, unit)
    if interval:
        text += f" [{_number(interval[0], unit)}, {_number(interval[1], unit)}]"
    return text


def format_claim(claim: dict) -> str:
    """'claim ttft_p50_reduction: met 49.6%'."""
    measured = claim.get("measured_text") or ("" if claim.get("measured") is None else f"{claim['measured']:.3g}")
    return f"claim {claim.get('id')}: {claim.get('verdict')}" + (f" {measured}" if measured else "")


def _number(value: float, unit: str) -> str:
    if unit == "%":
        return format_percent(value)
    return f"{value:.3g}{unit if unit in ('×', 'x') else (' ' + unit if unit else '')}"
