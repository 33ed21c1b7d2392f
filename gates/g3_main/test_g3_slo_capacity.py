"""G3's capacity within the SLO: the most load each target serves with the SLO held, and the candidate's gain.

How it works: docs/methods/confidence-sequence.md (gates/g3_main/test_g3_slo_capacity.py).
"""

from __future__ import annotations

import math

import pytest

from kvcore.attainment import MEETS
from kvcore.capacity import USERS, capacity_gain, load_kind
from kvcore.g3_analysis import run_seed
from workloads.loadgen.capacity_probe import ProbeSettings, describe_probe, search_capacity, slo_of
from workloads.loadgen.sweep import RATE_USERS
from workloads.traffic.datasets import build_workload, sizer_for

ROLES = ("baseline", "candidate")


@pytest.fixture(scope="module")
def capacity(gate_context, endpoints):
    config = gate_context.config
    search = config.g3.capacity
    if not search.enabled:
        pytest.skip("g3.capacity.enabled is off: no capacity search (the full profile runs it; "
                    "examples/capacity/embedded.yaml on the embedded default)")
    aa = config.aa
    if "candidate" not in endpoints or ("baseline" not in endpoints and not aa):
        pytest.skip("the capacity search needs a baseline and a candidate endpoint (an A/A run: a candidate)")
    workload = build_workload(config.g3.workload, sizer_for(endpoints["candidate"].tokenizer),
                              seed=run_seed(gate_context.store.run_info().get("run_id", "run")))
    targets = [endpoints["candidate" if aa else role].target(role) for role in ROLES]
    slo = slo_of(config.slo)
    kind = load_kind(config.g3.replay)
    settings = ProbeSettings(search.probe_requests, search.probe_budget_s, search.confidence,
                             open_loop_users=None if kind is USERS else RATE_USERS)
    found = search_capacity(targets, workload, slo, settings, search.start, search.most,
                            gate_context.store.raw_dir("g3") / "capacity",
                            say=lambda text: gate_context.store.set_progress("g3", text),
                            unit=search.unit(config.g3.replay))
    return {"found": found, "slo": slo, "kind": kind}


def test_each_probe_and_each_targets_capacity_are_recorded(capacity, record):
    found, slo, kind = capacity["found"], capacity["slo"], capacity["kind"]
    limits = {"slo": slo.describe(), "ttft_limit_ms": slo.ttft_s * 1e3, "percentile": slo.percentile,
              "tpot_limit_ms": None if slo.tpot_s is None else slo.tpot_s * 1e3}
    for result in found.probes:
        record("capacity_probe", result.probe.decision == MEETS, **result.to_dict(), load_unit=kind.unit,
               line=describe_probe(result), **limits)
    for role in ROLES:
        search = found.searches[role]
        low, high = search.bounds()
        record(kind.metric, search.capacity, kind.unit, target=role, low=low,
               high=None if math.isinf(high) else high, closed=search.closed, probes=len(search.probes),
               line=search.describe(), slo=slo.describe())
    assert len(found.probes) == sum(len(s.probes) for s in found.searches.values())


def test_capacity_gain_within_the_slo(capacity, gate_context, record, verdict):
    found, slo = capacity["found"], capacity["slo"]
    baseline, candidate = found.searches["baseline"], found.searches["candidate"]
    estimate, least, most = capacity_gain(candidate, baseline)
    record("capacity_gain", estimate, "%", least=least, most=None if math.isinf(most) else most,
           closed=baseline.closed and candidate.closed)
    label = (f"G3 capacity within the SLO ({slo.describe()}): candidate {candidate.describe()}, baseline "
             f"{baseline.describe()}")
    context = {"target": "candidate", "bracket_closed": baseline.closed and candidate.closed}
    if baseline.low == 0:
        verdict(
            label,
            "capacity_gain",
            None,
            unit="%",
            valid=False,
            context=context,
            invalid_reason="the baseline met the SLO at no load searched: a lower g3.capacity.start or a looser slo",
        )
    elif math.isinf(most):
        # the candidate met the SLO at the most searched: its gain is at least `least`, which decides a PASS only
        rule = gate_context.rule("capacity_gain")
        verdict(f"{label}, at least", "capacity_gain", least, unit="%", context=context,
                valid=rule is not None and rule.passes(least),
                invalid_reason="the candidate met the SLO up to g3.capacity.most, so its gain is only bounded below, "
                               "and that bound does not clear the rule: search further")
    else:
        verdict(label, "capacity_gain", estimate, unit="%", interval=(least, most), context=context)
