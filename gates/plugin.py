"""The gate pytest plugin: options, the run's context, and fixtures that record and judge.

Loaded by the root conftest.py. Gate suites (gates/g1_arrival, ...) are run by
`kvgate run` as `pytest gates/<suite> --kvgate-run-dir DIR --kvgate-gate gN`;
without those options the fixtures skip, so the project's own tests are not
affected. Each check is a test: it measures, `record`s its figures into the
run store, and asks `verdict` to judge them against the configured rule,
which appends the verdict and fails the test on FAIL or INCONCLUSIVE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from .config import GatesConfig, load_config
from .runstore import RunStore
from .targets import Endpoint, endpoints_from_json
from .verdict import judge, parse_rule

RUN_DIR = pytest.StashKey[Path]()


@dataclass
class GateContext:
    gate: str
    config: GatesConfig
    store: RunStore
    endpoints: dict[str, Endpoint]

    def rule(self, metric: str) -> Optional[dict]:
        for rule in getattr(self.config, self.gate).thresholds:
            if rule.metric == metric:
                return rule.as_dict()
        return None


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
    """verdict(label, metric, value, rule=None, **judge_options): judge, store, and fail the test unless PASS.

    The rule is the configured threshold for the metric unless the check passes its own
    (inventory expectations, for example).

    A metric with no configured rule is recorded as unjudged and the test is skipped with that reason.
    """

    def _verdict(label: str, metric: str, value: Any, rule: Optional[dict] = None, **options: Any) -> dict:
        rule = rule or gate_context.rule(metric)
        if rule is None:
            pytest.skip(f"{label}: no threshold configured for {metric!r} in {gate_context.gate}.thresholds")
        result = judge(gate_context.gate, _check_name(request), label, value, parse_rule(rule), **options).to_dict()
        result["metric"] = metric
        gate_context.store.add_verdict(result)
        if result["status"] != "PASS":
            pytest.fail(result["reason"], pytrace=False)
        return result

    return _verdict


@pytest.fixture(scope="session")
def endpoints(gate_context: GateContext) -> dict[str, Endpoint]:
    return gate_context.endpoints
