"""`kvgate plan`: every gate's figures predicted from the config (and a run's measurements when given),
each with the verdict it would get.

How the pieces fit (each module's docstring has its formula):

1. layout.py: KV bytes per token and per block of the model under test, and how many tokens each
   tier holds (device blocks; host and disk bytes ÷ block bytes);
2. sequences.py + replay.py: G3's workload as block keys (its prompts through the embedded chat
   template, 256-token blocks), primed as G3 primes it (every session's first turn), then one pass,
   replayed through the candidate's tiers and through the baseline's device tier alone, with the
   cache's own placement rules: hits per tier, request by request, and the infinite-cache bound;
3. timing.py: TTFT of each request from its hits (fixed overhead + bytes ÷ each tier's GB/s + the
   recompute curve over the uncached tail); the curve, overheads and tier efficiencies come from a
   calibration (a run's G2, `calibration.py`); the disk's raw GB/s from the run's G1 fio, else the
   spec sheet (g1's seq_read_gbps threshold). G2's disk-hit / recompute ratio and cold-read ratio;
4. queueing.py: G3 per level, a step-level simulation of the engine's scheduler in a closed loop:
   each target's TTFT p50 and throughput, hence the reduction and the gain;
5. model load and checkpoint seconds: bytes ÷ (fio's GB/s × the measured efficiency).

A figure whose inputs are missing is left out with a note saying what it needs. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from kvcore.claims import format_figure
from kvcore.predictions import IN_MAPE, error as prediction_error, same_place
from kvcore.rundata import RunStore
from kvcore.settings import parse_size

from ..verdict import judge
from .calibration import Calibration
from .layout import KVShape
from .queueing import DecodeCost, EngineModel, ServedRequest, predict_g3
from .replay import TierCapacity, replay, tier_capacities
from .sequences import embedded_chat_tokens, load_order, workload_block_keys
from .timing import TierBandwidths, checkpoint_seconds, cold_read_vs_fio, model_load_seconds, predict_g2

BLOCK_TOKENS = 256


@dataclass(frozen=True)
class Prediction:
    """One predicted figure, what it rests on, and the verdict the gate's rule would give it."""

    gate: str
    metric: str
    value: float
    unit: str
    label: str
    basis: str
    context: dict = field(default_factory=dict)
    status: str = ""            # PASS / FAIL / INCONCLUSIVE by the gate's rule ("" when the gate judges none)
    reason: str = ""

    def to_dict(self) -> dict:
        return {"gate": self.gate, "metric": self.metric, "value": self.value, "unit": self.unit,
                "label": self.label, "basis": self.basis, "context": dict(self.context), "status": self.status,
                "reason": self.reason}


@dataclass
class Plan:
    predictions: list[Prediction] = field(default_factory=list)
    figures: dict = field(default_factory=dict)      # layout, capacities, hit ratios: what the predictions use
    notes: list[str] = field(default_factory=list)
    comparison: list[dict] = field(default_factory=list)   # with a run: predicted beside measured (compare)
    accuracy: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"predictions": [p.to_dict() for p in self.predictions], "figures": self.figures,
                "notes": list(self.notes), "comparison": self.comparison, "accuracy": self.accuracy}



def _rule(config, gate: str, metric: str):
    """The gate's rule for a metric it judges (GatesConfig.rule); None for a figure it does not judge."""
    from ..checks import CHECKS

    return config.rule(gate, metric) if metric in {c.metric for c in CHECKS[gate]} else None


def _judged(config, prediction: Prediction) -> Prediction:
    rule = _rule(config, prediction.gate, prediction.metric)
    if rule is None:
        return prediction
    verdict = judge(prediction.gate, "plan", f"predicted {prediction.label}", prediction.value, rule,
                    unit=prediction.unit, context=prediction.context)
    return replace(prediction, status=verdict.status, reason=verdict.reason)


def _spec_disk_gbps(config) -> Optional[float]:
    rule = _rule(config, "g1", "seq_read_gbps")
    return getattr(rule, "value", None)


def _capacities(config, block_nbytes: int) -> dict[str, list[TierCapacity]]:
    """The candidate's tiers (tiered: device, host, disk) and the baseline's (device-only)."""
    from cache_impl.config import CacheConfig

    embedded = config.targets.embedded
    cache = CacheConfig.from_dict({"device_capacity_blocks": embedded.device_capacity_blocks,
                                   "host_capacity_bytes": embedded.host_capacity,
                                   "disk": {"path": "unused", "capacity_bytes": embedded.disk_capacity}})
    return {"candidate": tier_capacities(cache, block_nbytes),
            "baseline": [TierCapacity("device", embedded.device_capacity_blocks)]}


def _g3_requests(config, capacities: dict[str, list[TierCapacity]], seed: int = 0):
    """Each target's requests with their hits per tier: G3's primer (first turns), then one pass."""
    from workloads.datasets import ByteSizer, build_workload
    from workloads.sweep import primer

    workload = build_workload(config.g3.workload, ByteSizer(), seed)
    primed = primer(workload) if config.g3.prime else None
    warm = workload_block_keys(primed) if primed is not None else []
    keys = workload_block_keys(workload)
    order = load_order(workload)
    served, hits = {}, {}
    for role, tiers in capacities.items():
        result = replay(warm + keys, tiers, warmup=len(warm))
        hits[role] = {"per_tier": result.hit_ratio, "overall": result.overall_hit_ratio,
                      "infinite_cache_bound": result.infinite_cache_bound}
        served[role] = [ServedRequest(len(embedded_chat_tokens(request)), request.max_tokens,
                                      {tier: blocks * BLOCK_TOKENS for tier, blocks in zip(result.tiers, row) if blocks})
                        for request, row in zip(order, result.hits[len(warm):])]
    return served, hits


def make_plan(config, store: Optional[RunStore] = None, calibration: Optional[Calibration] = None,
              tolerances=None, in_run: bool = False) -> Plan:
    """The plan for `config` (a GatesConfig); `store`: a run whose G1/G2 figures refine it; `calibration`:
    fitted constants (default: fitted from `store` when given); `in_run`: made by `kvgate run` before a
    gate (its figures are compared later, so no comparison now)."""
    plan = Plan()
    embedded = config.targets.embedded
    shape = KVShape.from_preset(embedded.preset)
    block_nbytes = shape.bytes_per_block(BLOCK_TOKENS)
    capacities = _capacities(config, block_nbytes)
    plan.figures["layout"] = {"source": shape.source, "bytes_per_token": shape.bytes_per_token,
                              "bytes_per_block": block_nbytes}
    plan.figures["tiers"] = {role: {t.name: None if t.blocks is None else t.blocks * BLOCK_TOKENS for t in tiers}
                             for role, tiers in capacities.items()}
    if config.targets.kind != "embedded":
        plan.notes.append("targets.kind is external: the layout and capacities are the embedded preset's "
                          f"({embedded.preset}); the external engine's are not read yet")
    served, hits = _g3_requests(config, capacities)
    plan.figures["g3_hit_ratio"] = hits

    tiers = TierBandwidths.from_run(store, disk_gbps=_spec_disk_gbps(config)) if store is not None else \
        TierBandwidths(disk_gbps=_spec_disk_gbps(config))
    plan.figures["disk_gbps"] = {"value": tiers.disk_gbps,
                                 "source": "G1 fio seq_read_gbps" if store is not None and store.latest(
                                     "g1", "seq_read_gbps") else "the spec sheet (g1 seq_read_gbps threshold)"}
    if calibration is None and store is not None:
        from .calibration import calibrate

        calibration = calibrate(store.root, kv_bytes_per_token=shape.bytes_per_token)
    if calibration is not None:
        plan.notes.extend(calibration.notes)
    if calibration is None or calibration.curve is None:
        plan.notes.append("no TTFT figures: they need a recompute curve, from a run's G2 (--from RUN_DIR) or a "
                          "calibration file (--calibration FILE)")
    else:
        tiers = calibration.tiers(tiers)
        timing = calibration.timing_model(tiers, shape.bytes_per_token, BLOCK_TOKENS)
        _g2(plan, config, timing, tiers)
        decode = calibration.decode
        if decode is None:
            decode = decode_from_curve(timing.curve, served["candidate"])
            plan.notes.append(f"G3's decode cost is estimated from G2's recompute curve ({decode.per_sequence_s * 1e3:.2f} ms "
                              "per sequence per step, no G3 ran yet to fit it): a lower bound, as a step's own "
                              "overheads are not in it, so G3's throughput is not predicted (its TTFT p50 rests on "
                              "prefill, which the curve does measure); a calibration from an earlier G3 gives both")
        _g3(plan, config, served, EngineModel(timing, decode, embedded.max_running), hits,
            throughput=calibration.decode is not None)
    _storage(plan, config, store, calibration, tiers)
    plan.predictions = [_judged(config, p) for p in plan.predictions]
    if store is not None and not in_run:
        compare(plan, store, tolerances or config.sizing)
        if calibration is not None and calibration.source and str(store.root) in calibration.source:
            plan.notes.append("the constants were fitted to this same run (G2's TTFTs and cold read, G3's gaps "
                              "between tokens): G2's figures are in-sample and G3's rest on its decode cost; only "
                              "the hit ratios owe it nothing. For an out-of-sample check: --calibration FILE from "
                              "another run")
    return plan


def decode_from_curve(curve, requests) -> DecodeCost:
    """A decode step's cost before any G3 has measured it: per generating sequence, one token's share of
    the recompute curve at the workload's mean context n, d/dn (b·n + c·n²) = b + 2·c·n (its linear work
    plus its attention over n earlier tokens); no per-step term (the weights are read once per step
    either way, which the curve's linear term already spreads over the prefill's tokens)."""
    n = sum(r.prompt_tokens for r in requests) / max(1, len(requests))
    return DecodeCost(0.0, curve.b + 2.0 * curve.c * n)


def _g2(plan: Plan, config, timing, tiers: TierBandwidths) -> None:
    rows = predict_g2(timing, config.g2.contexts)
    longest = rows[-1]
    plan.predictions.append(Prediction(
        "g2", "disk_hit_ttft_vs_recompute", longest.disk_hit_vs_recompute, "%",
        f"G2 cold disk hit / recompute at {longest.context_tokens} tokens",
        f"TTFT model: disk hit {longest.disk_hit_s * 1e3:.0f} ms, recompute {longest.recompute_s * 1e3:.0f} ms",
        {"context_tokens": longest.context_tokens}))
    if tiers.disk_gbps is not None:
        plan.predictions.append(Prediction(
            "g2", "cold_read_vs_fio", cold_read_vs_fio(tiers), "%", "G2 cold-read KV bandwidth / fio's",
            "the disk tier's efficiency (calibrated, else 1)"))


def _g3(plan: Plan, config, served: dict, engine: EngineModel, hits: dict, throughput: bool = True) -> None:
    if config.g3.replay != "closed_loop":
        plan.notes.append("no G3 figures: replay rate_multipliers is not modelled yet (closed_loop only)")
        return
    levels = predict_g3(served, config.g3.levels, engine, duration_s=config.g3.duration_s,
                        warmup_s=config.g3.warmup_s)
    basis = (f"replayed hit ratio {100 * hits['candidate']['overall']:.1f}% candidate / "
             f"{100 * hits['baseline']['overall']:.1f}% baseline; closed-loop step simulation")
    for role in ("baseline", "candidate"):
        for level in levels:
            plan.predictions.append(Prediction("g3", "hit_ratio", hits[role]["overall"], "%",
                                               f"G3 hit ratio of the {role} at c={level.concurrency}",
                                               "replay of the primed workload through its tiers",
                                               {"target": role, "concurrency": level.concurrency}))
    for level in levels:
        for role, figures in level.targets.items():
            at = {"target": role, "concurrency": level.concurrency}
            plan.predictions.append(Prediction("g3", "ttft_p50_ms", figures.ttft_p50_s * 1e3, "ms",
                                               f"G3 TTFT p50 of the {role} at c={level.concurrency}", basis, at))
            if throughput:
                plan.predictions.append(Prediction("g3", "output_tokens_per_s", figures.output_tokens_per_s,
                                                   "tokens/s", f"G3 throughput of the {role} at c={level.concurrency}",
                                                   basis, at))
    for level in levels:
        context = {"concurrency": level.concurrency}
        plan.predictions.append(Prediction("g3", "ttft_p50_reduction", level.ttft_p50_reduction, "%",
                                           f"G3 TTFT p50 reduction at c={level.concurrency}", basis, context))
        if throughput:
            plan.predictions.append(Prediction("g3", "throughput_gain", level.throughput_gain, "%",
                                               f"G3 throughput gain at c={level.concurrency}", basis, context))


def _storage(plan: Plan, config, store: Optional[RunStore], calibration: Optional[Calibration],
             tiers: TierBandwidths) -> None:
    """Model-load and checkpoint seconds (figures, not judged: their checks are ratios measured side by side)."""
    load = config.g2.model_load
    if load.enabled and tiers.disk_gbps is not None and load.path is None:
        efficiency = (calibration.best_loader_efficiency if calibration is not None else None) or 1.0
        plan.figures["model_load_s"] = {"value": model_load_seconds(parse_size(load.size), tiers.disk_gbps,
                                                                    efficiency),
                                        "basis": f"{load.size} at {tiers.disk_gbps:.2f} GB/s × {efficiency:.2f}"}
    checkpoint = config.g2.checkpoint
    measured = store.latest("g2", "checkpoint_write_vs_fio") if store is not None else None
    if checkpoint.enabled and measured is not None and calibration is not None and calibration.checkpoint_efficiency:
        nbytes = checkpoint.spec().total_bytes
        fio = float((measured.get("context") or {}).get("fio_gbps") or 0)
        if fio > 0:
            plan.figures["checkpoint_save_s"] = {
                "value": checkpoint_seconds(nbytes, fio, calibration.checkpoint_efficiency),
                "basis": f"{nbytes / 1e9:.2f} GB at G2's fio {fio:.2f} GB/s × {calibration.checkpoint_efficiency:.2f}"}


def render_text(plan: Plan) -> str:
    """The plan as the console shows it: one line per predicted figure with its verdict, then the notes."""
    lines = ["kvgate plan"]
    layout = plan.figures["layout"]
    lines.append(f"  KV layout {layout['source']}: {layout['bytes_per_token']:,} B per token, "
                 f"{layout['bytes_per_block']:,} B per {BLOCK_TOKENS}-token block")
    for role, tiers in plan.figures["tiers"].items():
        held = ", ".join(f"{name} {tokens:,}" if tokens is not None else f"{name} unbounded"
                         for name, tokens in tiers.items())
        lines.append(f"  {role} holds (tokens): {held}")
    for role, hit in plan.figures["g3_hit_ratio"].items():
        per_tier = ", ".join(f"{tier} {100 * ratio:.1f}%" for tier, ratio in hit["per_tier"].items())
        lines.append(f"  G3 workload, {role}: hit ratio {100 * hit['overall']:.1f}% ({per_tier}); "
                     f"infinite cache {100 * hit['infinite_cache_bound']:.1f}%")
    for prediction in plan.predictions:
        lines.append(f"  {prediction.status or 'figure':<12} {prediction.reason or prediction.label}  "
                     f"[{prediction.basis}]")
    for name, label in (("model_load_s", "model load"), ("checkpoint_save_s", "checkpoint save")):
        if name in plan.figures:
            figure = plan.figures[name]
            lines.append(f"  {label}: {figure['value']:.2f} s ({figure['basis']})")
    if plan.comparison:
        lines.append("  predicted vs measured:")
        for row in plan.comparison:
            lines.append(f"    {row['label']:<48} {format_figure(row['predicted'], row['unit']):>9} "
                         f"{format_figure(row['measured'], row['unit']):>9}  {row['error_text']}")
        for row in plan.accuracy:
            lines.append(f"  sizing {row['label']}: {row['text']}")
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


# The model judges itself as the BLIS simulator does: hit ratios within 5 points, TTFT and throughput
# figures within 15% (mean absolute percentage error); informational, never a gate.
HIT_RATIO_POINTS = 0.05
FIGURE_MAPE = 0.15


def _measured(rows: list[dict], prediction: Prediction) -> Optional[float]:
    """The last of the gate's measurement `rows` of the prediction's figure (kvcore.predictions.same_place)."""
    wanted = prediction.to_dict()
    for row in reversed(rows):
        if same_place(wanted, row):
            value = row.get("value")
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


def compare(plan: Plan, store: RunStore, tolerances=None) -> None:
    """Each prediction beside what the run measured, its error, and the model's accuracy by its tolerances
    (as the BLIS simulator judges itself): hit ratios, reductions and gains as differences in points;
    TTFTs, throughputs and G2's TTFT ratio as relative errors, whose mean (MAPE) is held to its limit."""
    rows, measurements = [], {}
    for prediction in plan.predictions:
        if prediction.gate not in measurements:          # each gate's measurements read once
            measurements[prediction.gate] = store.measurements(prediction.gate)
        measured = _measured(measurements[prediction.gate], prediction)
        if measured is None:
            continue
        error, text = prediction_error(prediction.metric, prediction.value, measured)
        rows.append({"gate": prediction.gate, "metric": prediction.metric, "label": prediction.label,
                     "context": dict(prediction.context), "unit": prediction.unit, "predicted": prediction.value,
                     "measured": measured, "error": error, "error_text": text})
    plan.comparison = rows
    hits = [abs(r["error"]) for r in rows if r["metric"] == "hit_ratio"]
    figures = [abs(r["error"]) for r in rows if r["metric"] in IN_MAPE]
    points = getattr(tolerances, "hit_ratio_points", HIT_RATIO_POINTS)
    mape_limit = getattr(tolerances, "figure_mape", FIGURE_MAPE)
    plan.accuracy = []
    if hits:
        worst = max(hits)
        plan.accuracy.append({"label": "hit ratio error", "value": worst, "limit": points,
                              "text": f"at most {100 * worst:.1f} points ({'within' if worst <= points else 'beyond'} "
                                      f"{100 * points:.0f})"})
    if figures:
        mape = sum(figures) / len(figures)
        plan.accuracy.append({"label": "TTFT / throughput MAPE", "value": mape, "limit": mape_limit,
                              "text": f"{100 * mape:.1f}% over {len(figures)} figures ({'within' if mape <= mape_limit else 'beyond'} "
                                      f"{100 * mape_limit:.0f}%)"})
