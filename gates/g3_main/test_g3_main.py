"""G3 main gate: under a concurrency sweep the tiered candidate beats the baseline by the promised margin.

How it works: docs/methods/side-by-side.md (gates/g3_main/test_g3_main.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engines import hit_reader
from gates.fleet import fleet_sizing
from gates.g3_main.blocks import JUDGED_PER_LEVEL, excludes_null, level_sampler
from kvcore.aa import AA_FALSE_DECISION, false_decision_line
from kvcore.block_pairs import level_looks, level_pairs, pair_figures
from kvcore.g3_analysis import Ladder, due_latencies, goodput, run_seed, slo_latencies, sustained_rate_gain
from kvcore.predictions import prediction_for
from kvcore.rundata import read_records
from sizing.g3_inputs import g3_replays, primer_spared
from sizing.targets import steady_block_tokens, target_inputs
from workloads.loadgen.blocks import run_sweep, step_measured_records
from workloads.loadgen.sweep import SweepSettings, describe_replay, prime_targets
from workloads.probes.tier_hits import POOL_TIER, read_tier_hits, tier_shares
from workloads.traffic.datasets import build_workload, sizer_for
from workloads.traffic.errors import describe_errors


def predicted_ttft_p50_s(predictions: list[dict], roles: list[str], levels) -> dict[tuple[str, int], float]:
    """The sizing model's TTFT p50 (s) per (target, concurrency), as predicted before G3, for the live lines."""
    found = {}
    for role in roles:
        for level in levels:
            row = {"gate": "g3", "metric": "ttft_p50_ms", "context": {"target": role, "concurrency": level}}
            prediction = prediction_for(row, predictions)
            if prediction is not None and isinstance(prediction.get("value"), (int, float)):
                found[(role, level)] = prediction["value"] / 1e3
    return found


@pytest.fixture(scope="module")
def sweep(gate_context, endpoints, adapters):
    aa = gate_context.config.aa
    if "candidate" not in endpoints or ("baseline" not in endpoints and not aa):
        pytest.skip("G3 needs a baseline and a candidate endpoint (an A/A run: a candidate)")
    config = gate_context.config.g3
    embedded = endpoints["candidate"].admin
    workload = build_workload(config.workload, sizer_for(endpoints["candidate"].tokenizer),
                              seed=run_seed(gate_context.store.run_info().get("run_id", "run")))
    roles = ["baseline", "candidate"] + (["recompute"] if "recompute" in endpoints and not aa else [])
    serving = {role: "candidate" if aa else role for role in roles}   # A/A: the candidate serves the baseline role
    readers = {role: hit_reader(endpoints[serving[role]], adapters[serving[role]], gate_context.config)
               for role in roles}
    closed = config.replay == "closed_loop"
    settings = SweepSettings(levels=tuple(config.levels) if closed else (),
                             multipliers=() if closed else tuple(config.levels),
                             duration_s=config.duration_s, warmup_s=config.warmup_s,
                             min_duration_s=max(1.0, (config.duration_s - config.warmup_s) * 0.5),
                             min_requests=config.min_requests, max_error_share=config.max_error_share,
                             out_dir=gate_context.store.raw_dir("g3") / "sweep",
                             min_blocks=config.blocks.min, max_blocks=config.blocks.max,
                             level_budget_s=config.blocks.budget_s,
                             sample_level=level_sampler(gate_context.rule, closed),
                             on_step=lambda text: gate_context.store.set_progress("g3", text),
                             on_live=lambda step: gate_context.store.set_progress("g3", step.line(), kind="live"),
                             predicted_ttft_p50_s=predicted_ttft_p50_s(gate_context.store.predictions(), roles,
                                                                        config.levels if closed else ()),
                             tier_hits=lambda target: readers[target.name][0](),
                             tier_unit=readers["candidate"][1], matched=True, steady=config.steady.rule(),
                             block_tokens=steady_block_tokens(gate_context.config))
    targets = {role: endpoints[serving[role]].target(role) for role in roles}
    primer_users = min(config.levels) if closed else settings.rate_users
    # the recompute reference keeps no prefix (mode recompute), so priming it would only spend time; A/A: the
    # candidate serves the baseline role too and is primed once
    primed_roles = [role for role in roles if role != "recompute" and not (aa and role == "baseline")]
    spared = _primer_spared(gate_context.config, workload) if config.prime else {}
    primed = prime_targets([targets[role] for role in primed_roles], workload, primer_users, settings.out_dir,
                           on_step=settings.on_step,
                           spared={targets[role].name: spared.get(role, 0) for role in primed_roles}
                           ) if config.prime else []
    frame = run_sweep([targets["baseline"], targets["candidate"]], workload, settings,
                      references=[targets[role] for role in roles if role == "recompute"])
    steps = {"primed": primed, "replay": describe_replay(workload, settings, config.prime, primed),
             "embedded": embedded, "candidate_lacks": adapters["candidate"].absent_tiers(),
             "hit_ratio_bound": _workload_bound(gate_context.config, workload), "aa": aa}
    for row in frame.to_dict("records"):
        in_window = step_measured_records(row)  # every block's window, as the pooled summary's
        records = [r for block in row["blocks"] for r in read_records(Path(block["step_dir"]) / "records")]
        steps[(row["target"], row["level"])] = {"summary": row, "records": [r for r in in_window if r["ok"]],
                                                "all_records": records, "slo_latencies": slo_latencies(in_window)}
    return steps


FAR_BELOW_BOUND = 0.2      # a hit ratio this far below what the workload allows is a warning in the report


def endpoints_embedded(sweep) -> bool:
    return sweep["embedded"]


def _hit_ratio(summary: dict, tiers, records: list[dict], tokens: bool) -> tuple:
    """A step's hit ratio and where it comes from: the responses' cached tokens, else (an engine that returns none)
    the tier accounting's hit tokens over the step's prompt tokens."""
    if summary["hit_ratio"] is not None:
        return summary["hit_ratio"], "usage.prompt_tokens_details.cached_tokens"
    prompt = sum(r.get("prompt_tokens") or 0 for r in records if r["ok"])
    if tiers is None or not tokens or not prompt:
        return None, "neither cached tokens in the responses nor tier accounting"
    return sum(tiers.values()) / prompt, "the engine's tier accounting (its /metrics) over the step's prompt tokens"


def _workload_bound(config, workload) -> dict:
    """Per level, the hit ratio its requests allow: the blocks of its prompts an infinite cache would serve,
    primed as G3 primes, in G3's order (sizing/g3_inputs.py). A trace's level replays its own part, so
    each level has its own bound; a closed loop over a workload replays the same pass at every level, so the
    same bound is right at each. Empty when it cannot be worked out."""
    try:
        return dict(g3_replays(config.g3, workload, target_inputs(config)[0]).hits["candidate"]["bound_per_level"])
    except Exception:  # the bound is context for the report: never a reason for G3 to fail
        return {}


def _primer_spared(config, workload) -> dict:
    """Per target, the primer's first requests its caches would not keep (sizing/g3_inputs.py); none when that
    cannot be worked out: it only saves time, so it is never a reason for G3 to fail."""
    try:
        return primer_spared(config.g3, workload, target_inputs(config)[0])
    except Exception:
        return {}


def _levels(sweep) -> dict:
    return {key: step for key, step in sweep.items() if isinstance(key, tuple)}


def _closed_loop(gate_context) -> bool:
    return gate_context.config.g3.replay == "closed_loop"


def _at(gate_context, level) -> dict:
    """A level's context: its concurrency, or its rate multiplier."""
    return {"concurrency": level} if _closed_loop(gate_context) else {"multiplier": level}


def _label(gate_context, level) -> str:
    return f"c={level}" if _closed_loop(gate_context) else f"{level:g}x the trace's rate"


def test_the_replay_is_stated(sweep, gate_context, record):
    config = gate_context.config.g3
    record("replay", sweep["replay"], mode=config.replay, levels=list(config.levels), ttft_slo_ms=config.ttft_slo_ms)
    assert sweep["replay"]


def test_targets_were_primed_alike(sweep, gate_context, record):
    if not gate_context.config.g3.prime:
        pytest.skip("g3.prime is off: steps start from whatever each target holds")
    for row in sweep["primed"]:
        record("prime_requests", row["requests"], target=row["target"], errors=row["errors"],
               seconds=round(row["seconds"], 1), spared=row.get("spared", 0))
    incomplete = [f"{r['target']}: {r['requests'] - r['errors']} of {r['expected']} ok"
                  + (f" (errors: {r['error_summary']})" if r.get("error_summary") else "")
                  for r in sweep["primed"] if r["requests"] - r["errors"] != r["expected"]]
    assert not incomplete, "priming did not complete on every target: " + "; ".join(incomplete)


def _step(sweep, role, level):
    step = sweep.get((role, level))
    if step is None:
        pytest.fail(f"no {role} step at level {level}", pytrace=False)
    return step


def test_sweep_figures_per_target_and_level(sweep, gate_context, record):
    for (role, level), step in sorted(_levels(sweep).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s, at = step["summary"], _at(gate_context, level)
        for metric in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s"):
            if s.get(metric) is not None:
                record(metric[:-2] + "_ms", s[metric] * 1e3, "ms", target=role, **at)
        record("output_tokens_per_s", s["output_tokens_per_s"], "tokens/s", target=role, **at)
        record("requests_per_s", s["requests_per_s"], "req/s", target=role, **at)
        record("error_rate", s["error_rate"], target=role, **at)
        tiers = s.get("hit_blocks_by_tier")
        hit_ratio, source = _hit_ratio(s, tiers, step["all_records"], tokens=not endpoints_embedded(sweep))
        record("hit_ratio", hit_ratio, target=role, source=source, **at)
        unit = "blocks" if endpoints_embedded(sweep) else "tokens"
        for tier, share in tier_shares(tiers or {}).items():  # the pool's share (tier "remote") among them
            record("hit_tier_share", share, target=role, tier=tier, hits=tiers[tier], step_hits=sum(tiers.values()),
                   counted_in=unit, **at)
        bound = sweep["hit_ratio_bound"].get(level)     # this level's own part of the workload
        if bound is not None and hit_ratio is not None:
            record("hit_ratio_bound", bound, target=role, measured=hit_ratio,
                   far_below=bound - hit_ratio > FAR_BELOW_BOUND, far_below_points=FAR_BELOW_BOUND, **at)
        # where each block's raw records are and its measured window's start: the report draws the distributions
        blocks = [{"records_dir": os.path.relpath(Path(b["step_dir"]) / "records", gate_context.store.root),
                   "window_start": b["window_start"], "left_out_ids": b["left_out_ids"]} for b in s["blocks"]]
        record("step_valid", s["valid"], target=role, reasons=s["invalid_reasons"], blocks=blocks,
               due=s.get("due"), sent=s.get("sent"), finished=s.get("finished"), **at)
        for b in s["blocks"]:
            record("g3_block", None if b["ttft_p50_s"] is None else b["ttft_p50_s"] * 1e3, "ms", target=role,
                   block=b["block"], position=b["position"], started_at=b["started_at"],
                   first_sent_at=b["first_sent_at"], ttft_p50_ms=None if b["ttft_p50_s"] is None
                   else b["ttft_p50_s"] * 1e3, output_tokens_per_s=b["output_tokens_per_s"], requests=b["requests"],
                   valid=b["valid"], reasons=b["invalid_reasons"], left_out=b["left_out"], **at)
    assert _levels(sweep), "the sweep produced no steps"


def _judge_pairs(sweep, gate_context, record, verdict, level, metric: str, words: str) -> None:
    """Record and judge one figure of a level from its block pairs, saying how many blocks decided it and why
    sampling stopped (the interval's method in the record and the verdict's context)."""
    baseline = _step(sweep, "baseline", level)["summary"]
    pairs = level_pairs(baseline, _step(sweep, "candidate", level)["summary"])
    figures = pair_figures(pairs, level_looks(gate_context.config.g3.blocks.max))
    sampling, warm = baseline["sampling"], baseline["sampling"].get("warmup")
    differing = sum(row.get("left_out") or 0 for pair in pairs for row in pair)   # served by one block of a pair
    about = {**_at(gate_context, level), "blocks": sampling["pairs"], "decided": sampling["decided"],
             "stopped": sampling["why"], "pairs_used": figures.pairs, "pairs_left_out": figures.left_out,
             "left_out_reasons": figures.left_out_reasons, "method": figures.method,
             "warmup": None if warm is None else warm["line"], "requests_not_in_both": differing}
    value, interval = figures.value_of(metric), figures.interval_of(metric)
    record(metric, value, interval=interval, **about)
    after = ("" if warm is None else f", after {warm['pairs']} warm-up pair{'s' if warm['pairs'] != 1 else ''}"
             + ("" if warm["settled"] else " (not settled)"))
    differ = f", {differing} requests not served by both left out" if differing else ""
    verdict(f"G3 {words} at {_label(gate_context, level)} over {sampling['pairs']} blocks per target{after}{differ} "
            f"({sampling['why']})", metric, value, unit="%", interval=interval, valid=figures.valid,
            invalid_reason=figures.invalid_reason, context=about)


def test_each_level_is_measured_after_its_warm_up(sweep, gate_context, record):
    """Each level's warm-up pairs ran until the candidate's consecutive blocks agreed (g3.steady), and were left out:
    recorded with the candidate's blocks' figures that ended it (workloads/loadgen/steady.py)."""
    found = {}
    for (role, level), step in _levels(sweep).items():
        warm = step["summary"]["sampling"].get("warmup") if role == "candidate" else None
        if warm is not None:
            found[level] = warm
            record("g3_warmup_pairs", warm["pairs"], settled=warm["settled"], line=warm["line"], rule=warm["rule"],
                   **_at(gate_context, level))
            gate_context.store.set_progress("g3", f"{_label(gate_context, level)}: {warm['line']}")
    ran = [level for (role, level), step in _levels(sweep).items() if role == "candidate"
           and not step["summary"].get("not_run") and not step["summary"]["sampling"]["why"].startswith("stopped")]
    assert set(found) == set(ran), f"levels without a warm-up record: {sorted(set(ran) - set(found))}"


def test_ttft_p50_reduction_at_each_level(sweep, gate_context, record, verdict, level):
    _judge_pairs(sweep, gate_context, record, verdict, level, "ttft_p50_reduction", "TTFT p50 reduction")


def test_throughput_gain_at_each_level(sweep, gate_context, record, verdict, level):
    if not _closed_loop(gate_context):
        pytest.skip("replay: rate_multipliers offers both targets the same arrivals, so below saturation both serve "
                    "the offered rate: throughput is judged as sustained_rate_gain over the whole ladder")
    _judge_pairs(sweep, gate_context, record, verdict, level, "throughput_gain", "throughput gain")


def test_aa_counts_the_intervals_that_excluded_the_null(sweep, gate_context, record):
    """A/A: per judged check, whether its interval excluded 0 where nothing differs (a false decision)."""
    if not sweep["aa"]:
        pytest.skip("not an A/A run (aa: false)")
    for level in gate_context.config.g3.levels:
        figures = pair_figures(level_pairs(_step(sweep, "baseline", level)["summary"],
                                           _step(sweep, "candidate", level)["summary"]),
                               level_looks(gate_context.config.g3.blocks.max))
        for metric in JUDGED_PER_LEVEL[_closed_loop(gate_context)]:
            interval = figures.interval_of(metric)
            record(AA_FALSE_DECISION, None if interval is None else int(excludes_null(interval)), judged=metric,
                   interval=interval, value_measured=figures.value_of(metric), method=figures.method,
                   **_at(gate_context, level))
    line = false_decision_line(gate_context.store.measurements("g3"))
    gate_context.store.set_progress("g3", line)
    assert line is not None


def test_candidate_error_rate_at_each_level(sweep, gate_context, verdict, level):
    """The candidate's failed share of its measured requests at each level (kvcore/checks.py says why per level).

    Judged whatever made the step invalid (a step of failures is invalid for its latency figures and
    a FAIL here: INCONCLUSIVE never hides a 40% error rate); INCONCLUSIVE only when it measured nothing.
    """
    summary = _step(sweep, "candidate", level)["summary"]
    failed = summary["requests"] - summary["completed"]
    kinds = f"; the step's errors, warm-up included: {describe_errors(summary['errors_by_type'])}" \
        if summary["errors_by_type"] else ""
    verdict(f"G3 candidate error rate at {_label(gate_context, level)} ({failed} of {summary['requests']} measured "
            f"requests failed{kinds})", "error_rate", summary["error_rate"], unit="%",
            valid=summary["error_rate"] is not None, invalid_reason=summary["invalid_reasons"] or "no measured request",
            context={**_at(gate_context, level), "target": "candidate"})


def test_disk_tier_share_of_the_candidates_lower_tier_hits_at_each_level(sweep, gate_context, record, verdict,
                                                                          not_run, level):
    """Of the candidate's hits below the device tier (host, disk, the pool), the share its disk tier served: a main
    gate whose candidate never reads its storage tests DRAM (kvcore/checks.py)."""
    label = f"G3 disk tier's share of the candidate's lower-tier hits at {_label(gate_context, level)}"
    lacks = sweep["candidate_lacks"].get("disk")
    if lacks:       # as G2's placed hits: a tier the engine says it has not is not applicable, and says why
        not_run(label, "disk_hit_share", f"not applicable: the candidate has no disk tier ({lacks})")
    tiers = _step(sweep, "candidate", level)["summary"].get("hit_blocks_by_tier")
    if tiers is None:
        not_run(label, "disk_hit_share", "needs the candidate's hits per tier (kvgate serve's /metrics, or an "
                                         "engine adapter that reads them)")
    lower = {tier: count for tier, count in tiers.items() if tier != "device"}
    total = sum(lower.values())
    share = lower.get("disk", 0) / total if total else 0.0
    record("disk_hit_share", share, lower_tier_hits=lower, **_at(gate_context, level))
    others = ", ".join(f"{tier} {count:g}" for tier, count in lower.items() if tier != "disk")
    verdict(f"{label} ({lower.get('disk', 0):g} of {total:g} hit blocks below the device tier came from disk"
            f"{'; ' + others if others else ''})", "disk_hit_share", share, unit="%",
            context={**_at(gate_context, level), "target": "candidate"})


def test_sustained_rate_gain(sweep, gate_context, record, verdict):
    """Rate multipliers: the highest multiplier each target sustains within ttft_slo_ms, and the candidate's gain."""
    config = gate_context.config.g3
    if _closed_loop(gate_context):
        pytest.skip("replay: closed_loop judges throughput_gain at each concurrency")
    slo_s = config.ttft_slo_ms / 1e3
    ladders = {}
    for role in ("baseline", "candidate"):
        steps = []
        for m in config.levels:
            s = _step(sweep, role, m)
            latencies = due_latencies(s["slo_latencies"], s["summary"])   # every due request counts
            record("goodput", goodput(latencies, slo_s), "%", target=role, multiplier=m, ttft_slo_ms=config.ttft_slo_ms,
                   due=s["summary"]["due"], sent=s["summary"]["sent"], finished=s["summary"]["finished"])
            steps.append((m, bool(s["summary"]["valid"]), s["summary"]["invalid_reasons"], latencies))
        ladders[role] = Ladder(tuple(steps))
    figures = sustained_rate_gain(ladders["baseline"], ladders["candidate"], slo_s)
    for role, best in (("baseline", figures.baseline), ("candidate", figures.candidate)):
        record("sustained_multiplier", best, "x", target=role, ttft_slo_ms=config.ttft_slo_ms,
               censored=best == max(config.levels))
    record("sustained_rate_gain", figures.gain, interval=figures.interval, ttft_slo_ms=config.ttft_slo_ms)
    verdict(f"G3 sustained rate gain (TTFT p90 ≤ {config.ttft_slo_ms:g} ms, "
            f"{', '.join(f'{m:g}x' for m in config.levels)})", "sustained_rate_gain", figures.gain, unit="%",
            interval=figures.interval, valid=figures.valid, invalid_reason=figures.invalid_reason)


def test_per_node_figures_and_the_cross_node_hit_ratio(sweep, gate_context, endpoints, record):
    """With several candidate nodes: each node's share of the load, and how much reuse crossed nodes."""
    candidate = endpoints["candidate"]
    roots = candidate.node_roots
    if len(roots) < 2:
        pytest.skip("the candidate is one node")
    names = {url: f"node {i}" for i, url in enumerate(candidate.nodes)}
    for (role, level), step in sorted(_levels(sweep).items(), key=lambda kv: kv[0][1]):
        if role != "candidate":
            continue
        for url, name in names.items():
            served = [r for r in step["records"] if r.get("node") == url]
            record("node_requests", len(served), target=f"candidate {name}", **_at(gate_context, level))
            if served:  # under the same metric, so the TTFT plot draws a line per node
                record("ttft_p50_ms", float(np.median([r["ttft_s"] for r in served])) * 1e3, "ms",
                       target=f"candidate {name}", **_at(gate_context, level))
    hits = {name: read_tier_hits([root]) or {} for name, root in zip(names.values(), roots)}
    total = sum(sum(h.values()) for h in hits.values())
    remote = sum(h.get(POOL_TIER, 0) for h in hits.values())
    for name, by_tier in hits.items():
        record("node_hit_blocks", sum(by_tier.values()), target=f"candidate {name}", **by_tier)
    record("cross_node_hit_ratio", remote / total if total else None, routing=candidate.routing,
           remote_hit_blocks=remote, hit_blocks=total)
    assert total > 0, "no candidate node served a cache hit"


def test_the_fleet_is_sized_against_its_working_set(sweep, gate_context, record):
    """Several embedded nodes: the workload's working set beside each node's tiers and the pool (gates/fleet.py)."""
    sizing = fleet_sizing(gate_context.config)
    if sizing is None:
        pytest.skip("the candidate is one embedded node, or external")
    record("fleet_working_set_blocks", sizing.working_set_blocks, "blocks", nodes=sizing.nodes,
           node_share_blocks=sizing.node_share_blocks, block_bytes=sizing.block_nbytes,
           device_blocks=sizing.device_blocks, host_blocks=sizing.host_blocks, disk_blocks=sizing.disk_blocks,
           pool_blocks=sizing.pool_blocks, description=sizing.line())
    assert sizing.working_set_blocks > 0, "the G3 workload has no whole block to cache"


def test_speedup_against_recompute_is_reported(sweep, gate_context, record):
    levels = sorted({level for _, level in _levels(sweep)})
    if not any(role == "recompute" for role, _ in _levels(sweep)):
        pytest.skip("no recompute reference endpoint")
    for level in levels:
        rec, cand = sweep.get(("recompute", level)), sweep.get(("candidate", level))
        if rec and cand and cand["summary"]["ttft_p50_s"]:
            record("ttft_speedup_vs_recompute", rec["summary"]["ttft_p50_s"] / cand["summary"]["ttft_p50_s"],
                   **_at(gate_context, level))
    assert levels
