"""The sizing model inside `kvgate run`: before each gate, a plan from the config and what the gates before
it measured (G1's fio feeds G2's figures; G2's recompute curve and hit costs feed G3's) is recorded in the
run store and shown; before any G2, against the embedded targets, the run's probes (the machine's in the
pre-flight, the servers' just before the gate) stand in for the curve, the decode cost and the host copy
(machine.py: a calibration file still comes first); at the end, each gate's figures predicted before it ran
are set beside what it measured (sizing.json), with the model's accuracy by its own tolerances. Informational:
a prediction never passes or fails a gate, and a plan that cannot be made is a note, never a stop.
"""

from __future__ import annotations

from typing import Optional

from kvcore.rundata import RunStore

from .calibration import Calibration
from .machine import probe_ran, run_probe_calibration
from .plan import Plan, Prediction, compare, make_plan
from .settings import SizedRun
from .targets import engine_facts

PREDICTED_GATES = ("g2", "g3")   # the gates whose figures the sizing model predicts (plan.py)


def _plan_now(config: SizedRun, store: RunStore) -> Plan:
    """The plan from the config and what the run has measured so far (its own fits first, then a calibration
    file, then the run's probes of the machine and its servers)."""
    configured = None
    if config.sizing.calibration is not None:
        configured = Calibration.load(config.sizing.calibration)
    measured = any(store.status(g) is not None for g in ("g1", "g2", "g3", "g4"))
    # before G2 the file's constants; after it, the run's own first and the file's for the rest (G3's decode)
    calibration = configured if store.status("g2") is None else None
    return make_plan(
        config,
        store if measured else None,
        calibration,
        config.sizing,
        in_run=True,
        fill_from=configured,
        engines=engine_facts(store.preflight()),
        machine=run_probe_calibration(store),
        probe=store.machine_probe(),
    )


def stage_plan(config: SizedRun, store: RunStore, gate: str) -> tuple[Optional[Plan], str]:
    """The plan made before `gate` (recorded under "before <gate>"), or None and why not."""
    try:
        plan = _plan_now(config, store)
    except Exception as error:  # the sizing model must never stop a run: say why it said nothing
        return None, f"no plan before {gate.upper()}: {type(error).__name__}: {error}"
    store.add_predictions(f"before {gate}", [p.to_dict() for p in plan.predictions if p.gate == gate])
    return plan, ""


def gate_lines(plan: Plan, gate: str) -> list[str]:
    """One console line per figure predicted for `gate`, its verdict by the gate's rule."""
    return [p.reason for p in plan.predictions if p.gate == gate and p.status]


def final_sizing(store: RunStore, plan: Optional[Plan], config: SizedRun) -> dict:
    """Every gate's figures as predicted before it ran, beside what it measured, and the model's accuracy;
    each TTFT's terms with their sources and their shares of its error (`error_shares`); `plan`'s notes (the
    latest plan: what it could not predict, and why) go along."""
    stored = [r for r in store.predictions() if r.get("stage") == f"before {r.get('gate')}"]
    before = Plan(predictions=[Prediction(r["gate"], r["metric"], r["value"], r.get("unit", ""), r["label"],
                                          r.get("basis", ""), dict(r.get("context") or {}), r.get("status", ""),
                                          r.get("reason", ""), tuple(r["interval"]) if r.get("interval") else None,
                                          r.get("valid", True), r.get("invalid_reason", ""),
                                          tuple(r.get("terms") or ())) for r in stored])
    compare(before, store, config.sizing)
    for row in before.accuracy:
        row["sample"] = constants_sample(config, row["gate"], store.status("g2") is not None,
                                         probed=probe_ran(store.machine_probe()))
        row["text"] += f"; {row['sample']}"
    notes = list(plan.notes) if plan is not None else []
    notes += [note for note in before.notes if note not in notes]   # the comparison's own: what it left out, and why
    try:
        after = _plan_now(config, store)
    except Exception as error:  # informational: the shares are left out, the comparison stays
        after = None
        notes.append(f"no error shares: the constants refitted to this run failed ({type(error).__name__}: {error})")
    if after is not None:
        error_shares(before, after)
    return {"comparison": before.comparison, "accuracy": before.accuracy, "notes": notes}


def constants_sample(config: SizedRun, gate: str, g2_ran: bool = True, probed: bool = True) -> str:
    """Where the predictions of `gate` took their constants: in sample from this run's own probes of the embedded
    servers (`probed`) and, for G3 when G2 ran, its G2; out of sample when a calibration file, another run's, gave
    any of them."""
    file = config.sizing.calibration
    with_g2 = gate == "g3" and g2_ran
    if file is None:
        own = ["this run's probes of its servers"] if probed else []
        if with_g2:
            own.append("its G2" if own else "this run's G2")
        return "in sample: constants from " + (" and ".join(own) or "the config alone")
    if with_g2:
        return f"out of sample where this run's G2 fits none: those constants from {file}"
    return f"out of sample: constants from {file}"


def error_shares(before: Plan, after: Plan) -> None:
    """Each compared TTFT's error split over its terms: a term's share is what its constant, as predicted
    before the gate, puts beside the same term with the constants refitted to the run's own measurements
    (`after`); what is left when every constant is the run's own is the model's form ("form"). TTFT terms add
    up, so the shares add up to the error."""
    refitted = {(p.gate, p.metric, p.label): {t["term"]: t["seconds"] for t in p.terms} for p in after.predictions
                if p.terms}
    predicted = {(p.gate, p.metric, p.label): p.terms for p in before.predictions if p.terms}
    for row in before.comparison:
        key = (row["gate"], row["metric"], row["label"])
        terms, now = predicted.get(key), refitted.get(key)
        if not terms or now is None or row.get("unit") != "ms":
            continue
        error_s = (row["predicted"] - row["measured"]) / 1e3
        split = [{**term, "error_s": term["seconds"] - now.get(term["term"], 0.0)} for term in terms]
        split.append(
            {
                "term": "form",
                "seconds": None,
                "source": "what no constant explains: the run's own constants' prediction less the measurement",
                "error_s": sum(now.values()) - row["measured"] / 1e3,
            }
        )
        for term in split:
            term["share"] = term["error_s"] / error_s if error_s else None
        row["terms"] = split
        row["terms_text"] = "; ".join(f"{t['term']} {t['error_s'] * 1e3:+.1f} ms" for t in split)
