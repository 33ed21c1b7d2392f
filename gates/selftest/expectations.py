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
    kind: str = "verdict"        # what the rows are: "verdict" rows of the gates, "claim" rows of the claims sheet,
                                 # or "preflight" rows (results.json's pre-flight, one per node)

    @property
    def ok(self) -> bool:
        return not self.problem

    def got(self) -> list[str]:
        """Each row in words: 'ttft_p50_reduction c=2: FAIL 1.7% [1.2%, 2.1%]' or 'claim x: met 49.6%'."""
        format_row = {"claim": format_claim, "preflight": format_preflight}.get(self.kind, format_verdict)
        return [format_row(r) for r in self.rows]


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


# a metric's former names (G2's cold-read ratio was renamed): a run of older gates is read under those
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


@dataclass(frozen=True)
class RefusedAtPreflight:
    """The run must stop before measuring (`kvgate run` exits 2): the pre-flight refuses `role` with `error_type`,
    its problem naming `field` (the refusal's words are what a user acts on, so here they are the behaviour under
    test), and no gate judges anything. A candidate whose answers break the API is told at once, not after a
    sweep that could not read them."""

    role: str
    error_type: str
    field: str
    exit_code = 2

    def describe(self) -> str:
        return f"{self.role} refused at pre-flight ({self.error_type}, naming {self.field})"

    def check(self, results: dict) -> Finding:
        rows = tuple(r for r in results.get("preflight") or [] if r.get("role") == self.role)
        refused = [r for r in rows if not r.get("ok") and r.get("error_type") == self.error_type
                   and self.field in (r.get("problem") or "")]
        judged_rows = verdict_rows(results)
        problem = ("not refused: " + ("; ".join(f"{r.get('role')}: {r.get('problem') or 'ok'}" for r in rows)
                                      or f"no pre-flight row of {self.role}") if not refused else
                   f"{len(judged_rows)} verdicts after a refusal" if judged_rows else "")
        return Finding(self.describe(), rows, problem, "preflight")

    def accepts(self, exit_code: int | None) -> bool:
        return exit_code == self.exit_code


Expectation = MustNotPass | MustPass | MustFail | ClaimNotMet | RefusedAtPreflight


def run_completed(expectations: tuple[Expectation, ...], exit_code: int | None) -> bool:
    """Whether the run ended as the control's expectations need: exit 0 or 1 (a verdict), or 2 for a refusal."""
    refusals = [e for e in expectations if isinstance(e, RefusedAtPreflight)]
    return all(e.accepts(exit_code) for e in refusals) if refusals else exit_code in (0, 1)

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


def format_preflight(row: dict) -> str:
    """'pre-flight candidate: refused (bad_response: usage…)' or 'pre-flight candidate: ok'."""
    return f"pre-flight {row.get('role')}: " + (f"refused ({row.get('problem')})" if not row.get("ok") else "ok")


def _number(value: float, unit: str) -> str:
    if unit == "%":
        return format_percent(value)
    return f"{value:.3g}{unit if unit in ('×', 'x') else (' ' + unit if unit else '')}"
