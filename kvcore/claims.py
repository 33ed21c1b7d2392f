"""The claims sheet: the vendor's figures as data (`claims:` in gates.yaml), each set beside what the run
measured and what the sizing model predicted, with a verdict: met, not met, or not measured (and why).

A claim names the run-store figure that tests it (`metric`, in `gate`), how that figure is read
(`read`: one measurement, or the lowest / highest over a gate's levels, or 1/x of it, e.g. a speed-up
over recompute is 1 / (disk-hit TTFT ÷ recompute TTFT)) and what the vendor promised: a band
`{min, max}` or a bound `{min}`. Met when the measured figure reaches the claim's lower edge (a figure
above a band is met, with a note: better than promised); not met below it. The measured figure comes
from the gate's judged verdicts only (PASS or FAIL, kvcore.judged): an INCONCLUSIVE one, invalid or
undecided, leaves the claim "not measured (invalid: <reason>)". Torch-free: it reads run data.

The defaults are the seed playbook's figures, with its source labels.
"""

from __future__ import annotations

import statistics
from typing import Literal, Optional

from pydantic import Field

from .judged import first_not_judged, judged, judged_rows, verdicts_of
from .predictions import format_figure, made_before
from .rundata import RunStore
from .settings import Float, StrictModel, load_yaml_file

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"
Read = Literal["last", "min", "max", "median", "inverse"]


class Claim(StrictModel):
    """One vendor figure and the measured figure that tests it."""

    id: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    label: str = Field(min_length=1, description="the claim as the vendor states it")
    source: str = Field(default="", description="where the vendor's figure comes from (e.g. R2 measured, 480B TP8)")
    gate: Literal["g1", "g2", "g3", "g4"]
    metric: str = Field(min_length=1, description="the run-store measurement that tests it")
    read: Read = Field(default="last", description="last, min / max / median over the gate's rows, inverse: 1/last")
    min: Optional[Float] = Field(default=None, description="the claim's lower edge (met at or above it)")
    max: Optional[Float] = Field(default=None, description="the claim's upper edge (a band); above it: met, note")
    unit: str = ""
    needs: str = Field(default="", description="what the measurement needs, said when it is absent")


def _claim(id: str, label: str, source: str, gate: str, metric: str, read: str = "last", unit: str = "",
           needs: str = "", **edges: float) -> dict:
    return {"id": id, "label": label, "source": source, "gate": gate, "metric": metric, "read": read, "unit": unit,
            "needs": needs, **edges}


DEFAULT_CLAIMS: tuple[dict, ...] = (
    _claim(
        "ttft_p50_reduction",
        "TTFT p50 −26–32% against the baseline",
        "R2 measured, 480B TP8",
        "g3",
        "ttft_p50_reduction",
        read="min",
        unit="%",
        min=0.26,
        max=0.32,
    ),
    _claim(
        "throughput_gain",
        "throughput +29–40% (c=8 +29%, c=16 +40%)",
        "R2 measured, 480B TP8",
        "g3",
        "throughput_gain",
        read="min",
        unit="%",
        min=0.29,
        max=0.40,
    ),
    # the figure a platform team buys on: how many more users at its SLO (G3's capacity search); the seed states
    # no capacity figure, so its throughput claim's low edge at an equal SLO stands for it
    _claim(
        "capacity_gain",
        "users served within the SLO: +29% or more (the throughput claim at an equal SLO)",
        "R2 measured, 480B TP8 (its throughput claim)",
        "g3",
        "capacity_gain",
        unit="%",
        min=0.29,
        needs="the capacity search (g3.capacity.enabled, and an slo)",
    ),
    _claim(
        "speedup_over_recompute",
        "a cache hit 8.6–20× faster than recompute",
        "seed playbook",
        "g2",
        "disk_hit_ttft_vs_recompute",
        read="inverse",
        unit="×",
        min=8.6,
        max=20.0,
    ),
    _claim(
        "cold_read_gbps",
        "cold-read bandwidth 0.98 → 5.23 GB/s with parallel reads",
        "seed playbook",
        "g2",
        "cold_read_vs_storage_best",
        read="last",
        unit="GB/s",
        min=5.23,
        needs="the disk tier's cold load (an embedded candidate)",
    ),
    _claim(
        "model_load_speedup",
        "model loading 1399 → 150 s (70B) and 691 → 112 s (32B) against NFS: 6.2–9.3×",
        "R9 measured, DeepSeek 32B/70B",
        "g2",
        "model_load_speedup_vs_baseline",
        unit="×",
        min=6.2,
        max=9.3,
        needs="a baseline storage path (g2.model_load.baseline_path)",
    ),
    _claim(
        "checkpoint_speedup",
        "checkpoint save 178 → 94 s: 1.9×",
        "R1 measured, 8-GPU 32B LoRA job",
        "g2",
        "checkpoint_speedup_vs_baseline",
        unit="×",
        min=1.9,
        needs="a baseline storage path (g2.checkpoint.baseline_path)",
    ),
    _claim(
        "checkpoint_write_gbps",
        "checkpoint sustained write 3.26 → 6.40 GB/s",
        "R1 measured, 8-GPU 32B LoRA job",
        "g2",
        "checkpoint_write_vs_storage_best",
        unit="GB/s",
        min=6.40,
        needs="checkpoint saves (g2.checkpoint)",
    ),
)

# claims whose figure is a measurement's context field, not its value (absolute GB/s beside a ratio)
_CONTEXT_FIELD = {"cold_read_vs_storage_best": "tier_gbps", "checkpoint_write_vs_storage_best": "save_gbps"}


def _figure(rows: list[dict], claim: Claim) -> Optional[float]:
    field = _CONTEXT_FIELD.get(claim.metric) if claim.unit == "GB/s" else None
    values = []
    for row in rows:
        value = (row.get("context") or {}).get(field) if field else row.get("value")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(float(value))
    if not values:
        return None
    if claim.read == "inverse":
        return 1.0 / values[-1] if values[-1] > 0 else None
    return {"last": values[-1], "min": min(values), "max": max(values),
            "median": statistics.median(values)}[claim.read]


def judge_claim(claim: Claim, measured: Optional[float], predicted: Optional[float] = None,
                why_not: str = "") -> dict:
    """One row of the claims table. `why_not`: why there is no measured figure (why_not_measured), the row's note."""
    row = {"id": claim.id, "claim": claim.label, "source": claim.source, "unit": claim.unit,
           "min": claim.min, "max": claim.max, "predicted": predicted, "measured": measured, "note": ""}
    if measured is None:
        return {**row, "verdict": NOT_MEASURED, "note": why_not or f"{claim.gate.upper()} measured no {claim.metric}"}
    if claim.min is not None and measured < claim.min:
        return {**row, "verdict": NOT_MET}
    if claim.max is not None and measured > claim.max:
        return {**row, "verdict": MET, "note": "above the claim: better than promised — check the measurement"}
    return {**row, "verdict": MET}


def why_not_measured(store: RunStore, claim: Claim, not_judged: Optional[str]) -> str:
    """Why the claim's figure is missing, from what the run stored, first match: its verdicts were not judged
    ("invalid: <reason>"), the check that judges it erred (its reason), it was not judged or not run (the unjudged
    row's reason: not applicable, no baseline path), the gate crashed storing no errored check, or did not run,
    else what the claim needs (a check that erred is not taken for the cause of another claim's absence)."""
    gate = claim.gate.upper()
    if not_judged:
        return f"{gate} {claim.metric}: {not_judged}"
    errors = store.errors(claim.gate)
    errored = next((e for e in errors if claim.metric in e.get("metrics", ())), None)
    if errored:
        return f"{gate} {errored['check']} errored: {errored['reason']}"
    unjudged = next((u for u in store.unjudged(claim.gate) if u.get("metric") == claim.metric), None)
    if unjudged:
        return f"{gate} {claim.metric}: {unjudged['reason']}"
    status = store.status(claim.gate) or {}
    if status.get("status") == "error" and not errors:
        return f"{gate} errored: {status.get('reason', '')}"
    if status.get("status") in (None, "not run"):
        if "pytest_exit_code" in status:      # its suite ran and judged nothing: no check applied
            return f"{gate}: {status.get('reason', '')}"
        reason = str(status.get("reason", ""))     # "not run: stopped at G2" says why
        said = f"{gate} {reason}" if reason.startswith("not run") else f"{gate} did not run"
        return said + (f"; it needs {claim.needs}" if claim.needs else "")
    return f"needs {claim.needs}" if claim.needs else ""


def claims_table(store: RunStore, claims: list[Claim]) -> list[dict]:
    """Every claim against the run's measurements, and against the sizing model's figures predicted before
    the claim's gate ran (predictions.jsonl, stage "before <gate>"), both read by the claim's own rule."""
    predictions = store.predictions()
    rows = []
    for claim in claims:
        measured, not_judged = _measured(store, claim)
        predicted = _figure([p for p in made_before(predictions, claim.gate) if p.get("metric") == claim.metric],
                            claim)
        why_not = why_not_measured(store, claim, not_judged) if measured is None else ""
        rows.append({**judge_claim(claim, measured, predicted, why_not), "path": judged_path(store, claim)})
    return rows


# the measurement context key that names the path a figure was judged through, and what it is
_PATH_KEYS = (("loader", "loader"), ("writer", "checkpoint writer"))


def judged_path(store: RunStore, claim: Claim) -> str:
    """The path the claim's figure was measured through ("the kvgate loader", "the dcp checkpoint writer"), from
    its latest measurement's context; "" when the figure names none."""
    rows = [m for m in store.measurements(claim.gate) if m.get("metric") == claim.metric]
    context = (rows[-1].get("context") or {}) if rows else {}
    for key, what in _PATH_KEYS:
        if isinstance(context.get(key), str) and context[key]:
            return f"the {context[key]} {what}"
    return ""


def _measured(store: RunStore, claim: Claim) -> tuple[Optional[float], Optional[str]]:
    """The claim's figure from the gate's judged verdicts only (kvcore.judged), or None and why not.

    A figure read over the gate's levels (min, max, median) needs every level judged: the lowest of the
    levels that were judged says nothing of one that was invalid. A context figure (GB/s beside a ratio)
    is read from the measurements at a judged verdict's place."""
    verdicts = verdicts_of(store.verdicts(claim.gate), claim.metric)
    if not verdicts:
        return None, None
    if claim.read in ("min", "max", "median") and not all(judged(v) for v in verdicts):
        return None, first_not_judged(verdicts)
    if _CONTEXT_FIELD.get(claim.metric) and claim.unit == "GB/s":
        rows = judged_rows([m for m in store.measurements(claim.gate) if m.get("metric") == claim.metric], verdicts)
    else:
        rows = [v for v in verdicts if judged(v)]
    figure = _figure(rows, claim)
    return figure, None if figure is not None else first_not_judged(verdicts)


def run_claims(store: RunStore) -> list[Claim]:
    """The claims a run was held to: its config.yaml's `claims:` (as resolved by the run), else the defaults."""
    path = store.root / "config.yaml"
    data = load_yaml_file(path, "config.yaml") if path.exists() else None
    claims = data.get("claims") if isinstance(data, dict) else None
    return [Claim(**c) for c in (claims if isinstance(claims, list) else DEFAULT_CLAIMS)]


def claim_text(row: dict) -> str:
    """The claim's promised figure: a band or a bound."""
    lo, hi, unit = row.get("min"), row.get("max"), row.get("unit", "")
    if lo is not None and hi is not None:
        return f"{format_figure(lo, unit)} – {format_figure(hi, unit)}"
    return f"≥ {format_figure(lo, unit)}" if lo is not None else ""
