"""`kvgate plan`: every gate's figures predicted from the config (and a run's measurements when given),
each with the verdict it would get.

How it works: docs/methods/sizing-model.md (sizing/plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from kvcore.capacity import USERS, load_kind
from kvcore.checks import CHECKS
from kvcore.judged import measurement_not_judged
from kvcore.percent import format_percent
from kvcore.predictions import IN_MAPE, format_figure, same_place
from kvcore.predictions import error as prediction_error
from kvcore.rundata import RunStore, finite_number, left_out_note
from kvcore.settings import ConfigError, parse_size
from kvcore.stats import bootstrap_ci
from kvcore.verdict import judge
from workloads.loadgen.capacity_probe import slo_of
from workloads.loadgen.sweep import RATE_USERS
from workloads.traffic.datasets import BYTE_TOKENIZER_ID as BYTE_SIZER
from workloads.traffic.datasets import build_workload, sizer_for

from .calibration import Calibration, calibrate
from .capacity import OpenLoop, predicted_capacity
from .g3_figures import predict_g3, predict_rate_ladder
from .g3_inputs import G3Replays, concurrencies, g3_replays, matched_blocks, simulate_blocks
from .machine import PROBE_SOURCES, load_costs
from .noise import group_spread, samples, spread
from .queueing import DecodeCost, EngineModel, Engines, engine_of
from .settings import SizedRun
from .targets import engine_facts, steady_block_tokens, target_inputs
from .timing import (
    TIERS,
    RecomputeCurve,
    TierBandwidths,
    TimingModel,
    checkpoint_seconds,
    cold_read_vs_storage_best,
    model_load_seconds,
    predict_g2,
)

ROLES = ("baseline", "candidate")       # G3's targets


@dataclass(frozen=True)
class Prediction:
    """One predicted figure, what it rests on, and the verdict the gate's rule would give it."""

    gate: str
    metric: str
    value: Optional[float]      # None: the figure has none (a sustained-rate gain where the baseline sustained none)
    unit: str
    label: str
    basis: str
    context: dict = field(default_factory=dict)
    status: str = ""            # PASS / FAIL / INCONCLUSIVE by the gate's rule ("" when the gate judges none)
    reason: str = ""
    interval: Optional[tuple[float, float]] = None   # 95% bootstrap interval over the simulated requests
    valid: bool = True          # False: the simulated step would be invalid in G3 (too few requests)
    invalid_reason: str = ""
    terms: tuple = ()           # a TTFT's terms: ({"term", "seconds", "source"}, ...) summing to its value

    def to_dict(self) -> dict:
        return {"gate": self.gate, "metric": self.metric, "value": self.value, "unit": self.unit,
                "label": self.label, "basis": self.basis, "context": dict(self.context), "status": self.status,
                "reason": self.reason, "interval": None if self.interval is None else list(self.interval),
                "valid": self.valid, "invalid_reason": self.invalid_reason, "terms": [dict(t) for t in self.terms]}


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



def _rule(config: SizedRun, gate: str, metric: str):
    """The gate's rule for a metric it judges (GatesConfig.rule); None for a figure it does not judge."""
    return config.rule(gate, metric) if metric in {c.metric for c in CHECKS[gate]} else None


def _judged(config: SizedRun, prediction: Prediction) -> Prediction:
    rule = _rule(config, prediction.gate, prediction.metric)
    if rule is None:
        return prediction
    verdict = judge(prediction.gate, "plan", f"predicted {prediction.label}", prediction.value, rule,
                    unit=prediction.unit, context=prediction.context, interval=prediction.interval,
                    valid=prediction.valid, invalid_reason=prediction.invalid_reason)
    return replace(prediction, status=verdict.status, reason=verdict.reason)


def _spec_disk_gbps(config: SizedRun) -> Optional[float]:
    """The spec sheet's sequential read (G1's threshold on it) as the disk's GB/s until G1 measures one; a
    threshold of 0 or less (which `kvgate run` takes as written) says nothing of the disk's speed: None."""
    value = getattr(_rule(config, "g1", "seq_read_gbps"), "value", None)
    return value if isinstance(value, (int, float)) and value > 0 else None


def make_plan(config: SizedRun, store: Optional[RunStore] = None, calibration: Optional[Calibration] = None,
              tolerances=None, in_run: bool = False, fill_from: Optional[Calibration] = None,
              engines: Optional[dict] = None, machine: Optional[Calibration] = None,
              probe: Optional[dict] = None) -> Plan:
    """The plan for `config` (a GatesConfig); `store`: a run whose G1/G2 figures refine it; `calibration`:
    fitted constants (default: fitted from `store` when given); `fill_from`: an earlier calibration whose
    constants stand in for those `calibration` lacks (a run's G3 decode cost before its G3 ran);
    `in_run`: made by `kvgate run` before a gate (its figures are compared later, so no comparison now);
    `engines`: what a run's pre-flight read from the external engines (default: `store`'s, when given);
    `machine`: the pre-flight's machine probe as constants (machine.py), last in line: what neither the
    calibration, `fill_from` nor a configured roofline gives; `probe`: the run's probes as recorded (default:
    `store`'s), whose load probe gives G3's decode cost where the probes give it (machine.load_costs: each target
    its own)."""
    plan = Plan()
    if engines is None and store is not None:
        engines = engine_facts(store.preflight())
    inputs, notes = target_inputs(config, engines)
    plan.notes.extend(notes)
    shape = inputs.shape
    capacities = inputs.capacities()
    plan.figures["layout"] = {"source": shape.source, "bytes_per_token": shape.bytes_per_token,
                              "bytes_per_block": inputs.block_nbytes, "block_tokens": inputs.block_tokens}
    plan.figures["tiers"] = {role: {t.name: None if t.blocks is None else t.blocks * inputs.block_tokens
                                    for t in tiers} for role, tiers in capacities.items()}
    plan.figures["fleet"] = {"candidate_nodes": inputs.candidate_nodes, "baseline_nodes": inputs.baseline_nodes,
                             "routing": inputs.routing, "pool": inputs.pool}
    workload = _g3_workload(config, inputs)
    g3 = g3_replays(config.g3, workload, inputs)
    plan.figures["g3_hit_ratio"] = g3.hits

    tiers = TierBandwidths.from_run(store, disk_gbps=_spec_disk_gbps(config), remote_gbps=inputs.pool_gbps) \
        if store is not None else TierBandwidths(disk_gbps=_spec_disk_gbps(config), remote_gbps=inputs.pool_gbps)
    plan.figures["disk_gbps"] = {"value": tiers.disk_gbps, "source": TierBandwidths.disk_source(store)}
    if calibration is None and store is not None:
        calibration = calibrate(store.root, kv_bytes_per_token=shape.bytes_per_token)
    if fill_from is not None:
        calibration = fill_from if calibration is None else calibration.filled_from(fill_from)
    if (calibration is None or calibration.curve is None) and config.sizing.roofline is not None:
        calibration = _with_roofline(calibration or Calibration(), config.sizing.roofline, shape.layers)
    if machine is not None:
        calibration = machine if calibration is None else _filled_from_machine(calibration, machine)
    if calibration is not None:
        plan.notes.extend(calibration.notes)
    if calibration is None or calibration.curve is None:
        plan.notes.append("no TTFT figures: they need a recompute curve, from a run's G2 (--from RUN_DIR), a "
                          "calibration file (--calibration FILE), a FLOPs roofline (sizing.roofline) or the "
                          "pre-flight's machine probe (kvgate run against the embedded targets)")
    else:
        tiers = calibration.tiers(tiers)
        timing = calibration.timing_model(tiers, shape.bytes_per_token, inputs.block_tokens)
        sources = term_sources(calibration, tiers, plan.figures["disk_gbps"]["source"])
        _g2(plan, config, timing, tiers, inputs, sources)
        if probe is None and store is not None:
            probe = store.machine_probe()
        engines = _g3_engines(plan, calibration, timing, probe, inputs, capacities, g3, sources)
        try:
            _g3(plan, config, workload, g3, engines, inputs, throughput=calibration.decode is not None)
        except ValueError as error:     # a simulation these costs cannot make must not take G2's figures with it
            plan.notes.append(f"G3 not predicted: its simulation with these costs failed ({error})")
    _storage(plan, config, store, calibration, tiers)
    plan.predictions = [_judged(config, p) for p in plan.predictions]
    if store is not None and not in_run:
        compare(plan, store, tolerances or config.sizing)
        if calibration is not None and calibration.fitted() and calibration.source and \
                str(store.root) in calibration.source:
            plan.notes.append("the constants were fitted to this same run (G2's TTFTs and cold read, G3's gaps "
                              "between tokens): G2's figures are in-sample and G3's rest on its decode cost; only "
                              "the hit ratios owe it nothing. For an out-of-sample check: --calibration FILE from "
                              "another run")
    damaged = left_out_note(store) if store is not None else None
    if damaged and damaged not in plan.notes:       # a plan refitted to the same store says it once
        plan.notes.append(damaged)
    return plan


def _g3_engines(plan: Plan, calibration: Calibration, timing: TimingModel, probe: Optional[dict], inputs,
                capacities: dict, g3: G3Replays, sources: dict[str, str]) -> dict[str, EngineModel]:
    """Each G3 target's engine: its decode cost and step noise (the calibration's; the load probe's where the probes
    gave them, machine.load_costs), the candidate's fixed cost under load (the load probe's), the engine's block copies
    and its prefill budget; the notes say where each came from."""
    decodes = {role: calibration.target_decode(role) for role in ROLES}
    timings = {role: timing for role in ROLES}
    stalls = dict.fromkeys(ROLES, 0.0)
    probed = calibration.source_of("decode") in PROBE_SOURCES
    if probe is not None and "server_load" in probe and (probed or calibration.decode is not None):
        # the probes' decode costs are refitted under load; a G3's (a calibration's) are kept, the fixed cost fitted
        lowest = capacities["candidate"][-1].name     # where the probe's cycle of returns comes back from
        under_load, words = load_costs(probe, timing, inputs.max_running, lowest if lowest in TIERS else "device",
                                       None if probed else {r: d for r, d in decodes.items() if d is not None},
                                       inputs.prefill_budget)
        # a target the probe did not load (a run recorded before it loaded the baseline) steps at the candidate's
        for role in ROLES:
            fitted = under_load.get(role) or under_load.get("candidate")
            if fitted is not None and probed:
                decodes[role] = fitted.decode
            if role in under_load:
                timings[role], stalls[role] = under_load[role].timing(timing), under_load[role].stall_s
        plan.notes.extend(words)
    fallback = decodes["candidate"]        # what a target with no decode cost of its own steps at
    if fallback is None:
        first = next(iter(g3.replays["candidate"].values()))
        fallback = decode_from_curve(timing.curve, first.requests)
        plan.notes.append(
            f"G3's decode cost is estimated from G2's recompute curve ({fallback.per_sequence_s * 1e3:.2f} ms "
            "per sequence per step, no G3 ran yet to fit it): a lower bound, as a step's own "
            "overheads are not in it, so G3's throughput is not predicted (its TTFT p50 rests on "
            "prefill, which the curve does measure); a calibration from an earlier G3 gives both"
        )
    copy_s = block_copy_seconds(timing) if inputs.embedded else 0.0
    if copy_s:
        plan.notes.append(f"G3's engine copies each block it stores, promotes or demotes into its cache's tiers "
                          f"on its own thread, {copy_s * 1e3:.2f} ms a block: the block's bytes at "
                          f"{sources['load host']}")
    return {role: EngineModel(timings[role], decodes[role] or fallback, inputs.max_running,
                              calibration.target_jitter(role) or 0.0, copy_s, inputs.prefill_budget, stalls[role])
            for role in ROLES}


def _g3_workload(config: SizedRun, inputs, seed: int = 0):
    """G3's workload built as G3 builds it for the target (the byte sizer for kvgate's engine, the word
    sizer for others)."""
    return build_workload(config.g3.workload, sizer_for(BYTE_SIZER if inputs.embedded else None), seed)


def _g3_median(config: SizedRun, figure) -> int:
    """The (lower) median of `figure(request)` over G3's workload as built for kvgate's engine."""
    values = sorted(figure(r) for r in build_workload(config.g3.workload, sizer_for(BYTE_SIZER), 0).requests)
    return values[(len(values) - 1) // 2]


def g3_decode_context(config: SizedRun) -> int:
    """Where G3's sequences decode: the median prompt (tokens) of its workload as built for kvgate's engine (the
    context the decode probe times the server's steps at, just before G3)."""
    return _g3_median(config, lambda r: r.prompt_tokens)


def g3_output_tokens(config: SizedRun) -> int:
    """The output tokens G3's requests ask for: the median of its workload's (the load probe asks for as many)."""
    return max(1, _g3_median(config, lambda r: r.max_tokens))


def g3_load_prompts(config: SizedRun, context_tokens: int) -> int:
    """How many prompts the load probe cycles through: at least twice G3's highest level, and more than the
    candidate's tiers above its lowest hold (each prompt of `context_tokens` and its answer's block), so that its
    returns come from the lowest tier as G3's mostly do (the tiers unknown, as an external engine's: the least)."""
    top = int(max(config.g3.levels))
    inputs, _ = target_inputs(config)
    held = [tier.blocks for tier in inputs.capacities()["candidate"][:-1]]
    least = 2 * top
    if not held or None in held:
        return least
    per_prompt = context_tokens // inputs.block_tokens + 1
    return max(least, sum(b or 0 for b in held) // per_prompt + 1)


def g3_decode_batch(config: SizedRun) -> int:
    """The decode probe's full batch: the most sequences the engine runs at once as the model takes it
    (sizing.target.max_running, else the embedded engine's), no more than G3's highest level sends."""
    given = getattr(config.sizing.target, "max_running", None)
    return max(1, min(int(given or config.targets.embedded.max_running), int(max(config.g3.levels))))


def _with_roofline(calibration: Calibration, roofline, layers: int) -> Calibration:
    """`calibration` with the configured FLOPs roofline as its recompute curve (timing.RecomputeCurve.roofline)
    and, unless it has one, the roofline's overhead as its fixed overhead."""
    curve = RecomputeCurve.roofline(roofline.params, roofline.layers or layers, roofline.attention_dim,
                                    roofline.device_tflops * 1e12, roofline.overhead_s)
    fixed = roofline.overhead_s if calibration.fixed_overhead_s is None else calibration.fixed_overhead_s
    return replace(calibration, curve=curve, fixed_overhead_s=fixed,
                   notes=(*calibration.notes, f"recompute from sizing.roofline ({curve.source}): "
                                              "no run has measured this engine's prefill yet"))


def _filled_from_machine(calibration: Calibration, machine: Calibration) -> Calibration:
    """`calibration` with what it lacks taken from the machine probe's constants, and the probe's figures said
    when any was taken."""
    filled = calibration.filled_from(machine)
    return filled if filled is calibration else replace(filled, notes=(*filled.notes, *machine.notes))


def decode_from_curve(curve, requests) -> DecodeCost:
    """A decode step's cost before any G3 has measured it: per generating sequence, one token's share of
    the recompute curve at the workload's mean context n, d/dn (b·n + c·n²) = b + 2·c·n (its linear work
    plus its attention over n earlier tokens); no per-step term (the weights are read once per step
    either way, which the curve's linear term already spreads over the prefill's tokens)."""
    n = sum(r.prompt_tokens for r in requests) / max(1, len(requests))
    return DecodeCost(0.0, curve.b + 2.0 * curve.c * n)


def block_copy_seconds(timing: TimingModel) -> float:
    """What kvgate's engine spends copying one block into a tier of its cache (a store, a promote after a hit, a
    demotion; cache_impl/cache/manager.py): the block's bytes at the host copy's GB/s, off the TTFT's path but
    on the engine's thread, so every request after it waits."""
    return timing.kv_bytes_per_token * timing.block_size / (timing.tiers.host_gbps * 1e9)


def term_sources(calibration: Calibration, tiers: TierBandwidths, disk_source: str) -> dict[str, str]:
    """Where each TTFT term's constant came from (timing.TimingModel.terms' names)."""
    curve = calibration.curve.source if calibration.curve is not None else "none"
    fixed = curve if calibration.fixed_overhead_s is None else (calibration.source_of("fixed_overhead_s")
                                                                 or "the calibration")
    host = "the pre-flight's machine probe (its host copy)" if calibration.host_gbps else \
        "the default memcpy rate (timing.DEFAULT_HOST_GBPS)"
    disk = disk_source + (f" × the tier's efficiency {tiers.efficiency['disk']:.2f} "
                          f"({calibration.source_of('tier_efficiency')})" if "disk" in tiers.efficiency else "")
    return {"fixed": fixed, "per-token": curve, "attention": curve, "load host": f"{tiers.host_gbps:.2f} GB/s: {host}",
            "load disk": f"{tiers.effective_gbps('disk'):.2f} GB/s: {disk}" if tiers.disk_gbps else "none"}


def _g2(plan: Plan, config: SizedRun, timing, tiers: TierBandwidths, inputs, sources: dict[str, str]) -> None:
    """G2's TTFT by context length for each mode the candidate has (each with its terms and their sources), its
    judged disk-hit ratio and cold-read ratio."""
    rows = predict_g2(timing, config.g2.contexts)
    disk = inputs.embedded or inputs.disk_bytes > 0
    modes: dict[str, tuple[Optional[str], str]] = {"recompute": (None, "the recompute curve")}
    if inputs.embedded or inputs.host_bytes > 0:
        modes["host-hit"] = ("host", f"every whole block from host at {tiers.host_gbps:.2f} GB/s")
    if disk and tiers.disk_gbps is not None:
        modes["disk-cold"] = ("disk", f"every whole block from disk at {tiers.effective_gbps('disk'):.2f} GB/s")
    for row in rows:
        for mode, (tier, how) in modes.items():
            terms = timing.terms(row.prompt_tokens, {tier: row.cached_tokens} if tier else {})
            plan.predictions.append(Prediction(
                "g2", "ttft_ms", sum(terms.values()) * 1e3, "ms", f"G2 TTFT {mode} at {row.context_tokens} tokens",
                f"TTFT model: {how}", {"mode": mode, "context_tokens": row.context_tokens},
                terms=tuple({"term": name, "seconds": value, "source": sources.get(name, "")}
                            for name, value in terms.items())))
    if not disk:
        plan.notes.append("G2's disk figures are not predicted: the candidate has no disk tier in the model (its "
                          "engine has none, or sizing.target.disk_capacity is not given)")
        return
    longest = rows[-1]
    if longest.disk_hit_s is None:      # the timing model's tiers (these) have no disk GB/s
        plan.notes.append("G2's disk figures are not predicted: no disk GB/s (no G1 fio, no g1 seq_read_gbps "
                          "threshold from the spec sheet)")
        return
    plan.predictions.append(Prediction(
        "g2", "disk_hit_ttft_vs_recompute", longest.disk_hit_vs_recompute, "%",
        f"G2 cold disk hit / recompute at {longest.context_tokens} tokens",
        f"TTFT model: disk hit {longest.disk_hit_s * 1e3:.0f} ms, recompute {longest.recompute_s * 1e3:.0f} ms",
        {"context_tokens": longest.context_tokens}))
    plan.predictions.append(
        Prediction(
            "g2",
            "cold_read_vs_storage_best",
            cold_read_vs_storage_best(tiers),
            "%",
            "G2 cold-read KV bandwidth / the storage's best read",
            "the disk tier's efficiency (calibrated, else 1)",
        )
    )


def _g3(plan: Plan, config: SizedRun, workload, g3: G3Replays, engines: Engines, inputs,
        throughput: bool = True) -> None:
    """G3's figures per level, each judged figure with G3's own interval over the simulated requests:
    interleaved sessions block by block as G3 runs them (each block's hits and nodes from the simulation,
    g3_inputs.BlockSource), a trace or sequential sessions from the replay made beforehand."""
    settings = config.g3
    closed = settings.replay == "closed_loop"
    hits = g3.hits
    seeds = tuple(range(config.sizing.runs))
    slo_ms = settings.ttft_slo_ms
    if matched_blocks(settings, workload, inputs):
        levels, live = simulate_blocks(settings, workload, inputs, engines, seeds, steady_block_tokens(config))
        hits = live
        plan.figures["g3_hit_ratio"] = hits
    elif closed:
        levels = predict_g3(g3.replays, concurrencies(settings), engines, duration_s=settings.duration_s,
                            warmup_s=settings.warmup_s, min_requests=settings.min_requests, seeds=seeds)
    else:
        if slo_ms is None:
            raise ConfigError("g3.ttft_slo_ms: expected the TTFT objective a sustained rate meets for replay: "
                              "rate_multipliers, found nothing")
        ladder = predict_rate_ladder(g3.replays, settings.levels, g3.arrivals_s, engines, RATE_USERS, slo_ms / 1e3,
                                     duration_s=settings.duration_s, warmup_s=settings.warmup_s,
                                     min_requests=settings.min_requests)
        levels = ladder.levels
    fleet = (f"; {inputs.candidate_nodes} candidate nodes ({inputs.routing}, pool {inputs.pool}) and "
             f"{inputs.baseline_nodes} baseline node(s)") if inputs.fleet else ""
    basis = (f"replayed hit ratio {format_percent(hits['candidate']['overall'])} candidate / "
             f"{format_percent(hits['baseline']['overall'])} baseline; "
             f"{'closed-loop' if closed else 'open-loop'} step simulation{fleet}")
    at = (lambda level: {"concurrency": level.concurrency}) if closed else (
        lambda level: {"multiplier": level.concurrency})
    name = (lambda level: f"c={level.concurrency}") if closed else (
        lambda level: f"{level.concurrency:g}x the trace's rate")
    for role in ("baseline", "candidate"):
        for level in levels:
            plan.predictions.append(Prediction("g3", "hit_ratio", hits[role]["per_level"][level.concurrency], "%",
                                               f"G3 hit ratio of the {role} at {name(level)}",
                                               "replay of the primed workload through its tiers",
                                               {"target": role, **at(level)}))
    for level in levels:
        for role, figures in level.targets.items():
            context = {"target": role, **at(level)}
            plan.predictions.append(Prediction("g3", "ttft_p50_ms", figures.ttft_p50_s * 1e3, "ms",
                                               f"G3 TTFT p50 of the {role} at {name(level)}", basis, context))
            if throughput:
                plan.predictions.append(Prediction("g3", "output_tokens_per_s", figures.output_tokens_per_s,
                                                   "tokens/s", f"G3 throughput of the {role} at {name(level)}",
                                                   basis, context))
    for level in levels:
        compared = level.g3
        plan.predictions.append(Prediction("g3", "ttft_p50_reduction", compared.ttft_reduction, "%",
                                           f"G3 TTFT p50 reduction at {name(level)}",
                                           basis + _runs(level.runs, "ttft_reduction"), at(level),
                                           interval=compared.ttft_interval, valid=compared.valid,
                                           invalid_reason=compared.invalid_reason))
        if throughput and closed:
            plan.predictions.append(Prediction("g3", "throughput_gain", compared.throughput_gain, "%",
                                               f"G3 throughput gain at {name(level)}",
                                               basis + _runs(level.runs, "throughput_gain"), at(level),
                                               interval=compared.throughput_interval, valid=compared.valid,
                                               invalid_reason=compared.invalid_reason))
    if throughput and not closed:
        sustained = ladder.sustained
        plan.predictions.append(Prediction(
            "g3", "sustained_rate_gain", sustained.gain, "%",
            f"G3 sustained rate gain (TTFT p90 ≤ {slo_ms:g} ms, "
            f"{', '.join(f'{m:g}x' for m in settings.levels)})",
            f"{basis}; sustained {_multiplier(sustained.baseline)} baseline, {_multiplier(sustained.candidate)} "
            "candidate", {},
            interval=sustained.interval, valid=sustained.valid, invalid_reason=sustained.invalid_reason))
    if settings.capacity.enabled and config.slo is not None:
        _capacity(plan, config, g3, engines, basis, seeds)
    if inputs.fleet and hits["candidate"]["pool_share"] is not None:
        plan.predictions.append(Prediction("g3", "cross_node_hit_ratio", hits["candidate"]["pool_share"], "%",
                                           "G3 cross-node hit ratio (the pool's share of the candidate's hit blocks)",
                                           f"fleet replay: {inputs.candidate_nodes} nodes, {inputs.routing}", {}))


def _capacity(plan: Plan, config: SizedRun, g3: G3Replays, engines: Engines, basis: str, seeds: tuple) -> None:
    """Each target's capacity within the SLO (sizing/capacity.py: G3's search over the simulation of its replay at
    the sweep's last level, the state its caches reach by the search; open loop, that level's trace part at
    multiples of its rate), and the candidate's gain."""
    search, slo, top = config.g3.capacity, slo_of(config.slo), max(config.g3.levels)
    kind = load_kind(config.g3.replay)
    open_loop = None if kind is USERS else OpenLoop([a * top for a in g3.arrivals_s[top]], RATE_USERS,
                                                    search.unit(config.g3.replay))
    found = {}
    for role in ROLES:
        replay = g3.replays[role][top]
        found[role] = predicted_capacity(replay, engine_of(engines, role), slo, search.start, search.most, seeds,
                                         open_loop)
        if found[role] is not None:
            plan.predictions.append(Prediction("g3", kind.metric, found[role], kind.unit,
                                               f"G3 capacity of the {role} within the SLO ({slo.describe()})",
                                               f"{basis}; the capacity search over the simulation",
                                               {"target": role}))
    if found["baseline"] and found["candidate"] is not None:
        plan.predictions.append(Prediction("g3", "capacity_gain", found["candidate"] / found["baseline"] - 1, "%",
                                           f"G3 capacity gain within the SLO ({slo.describe()})",
                                           f"{basis}; capacities {found['baseline']:g} baseline, "
                                           f"{found['candidate']:g} candidate", {"target": "candidate"}))


def _runs(runs, figure: str) -> str:
    """The spread of a combined figure over its simulated runs (none when there was one run)."""
    values = [getattr(run, figure) for run in runs if getattr(run, figure) is not None]
    if len(values) < 2:
        return ""
    return f"; {len(runs)} simulated runs: {100 * min(values):+.1f}% to {100 * max(values):+.1f}%"


def _multiplier(value: Optional[float]) -> str:
    return "no multiplier" if value is None else f"{value:g}x"


def _storage(plan: Plan, config: SizedRun, store: Optional[RunStore], calibration: Optional[Calibration],
             tiers: TierBandwidths) -> None:
    """Model-load and checkpoint seconds (figures, not judged: their checks are ratios measured side by side)."""
    load = config.g2.model_load
    if load.enabled and tiers.disk_gbps is not None and load.path is None:
        measured = calibration.loader_efficiency.get(load.judged) if calibration is not None else None
        efficiency = measured or 1.0
        source = "G2's side-by-side ratio" if measured else "not measured yet: the storage's best"
        plan.figures["model_load_s"] = {"value": model_load_seconds(parse_size(load.size), tiers.disk_gbps,
                                                                    efficiency),
                                        "loader": load.judged,
                                        "basis": f"{load.size} at {tiers.disk_gbps:.2f} GB/s × {efficiency:.2f}, "
                                                 f"the {load.judged} loader ({source})"}
    checkpoint = config.g2.checkpoint
    written = store.latest_figure("g2", "checkpoint_write_vs_storage_best") if store is not None else None
    if checkpoint.enabled and written is not None and calibration is not None and calibration.checkpoint_efficiency:
        nbytes = checkpoint.spec().total_bytes
        fio = float((written.get("context") or {}).get("fio_gbps") or 0)
        if fio > 0:
            plan.figures["checkpoint_save_s"] = {
                "value": checkpoint_seconds(nbytes, fio, calibration.checkpoint_efficiency),
                "writer": checkpoint.judged,
                "basis": f"{nbytes / 1e9:.2f} GB at G2's fio {fio:.2f} GB/s × {calibration.checkpoint_efficiency:.2f}, "
                         f"the {checkpoint.judged} writer"}


def render_text(plan: Plan) -> str:
    """The plan as the console shows it: one line per predicted figure with its verdict, then the notes."""
    lines = ["kvgate plan"]
    layout = plan.figures["layout"]
    lines.append(f"  KV layout {layout['source']}: {layout['bytes_per_token']:,} B per token, "
                 f"{layout['bytes_per_block']:,} B per {layout['block_tokens']}-token block")
    fleet = plan.figures.get("fleet") or {}
    if fleet.get("candidate_nodes", 1) > 1:
        lines.append(f"  fleet: {fleet['candidate_nodes']} candidate nodes on pool {fleet['pool']}, "
                     f"{fleet['baseline_nodes']} baseline node(s), routing {fleet['routing']}")
    for role, tiers in plan.figures["tiers"].items():
        held = ", ".join(f"{name} {tokens:,}" if tokens is not None else f"{name} unbounded"
                         for name, tokens in tiers.items())
        lines.append(f"  {role} holds (tokens): {held}")
    for role, hit in plan.figures["g3_hit_ratio"].items():
        per_tier = ", ".join(f"{tier} {format_percent(ratio)}" for tier, ratio in hit["per_tier"].items())
        pool = (
            "" if hit.get("pool_share") is None else f"; the pool's share of hits {format_percent(hit['pool_share'])}"
        )
        lines.append(f"  G3 workload, {role}: hit ratio {format_percent(hit['overall'])} ({per_tier}); "
                     f"infinite cache {format_percent(hit['infinite_cache_bound'])}{pool}")
    for prediction in plan.predictions:
        text = prediction.reason or (prediction.label if prediction.value is None else
                                     f"{prediction.label}: {format_figure(prediction.value, prediction.unit)}")
        lines.append(f"  {prediction.status or 'figure':<12} {text}  [{prediction.basis}]")
    for name, label in (("model_load_s", "model load"), ("checkpoint_save_s", "checkpoint save")):
        if name in plan.figures:
            figure = plan.figures[name]
            lines.append(f"  {label}: {figure['value']:.2f} s ({figure['basis']})")
    if plan.comparison:
        lines.append("  predicted vs measured:")
        lines += [f"    {line}" for line in comparison_lines(plan.comparison)]
        for row in plan.accuracy:
            lines.append(f"  sizing {row['label']}: {row['text']}")
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def comparison_lines(comparison: list[dict]) -> list[str]:
    """One line per compared figure: label, predicted, measured, error (`compare`'s rows), and the error by term
    where it was split (in_run.error_shares)."""
    return [f"{row['label']:<48} {format_figure(row['predicted'], row['unit']):>9} "
            f"{format_figure(row['measured'], row['unit']):>9}  {row['error_text']}"
            + (f"  ({row['terms_text']})" if row.get("terms_text") else "") for row in comparison]


# The model judges itself as the BLIS simulator does: hit ratios and reductions within 5 points, G3's throughputs
# (and, apart, its TTFT p50s) within 15% (mean absolute percentage error), G2's TTFTs within 10%; informational,
# never a gate.
HIT_RATIO_POINTS = 0.05
FIGURE_MAPE = 0.15
G2_TTFT_MAPE = 0.10
IN_POINTS_JUDGED = ("hit_ratio", "ttft_p50_reduction", "cross_node_hit_ratio")   # gains are judged by throughput
NOISE_SAMPLES = {"g2": "rounds", "g3": "blocks"}   # what a gate's figures are made of (sizing/noise.py)
MAPE_GROUPS = (("g2", "G2 TTFT MAPE", IN_MAPE), ("g3", "G3 throughput MAPE", ("output_tokens_per_s",)),
               ("g3", "G3 TTFT p50 MAPE", ("ttft_p50_ms",)))      # (gate, label, the metrics it averages)


def _measured(rows: list[dict], prediction: Prediction) -> Optional[dict]:
    """The last of the gate's measurement `rows` of the prediction's figure (kvcore.predictions.same_place),
    when it holds a number."""
    wanted = prediction.to_dict()
    for row in reversed(rows):
        if same_place(wanted, row):
            return row if finite_number(row.get("value")) is not None else None
    return None


def compare(plan: Plan, store: RunStore, tolerances=None) -> None:
    """Each prediction beside what the run measured, its error, and the model's accuracy by its tolerances
    (as the BLIS simulator judges itself): hit ratios, reductions and gains as differences in points;
    TTFTs, throughputs and G2's TTFT ratio as relative errors, whose mean (MAPE) is held to its limit."""
    rows, measurements, verdicts, not_compared = [], {}, {}, 0
    for prediction in plan.predictions:
        if prediction.gate not in measurements:          # each gate's rows read once
            measurements[prediction.gate] = store.measurements(prediction.gate)
            verdicts[prediction.gate] = store.verdicts(prediction.gate)
        found = _measured(measurements[prediction.gate], prediction)
        if found is None or prediction.value is None:
            continue
        if measurement_not_judged(found, verdicts[prediction.gate], measurements[prediction.gate]):
            not_compared += 1                            # an invalid step's figure: no error (kvcore.judged)
            continue
        measured = float(found["value"])
        error, text = prediction_error(prediction.metric, prediction.value, measured)
        own = samples(measurements[prediction.gate], prediction.to_dict())
        rows.append({"gate": prediction.gate, "metric": prediction.metric, "label": prediction.label,
                     "context": dict(prediction.context), "unit": prediction.unit, "predicted": prediction.value,
                     "measured": measured, "error": error, "error_text": text, "spread": spread(own, measured),
                     "interval": _interval((found.get("context") or {}).get("interval"))
                     or _median_interval(prediction, own)})
    plan.comparison = rows
    if not_compared:
        plan.notes.append(f"{not_compared} predicted figures not compared: measured in invalid steps or judged "
                          "INCONCLUSIVE (their errors would measure the failure, not the model)")
    plan.accuracy = accuracy(rows, tolerances)


def accuracy(rows: list[dict], tolerances=None) -> list[dict]:
    """The model's accuracy by gate, each against its own limit: G2's TTFTs (and its TTFT ratio) by their mean
    absolute percentage error, G3's throughputs by theirs and its targets' TTFT p50s by theirs (apart: a p50 of
    a few tens of ms moves by a third with which hit kind the median lands on, where the throughput, what a
    buyer sizes by, does not), G3's hit ratios and TTFT reductions by the largest error in points (its gains
    follow from its throughputs)."""
    limits = {"g2": getattr(tolerances, "g2_ttft_mape", G2_TTFT_MAPE),
              "g3": getattr(tolerances, "figure_mape", FIGURE_MAPE)}
    found = []
    for gate, label, metrics in MAPE_GROUPS:
        errors = [abs(r["error"]) for r in rows if r["gate"] == gate and r["metric"] in metrics
                  and math.isfinite(r["error"])]
        if errors:
            mape, limit = sum(errors) / len(errors), limits[gate]
            noise = group_spread([r for r in rows if r["gate"] == gate and r["metric"] in metrics])
            found.append({"label": label, "gate": gate, "value": mape, "limit": limit, "spread": noise,
                          "text": f"{format_percent(mape)} over {len(errors)} figures "
                                  f"({'within' if mape <= limit else 'beyond'} {format_percent(limit, 0)})"
                                  + ("" if noise is None else f"; the gate's own {NOISE_SAMPLES[gate]} lie "
                                     f"{format_percent(noise)} from their figures")
                                  + (_inside_intervals(rows, "ttft_ms") if gate == "g2" else "")})
    points = [r for r in rows if r["metric"] in IN_POINTS_JUDGED and math.isfinite(r["error"])]
    if points:
        limit = getattr(tolerances, "hit_ratio_points", HIT_RATIO_POINTS)
        worst = max(points, key=lambda r: abs(r["error"]))
        found.append({"label": "G3 hit ratio / TTFT reduction error", "gate": "g3", "value": abs(worst["error"]),
                      "limit": limit, "text": f"at most {100 * abs(worst['error']):.1f} points ({worst['label']}; "
                                              f"{'within' if abs(worst['error']) <= limit else 'beyond'} "
                                              f"{100 * limit:.0f})" + _inside_intervals(points)})
    return found


def _interval(value) -> Optional[tuple[float, float]]:
    """A measurement's interval (its context's "interval": [low, high]), None when it has none."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(finite_number(v) is not None for v in value):
        return float(value[0]), float(value[1])
    return None


def _median_interval(prediction: Prediction, own: list[float]) -> Optional[tuple[float, float]]:
    """A G2 TTFT's 95% interval: its median's, bootstrapped from its rounds (None for other figures, or under three
    rounds)."""
    if (prediction.gate, prediction.metric) != ("g2", "ttft_ms") or len(own) < MEDIAN_INTERVAL_ROUNDS:
        return None
    return bootstrap_ci(own, np.median)


# the figures whose predictions are set beside the gate's own 95% intervals: metric -> (what they are, the unit the
# widest interval is said in: a percent of a share, or the figure's own unit)
INTERVAL_FIGURES = {"ttft_p50_reduction": ("predicted reductions", "%"), "ttft_ms": ("predicted TTFTs", "ms")}
MEDIAN_INTERVAL_ROUNDS = 3


def _inside_intervals(rows: list[dict], metric: str = "ttft_p50_reduction") -> str:
    """How many of the figures of `metric` with an interval (G3's judged TTFT reductions, G2's TTFT medians over
    their rounds) have their prediction inside the gate's own 95% interval, and the widest: what the gate itself
    could tell apart (said, never judged)."""
    judged = [r for r in rows if r["metric"] == metric and r.get("interval") is not None]
    if not judged:
        return ""
    what, unit = INTERVAL_FIGURES[metric]
    inside = sum(r["interval"][0] <= r["predicted"] <= r["interval"][1] for r in judged)
    widest = max(judged, key=lambda r: (r["interval"][1] - r["interval"][0]) / (abs(r["measured"]) or 1.0))
    low, high = widest["interval"]
    span = f"{100 * low:.0f} to {100 * high:.0f}%" if unit == "%" else f"{low:.1f} to {high:.1f} {unit}"
    return (f"; {inside} of {len(judged)} {what} inside the gate's own 95% intervals (the widest, "
            f"{widest['label']}: {span})")
