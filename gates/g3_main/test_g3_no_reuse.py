"""G3's no-reuse control: what offload costs under load when nothing is reused.

How it works: docs/methods/side-by-side.md (gates/g3_main/test_g3_no_reuse.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gates.no_reuse import reuse_found, unjudged_reason
from kvcore.g3_analysis import level_figures, run_seed
from kvcore.rundata import read_records
from workloads.loadgen.blocks import run_sweep, step_measured_records
from workloads.loadgen.sweep import SweepSettings
from workloads.traffic.datasets import build_workload, sizer_for

ROLES = ("baseline", "candidate")


@pytest.fixture(scope="module")
def control(gate_context, endpoints):
    """Each target's step of the control: {"summary": sweep row, "records": its measured ok records, "all": every
    record}."""
    g3 = gate_context.config.g3
    config = g3.no_reuse
    if not config.enabled:
        pytest.skip("g3.no_reuse.enabled is false")
    if gate_context.config.aa:
        pytest.skip("A/A run: the control weighs offload against none, and the candidate against itself has no "
                    "other side (its second step would also reuse the first's prompts)")
    missing = [role for role in ROLES if role not in endpoints]
    if missing:
        pytest.skip(f"the no-reuse control needs a candidate and a baseline endpoint; none for {missing}")
    run_id = str(gate_context.store.run_info().get("run_id", "run"))
    workload = build_workload(config.workload, sizer_for(endpoints["candidate"].tokenizer),
                              seed=run_seed(f"{run_id}/no-reuse"))
    duration = config.duration_s if config.duration_s is not None else g3.duration_s
    warmup = config.warmup_s if config.warmup_s is not None else g3.warmup_s
    settings = SweepSettings(levels=(config.level,), duration_s=duration, warmup_s=warmup,
                             min_duration_s=max(1.0, (duration - warmup) * 0.5), min_requests=g3.min_requests,
                             max_error_share=g3.max_error_share,
                             out_dir=gate_context.store.raw_dir("g3") / "no-reuse", send_once=True,
                             on_step=lambda text: gate_context.store.set_progress("g3", f"no-reuse control: {text}"),
                             on_live=lambda step: gate_context.store.set_progress(
                                 "g3", f"no-reuse control: {step.line()}", kind="live"))
    frame = run_sweep([endpoints[role].target(role) for role in ROLES], workload, settings)
    steps = {}
    for row in frame.to_dict("records"):
        records = [r for block in row["blocks"] for r in read_records(Path(block["step_dir"]) / "records")]
        in_window = step_measured_records(row)
        steps[row["target"]] = {"summary": row, "records": [r for r in in_window if r["ok"]], "all": records}
    return steps


def _figures(control):
    figures = level_figures(control["baseline"], control["candidate"])
    reused = reuse_found((role, r.get("cached_tokens") or 0, r.get("prompt_tokens") or 0)
                         for role in ROLES for r in control[role]["all"] if r["ok"])
    reasons = "; ".join(reason for reason in (figures.invalid_reason, reused) if reason)
    return figures, figures.valid and not reused, reasons


def _negated(interval):
    return None if interval is None else (-interval[1], -interval[0])


def test_offload_costs_little_in_ttft_under_load_when_nothing_is_reused(gate_context, control, record, verdict):
    level = gate_context.config.g3.no_reuse.level
    figures, valid, reasons = _figures(control)
    cost = None if figures.ttft_reduction is None else -figures.ttft_reduction
    for role in ROLES:
        summary = control[role]["summary"]
        record(
            "no_reuse_ttft_p50_ms",
            (summary["ttft_p50_s"] or 0) * 1e3,
            "ms",
            target=role,
            concurrency=level,
            requests=summary["requests"],
            cached_tokens=sum(r.get("cached_tokens") or 0 for r in control[role]["all"]),
        )
    record("no_reuse_ttft_cost", cost, "%", interval=_negated(figures.ttft_interval), concurrency=level)
    verdict(f"G3 no-reuse control: tiered TTFT p50 / baseline's − 1 at c={level}", "no_reuse_ttft_cost", cost,
            unit="%", interval=_negated(figures.ttft_interval), valid=valid, invalid_reason=reasons,
            unjudged_reason=unjudged_reason("g3", "no_reuse_ttft_cost"),
            context={"concurrency": level})


def test_offload_costs_little_in_throughput_under_load_when_nothing_is_reused(gate_context, control, record,
                                                                               verdict):
    level = gate_context.config.g3.no_reuse.level
    figures, valid, reasons = _figures(control)
    cost = None if figures.throughput_gain is None else -figures.throughput_gain
    for role in ROLES:
        record("no_reuse_output_tokens_per_s", control[role]["summary"]["output_tokens_per_s"], "tokens/s",
               target=role, concurrency=level)
    record("no_reuse_throughput_cost", cost, "%", interval=_negated(figures.throughput_interval), concurrency=level)
    verdict(f"G3 no-reuse control: 1 − tiered output throughput / baseline's at c={level}",
            "no_reuse_throughput_cost", cost, unit="%", interval=_negated(figures.throughput_interval), valid=valid,
            invalid_reason=reasons,
            unjudged_reason=unjudged_reason("g3", "no_reuse_throughput_cost"), context={"concurrency": level})
