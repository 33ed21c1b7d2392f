"""The gate pytest plugin: options, the run's context, and fixtures that record and judge.

Loaded by the root conftest.py. Gate suites (gates/g1_arrival, ...) are run by
`kvgate run` as `pytest gates/<suite> --kvgate-run-dir DIR --kvgate-gate gN`;
without those options the fixtures skip, so the project's own tests are not
affected. Each check is a test: it measures, `record`s its figures into the
run store, and asks `verdict` to judge them against the configured rule,
which appends the verdict and fails the test on FAIL or INCONCLUSIVE.

Only declared checks are judged (kvcore/checks.py). A check with no rule is stored as
measured-but-not-judged (the report lists it at the top of the gate's section) and its test
is skipped with that reason; a test that only recorded figures and judged nothing is
reported as skipped ("recorded only"), never counted as a passing check.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from engines import endpoint_adapter
from kvcore.checks import CHECKS, check_of
from kvcore.rules import Rule
from kvcore.rundata import Errored, RunStore, Unjudged
from kvcore.verdict import judge

from .config import GatesConfig, load_config
from .targets import Endpoint, endpoints_from_json

RUN_DIR = pytest.StashKey[Path]()
JUDGED = pytest.StashKey[int]()   # verdicts stored by the test now running
VERDICT_FAILED = pytest.StashKey[bool]()   # the test now running failed by its verdict (FAIL or INCONCLUSIVE)
RECORDED_ONLY = "recorded only: this test stores figures and judges nothing"


@dataclass
class GateContext:
    gate: str
    config: GatesConfig
    store: RunStore
    endpoints: dict[str, Endpoint]

    def rule(self, metric: str) -> Optional[Rule]:
        """The gate's configured threshold for a declared metric, else the check's default, else None."""
        return self.config.rule(self.gate, metric)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvgate", "kvgate gates")
    group.addoption("--kvgate-run-dir", default=None, help="the run directory (written by `kvgate run`)")
    group.addoption("--kvgate-gate", default=None, choices=["g1", "g2", "g3", "g4"], help="the gate being run")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gate(name): the gate a suite belongs to")
    run_dir = config.getoption("--kvgate-run-dir", default=None)
    if run_dir:
        config.stash[RUN_DIR] = Path(run_dir)


@pytest.fixture(scope="session")
def gate_context(request: pytest.FixtureRequest) -> GateContext:
    run_dir = request.config.stash.get(RUN_DIR, None)
    gate = request.config.getoption("--kvgate-gate")
    if run_dir is None or gate is None:
        pytest.skip("gate checks run through `kvgate run` (needs --kvgate-run-dir and --kvgate-gate)")
    store = RunStore(run_dir)
    config = load_config(run_dir / "config.yaml")
    return GateContext(gate, config, store, endpoints_from_json(store.run_info().get("targets", {})))


def _check_name(request: pytest.FixtureRequest) -> str:
    return request.node.name


@pytest.fixture
def record(gate_context: GateContext, request: pytest.FixtureRequest) -> Callable[..., dict]:
    """record(metric, value, unit="", **context): append one measurement of this check to the run store."""

    def _record(metric: str, value: Any, unit: str = "", **context: Any) -> dict:
        return gate_context.store.record(gate_context.gate, _check_name(request), metric, value, unit, **context)

    return _record


@pytest.fixture
def verdict(gate_context: GateContext, request: pytest.FixtureRequest) -> Callable[..., dict]:
    """verdict(label, metric, value, rule=None, context=None, unjudged_reason="", **judge_options):
    judge, store, and fail the test unless PASS.

    `metric` must be one of the gate's declared checks. The rule is the one the check's
    `rule_from` field gives (passed by the suite as `rule`, a typed kvcore.rules rule; None when that field is unset,
    with `unjudged_reason` saying so), else the configured threshold, else the check's
    default. With no rule the figure is stored as measured but not judged and the test skips.
    `context` says where the figure belongs (`concurrency`, `context_tokens`, `target`, …).
    """

    def _verdict(label: str, metric: str, value: Any, rule: Optional[Rule] = None,
                 context: Optional[dict] = None, unjudged_reason: str = "", **options: Any) -> dict:
        check = check_of(gate_context.gate, metric)
        if check.configurable:
            if rule is not None:
                raise TypeError(f"{metric}: its rule comes from {gate_context.gate}.thresholds or the check's "
                                "default (kvcore/checks.py), not from the suite")
            rule = gate_context.rule(metric)
        request.config.stash[JUDGED] = request.config.stash.get(JUDGED, 0) + 1  # judged, or said it is not
        if rule is None:
            reason = unjudged_reason or (f"no threshold for {metric!r} in {gate_context.gate}.thresholds and no "
                                         "default rule")
            gate_context.store.add_unjudged(Unjudged(
                gate_context.gate, _check_name(request), metric, label, reason,
                value=_number_or_none(value), unit=options.get("unit", ""), context=dict(context or {})))
            pytest.skip(f"{label}: measured, not judged: {reason}")
        result = judge(gate_context.gate, _check_name(request), label, value, rule, context=context,
                       **options)
        gate_context.store.add_verdict(result)
        if result.status != "PASS":
            request.config.stash[VERDICT_FAILED] = True
            pytest.fail(result.reason, pytrace=False)
        return result.to_dict()

    return _verdict


@pytest.fixture
def progress(gate_context: GateContext) -> Callable[[str], None]:
    """progress(text): say what the check is doing now (the console shows it while the gate runs)."""
    return lambda text: gate_context.store.set_progress(gate_context.gate, text)


@pytest.fixture
def not_run(gate_context: GateContext, request: pytest.FixtureRequest) -> Callable[..., None]:
    """not_run(label, metric, reason): a declared check whose input is not configured (e.g. no baseline
    path): stored as not judged with the reason, neither passing nor failing the gate; the test skips."""

    def _not_run(label: str, metric: str, reason: str) -> None:
        check_of(gate_context.gate, metric)
        request.config.stash[JUDGED] = request.config.stash.get(JUDGED, 0) + 1
        gate_context.store.add_unjudged(Unjudged(gate_context.gate, _check_name(request), metric, label,
                                                 f"not run: {reason}"))
        pytest.skip(f"{label}: not run: {reason}")

    return _not_run


def _number_or_none(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A gate test that passed without judging anything is reported as skipped (recorded only); one that
    erred outside its verdict is stored as errored."""
    if call.when == "setup":
        item.config.stash[JUDGED] = 0
        item.config.stash[VERDICT_FAILED] = False
    outcome = yield
    report = outcome.get_result()
    in_gate = RUN_DIR in item.config.stash and "gate_context" in getattr(item, "fixturenames", ())
    if call.when == "call" and in_gate and report.passed and not item.config.stash.get(JUDGED, 0):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, RECORDED_ONLY)
    by_verdict = call.when == "call" and item.config.stash.get(VERDICT_FAILED, False)
    gate = item.config.getoption("--kvgate-gate")
    if in_gate and gate and report.failed and call.excinfo is not None and not by_verdict:
        RunStore(item.config.stash[RUN_DIR]).add_error(
            Errored(gate, item.name, call.when, error_reason(call.excinfo), named_metrics(item, gate)))


def error_reason(excinfo: pytest.ExceptionInfo) -> str:
    """The exception in one line: a pytest.fail's message as written, else "TypeName: message" (its first line)."""
    error = excinfo.value
    text = str(error.msg) if isinstance(error, pytest.fail.Exception) else f"{excinfo.typename}: {error}"
    return next((line.strip() for line in text.splitlines() if line.strip()), excinfo.typename)


def named_metrics(item: pytest.Item, gate: str) -> tuple[str, ...]:
    """The gate's declared metrics a test's code names (a string in it, or a module global it reads holding one):
    what it would have judged, had it not erred."""
    function = getattr(item, "function", None)
    if function is None:
        return ()
    named: set[str] = set()
    codes = [function.__code__]
    while codes:                       # the test's code and the functions defined inside it
        code = codes.pop()
        named.update(c for c in code.co_consts if isinstance(c, str))
        named.update(v for v in map(function.__globals__.get, code.co_names) if isinstance(v, str))
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(c.metric for c in CHECKS[gate] if c.metric in named)


@pytest.fixture(scope="session")
def endpoints(gate_context: GateContext) -> dict[str, Endpoint]:
    return gate_context.endpoints


@pytest.fixture(scope="session")
def adapters(gate_context: GateContext) -> dict:
    """Each endpoint's engine adapter (engines/): how the gates control its cache and read its tiers' hits."""
    built = {role: endpoint_adapter(gate_context.config, e) for role, e in gate_context.endpoints.items()}
    for row in gate_context.store.preflight():          # what the pre-flight's probe found unavailable
        if row.get("abilities") and row.get("role") in built:
            built[row["role"]].restrict(row["abilities"])
    return built
