"""G2 single-node baseline: one request at a time, recompute vs a warm host hit vs a cold disk hit.

For each context length, `g2.rounds` rounds (more where they are short, within its budget): TTFT of the recompute
endpoint (a new prompt each round, else the candidate's own miss), and of the candidate with the prefix placed in
the host tier or only on disk with its pages dropped, through the candidate's engine adapter: by route where the
engine has one, else by pressure (gates/g2_baseline/placed_hits.py). The candidate computes and stores the prefix
once, at the first round (each round after it places the same prefix again: a round then costs the recompute and
the hits, not another miss); without a recompute endpoint its miss is the recompute figure, a new one each round.
Each hit is checked against the engine's tier accounting; a hit that cannot be checked, or a tier that cannot be
placed in, makes its checks INCONCLUSIVE naming what was missing. The disk tier's cold-read bandwidth is judged
against the storage's best read job (G1's sweep) in sequential pairs (gates/g2_baseline/cold_read.py); fio in the
tier's own pattern and G1's fio figure are shown beside it, never divide it.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import pytest

from engines import cache_admin
from gates.config import G2_OUTPUT_TOKENS
from gates.g2_baseline.cold_read import (
    METRIC,
    WARMUP_PAIRS,
    ColdReadError,
    FioRegions,
    Pair,
    TierColdLoad,
    measure_pairs,
    own_pattern,
    paired_ratio,
)
from gates.g2_baseline.placed_hits import PLACED, HitError, PlacedHits
from gates.side_by_side import MIN_YARDSTICK_BYTES, FasterOf, Pairing
from gates.storage_best import StorageBest, storage_best
from kvcore.aa import G2_AA_FALSE_DECISION, ratio_excludes_one
from kvcore.sequential import Looks, Stopping
from kvcore.stats import ratio_ci
from workloads.traffic.datasets import context_request
from workloads.traffic.requests import WorkloadRequest

MODES = ("recompute", "host-hit", "disk-cold")
BLOCK_TOKENS = 256     # kvgate's block: a hit serves the prompt's whole blocks (an engine with smaller ones, more)
FILLER_EXTRA = 16      # tokens a filler prompt has beyond its planned KV: what fills its last block is never short


def _request(tokens: int, tag: str, endpoint, max_tokens: int = G2_OUTPUT_TOKENS) -> WorkloadRequest:
    return context_request(tokens, tag, endpoint.tokenizer, max_tokens, "g2")


def _roles(endpoints):
    """The candidate, and the endpoint whose TTFT is recompute's (the recompute reference, else the candidate's
    miss)."""
    candidate = endpoints.get("candidate")
    if candidate is None:
        pytest.skip("G2 needs a candidate endpoint")
    return candidate, endpoints.get("recompute")


@pytest.fixture(scope="module")
def baseline_runs(gate_context, endpoints, adapters):
    """Every TTFT of every context and mode, measured once, and each hit as checked."""
    candidate, recompute = _roles(endpoints)
    run_id = gate_context.store.run_info().get("run_id", "run")
    config = gate_context.config.g2
    clients = {"candidate": candidate.target().client()}
    if recompute is not None:
        clients["recompute"] = recompute.target().client()
    # a filler's prompt holds `tokens` in whole blocks: its text, the chat template and a margin on top
    placed = PlacedHits.plan(adapters["candidate"], clients["candidate"], max(config.contexts) - FILLER_EXTRA,
                             BLOCK_TOKENS, lambda tokens, tag: _request(tokens + FILLER_EXTRA, f"{run_id}/{tag}",
                                                                         candidate))
    results = {"ttft": {}, "hits": [], "recompute_from": "the recompute endpoint" if recompute else
               "the candidate's own miss (no recompute endpoint)",
               "placement": {mode: p.describe() for mode, p in placed.placements.items()},
               "unplaced": {mode: placed.unplaced(mode) for mode in PLACED if placed.unplaced(mode)},
               "not_applicable": {mode: placed.not_applicable(mode) for mode in PLACED if placed.not_applicable(mode)}}
    say = gate_context.store.set_progress
    try:
        for tokens in sorted(config.contexts):
            stored: Optional[WorkloadRequest] = None      # the prefix the candidate computed, placed every round
            spent: list[float] = []        # each round's seconds
            while config.rounds.more(spent):
                round_, started = len(spent), time.monotonic()
                say("g2", f"TTFT by context: {tokens} tokens, round {round_ + 1} (at most {config.rounds.max})")
                request = _request(tokens, f"{run_id}/{tokens}/{round_}", candidate)
                if recompute is not None:
                    record = clients["recompute"].send(request)
                    if not record.ok:
                        pytest.fail(f"G2 recompute request failed: {record.error_type}: {record.error_message}",
                                    pytrace=False)
                    results["ttft"].setdefault(("recompute", tokens), []).append(record.ttft_s)
                if stored is None or recompute is None:
                    record = clients["candidate"].send(request)        # a miss: computes and stores the prefix
                    if not record.ok:
                        pytest.fail(f"G2 request failed: {record.error_type}: {record.error_message}", pytrace=False)
                    if recompute is None:
                        results["ttft"].setdefault(("recompute", tokens), []).append(record.ttft_s)
                    stored = request
                for mode in PLACED:
                    if mode in results["unplaced"] or mode in results["not_applicable"]:
                        continue
                    hit = placed.hit(mode, stored, tokens, round_)
                    results["ttft"].setdefault((mode, tokens), []).append(hit.ttft_s)
                    results["hits"].append(hit)
                spent.append(time.monotonic() - started)
    except HitError as error:
        pytest.fail(f"G2: {error}", pytrace=False)
    finally:
        for client in clients.values():
            client.close()
    return results


@dataclass
class ColdReadRun:
    """G2's cold-read pairs as measured: the pairs, how sampling stopped, the yardstick and the jobs run."""

    pairs: list[Pair]
    stopping: Stopping
    best: StorageBest
    best_side: FasterOf
    best_job: str
    own_job: str
    aa: bool
    looks: Optional[Looks] = None    # the pairs' schedule (`Pairing.looks()`), fixed before the first


def _job_text(side: FioRegions) -> str:
    return " ".join(side.read_job(0).argv()[3:12]) if side.region else ""


@pytest.fixture(scope="module")
def cold_read_pairs(gate_context, endpoints):
    """Sequential pairs at the longest context: the tier's cold load of fresh prefixes, then the storage's best
    read job (G1's sweep) reading as many bytes of a fresh region, then fio in the tier's own pattern (a
    diagnostic). A/A mode: the best job on both sides. None for a candidate whose cache is not kvgate's: the
    tier's side is its disk reads' bytes and seconds, which only kvgate's cache exports (its server, or its
    connector's sidecar inside vLLM; the check then says so, INCONCLUSIVE)."""
    candidate, _ = _roles(endpoints)
    cache = cache_admin(gate_context.config, candidate)
    if cache is None:
        return None
    config, embedded, store = gate_context.config, gate_context.config.targets.embedded, gate_context.store
    best = storage_best(config, store)
    run_id = store.run_info().get("run_id", "run")
    longest = max(config.g2.contexts)
    client = candidate.target().client()
    tier = TierColdLoad(cache.admin, client, lambda i: _request(longest, f"{run_id}/cold-read/{i}", candidate),
                        prefixes=config.g2.cold_read_prefixes, sets=config.g2.cold_read_sets,
                        clear_engine=cache.clear_engine)
    pairing, directory = config.g2.cold_read_pairs, config.storage.path.resolve() / "fio"
    sets, rule = config.g2.cold_read_sets, config.rule("g2", METRIC)

    def said(pair: Pair) -> None:
        store.set_progress("g2", f"cold read: pair {pair.round} (at most {pairing.max}), "
                                 f"{pair.ratio:.2f} of the storage's best")

    try:
        nbytes = tier(0).nbytes          # stores every set, then one load (not judged): what each load moves
        # the yardstick: each mode's fastest sweep job that streams what fio moves beside a load
        best = best.for_bytes(max(nbytes, MIN_YARDSTICK_BYTES))
        # fio's regions laid out at the first pair and read in turn, as the tier stores its sets then and reloads them
        best_side = best.best_of("read", lambda mode, shape: FioRegions(
            directory, sets, shape, name=f"g2-best-read-{mode}", min_bytes=MIN_YARDSTICK_BYTES))
        own_side = FioRegions(directory, sets, own_pattern(embedded.disk_io_mode == "direct",
                                                           embedded.disk_read_workers, config.fio.ioengine),
                              name="g2-own-pattern")
        with ExitStack() as stack:
            for side in (*best_side.sides.values(), own_side):
                stack.enter_context(side)
            # equal draws: the tier loads as many times a pair as the yardstick runs jobs, the faster counted
            subject, same_pattern, draws = tier, own_side, len(best_side.sides)
            if config.aa:                  # A/A: the best jobs against themselves, as many bytes as the tier's load
                aa_side = best.best_of("read", lambda mode, shape: stack.enter_context(
                    FioRegions(directory, sets, shape, name=f"g2-aa-read-{mode}", min_bytes=MIN_YARDSTICK_BYTES)))
                subject, same_pattern, draws = (lambda i: aa_side(i, nbytes)), None, 1
            pairs, stopping = measure_pairs(subject, best_side, Pairing.of(pairing), [rule] if rule else [],
                                            warmup=WARMUP_PAIRS, same_pattern=same_pattern, on_pair=said,
                                            draws=draws)
            jobs = "; ".join(_job_text(side) for side in best_side.sides.values()), _job_text(own_side)
    except ColdReadError as error:
        pytest.fail(f"G2 cold read: {error}", pytrace=False)
    finally:
        client.close()
    return ColdReadRun(pairs, stopping, best, best_side, *jobs, aa=config.aa, looks=Pairing.of(pairing).looks())


def test_ttft_by_context_length_for_recompute_host_and_cold_disk_hits(gate_context, baseline_runs, record, verdict,
                                                                     not_run):
    for (mode, tokens), values in sorted(baseline_runs["ttft"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for i, value in enumerate(values):
            record("ttft_round_ms", value * 1e3, "ms", mode=mode, context_tokens=tokens, round=i)
        record("ttft_ms", statistics.median(values) * 1e3, "ms", mode=mode, context_tokens=tokens,
               **({"from": baseline_runs["recompute_from"]} if mode == "recompute" else
                  {"placement": baseline_runs["placement"][mode]}))
    hits = baseline_runs["hits"]
    # a hit serves every whole block of the prompt (kvgate's 256 tokens; an engine with smaller blocks, more)
    shares = [(hit.hit_tokens or 0) / (hit.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS) for hit in hits
              if hit.prompt_tokens >= BLOCK_TOKENS]
    fraction = min(shares, default=None)
    label = "G2 cache hits served whole (least cached share of a placed hit)" + _not_applicable_note(baseline_runs)
    _unless_nothing_applies(baseline_runs, not_run, label, "cached_fraction_min")
    unplaced = "; ".join(f"{mode} not measured: {why}" for mode, why in baseline_runs["unplaced"].items())
    record("cached_fraction_min", fraction, hits=len(hits))
    verdict(label, "cached_fraction_min", fraction, unit="%", valid=not unplaced, invalid_reason=unplaced)


def _not_applicable_note(baseline_runs) -> str:
    """"; host-hit not applicable: ..." for the modes whose tier the candidate does not have."""
    return "".join(f"; {mode} {why}" for mode, why in baseline_runs["not_applicable"].items())


def _unless_nothing_applies(baseline_runs, not_run, label: str, metric: str) -> None:
    """A check over the placed hits is not run (said, not judged) when no placed tier applies to the candidate."""
    if len(baseline_runs["not_applicable"]) == len(PLACED):
        not_run(label, metric, "not applicable: " + "; ".join(
            f"{mode}: {why.removeprefix('not applicable: ')}" for mode, why in baseline_runs["not_applicable"].items()))


def test_hits_were_served_from_the_placed_tier(gate_context, baseline_runs, record, verdict, not_run):
    """Each hit against the engine's tier accounting: from the placed tier alone (or, INCONCLUSIVE, why not known)."""
    _unless_nothing_applies(baseline_runs, not_run, "G2 hits served from the placed tier", "placed_tier_verified")
    hits = baseline_runs["hits"]
    for hit in hits:
        record("placed_hit", hit.verified, mode=hit.mode, tier=PLACED[hit.mode], context_tokens=hit.context_tokens,
               round=hit.round, tier_tokens=hit.tier_tokens, cached_tokens=hit.cached_tokens, why=hit.why)
    served = sum(hit.verified is True for hit in hits)
    unknown = list(dict.fromkeys(f"{hit.mode}: {hit.why}" for hit in hits if hit.verified is None))
    wrong = [f"{hit.mode} at {hit.context_tokens} tokens: {hit.why}" for hit in hits if hit.verified is False]
    unplaced = [f"{mode} not measured: {why}" for mode, why in baseline_runs["unplaced"].items()]
    value = served / len(hits) if hits else None
    how = ", ".join(f"{mode} {words.partition(':')[0]}" for mode, words in baseline_runs["placement"].items()
                    if mode not in baseline_runs["unplaced"])
    verdict(f"G2 hits served from the placed tier ({served} of {len(hits)}; {how})"
            + (f"; {wrong[0]}" if wrong else "") + _not_applicable_note(baseline_runs), "placed_tier_verified", value,
            unit="%",
            valid=not (unknown or unplaced), invalid_reason="; ".join(unplaced + unknown[:2]))


def test_disk_hit_ttft_is_a_fraction_of_recompute_at_the_longest_context(gate_context, baseline_runs, record,
                                                                           verdict, not_run):
    longest = max(gate_context.config.g2.contexts)
    label = f"G2 cold disk hit TTFT / recompute TTFT at {longest} tokens"
    if "disk-cold" in baseline_runs["not_applicable"]:
        not_run(label, "disk_hit_ttft_vs_recompute", baseline_runs["not_applicable"]["disk-cold"])
    if "disk-cold" in baseline_runs["unplaced"]:
        verdict(label, "disk_hit_ttft_vs_recompute", None, unit="%", valid=False,
                invalid_reason=f"no disk hit measured: {baseline_runs['unplaced']['disk-cold']}",
                context={"context_tokens": longest})
        return
    disk_rounds = baseline_runs["ttft"][("disk-cold", longest)]
    recompute_rounds = baseline_runs["ttft"][("recompute", longest)]
    disk, recompute = statistics.median(disk_rounds), statistics.median(recompute_rounds)
    ratio, interval = ratio_ci(disk_rounds, recompute_rounds)
    disk_hits = [h for h in baseline_runs["hits"] if h.mode == "disk-cold" and h.context_tokens == longest]
    doubts = [f"round {h.round}: {h.why}" for h in disk_hits if h.verified is not True]
    if "page cache NOT dropped" in baseline_runs["placement"]["disk-cold"]:
        doubts.insert(0, f"the disk hits may be warm: {baseline_runs['placement']['disk-cold']}")
    record(
        "disk_hit_ttft_vs_recompute",
        ratio,
        context_tokens=longest,
        disk_ms=disk * 1e3,
        recompute_ms=recompute * 1e3,
        interval=list(interval),
        recompute_from=baseline_runs["recompute_from"],
    )
    verdict(f"{label} ({disk * 1e3:.0f} / {recompute * 1e3:.0f} ms)", "disk_hit_ttft_vs_recompute", ratio, unit="%",
            interval=interval, valid=not doubts, invalid_reason="; ".join(doubts[:2]),
            context={"context_tokens": longest})


def test_cold_disk_read_bandwidth_reaches_the_storages_best(gate_context, cold_read_pairs, adapters, record, verdict,
                                                            not_run):
    """The tier's cold-read GB/s over the storage's best read job's, in sequential pairs: the geometric mean
    of the pairs' ratios with its anytime-valid interval. The same-pattern fio is shown beside, never judged;
    so is G1's fio figure (another minute). A/A mode: the best job on both sides, its interval must hold 1."""
    if cold_read_pairs is None:
        engine = gate_context.config.targets.candidate.engine
        label = "G2 cold-read KV bandwidth / the storage's best read, side by side"
        no_disk = adapters["candidate"].absent_tiers().get("disk")
        if no_disk:
            not_run(label, METRIC, f"not applicable: the candidate ({engine}) has no disk tier ({no_disk})")
        verdict(label, METRIC, None, unit="%",
                valid=False, invalid_reason=f"the candidate ({engine}) does not export its disk tier's read bytes "
                "and seconds; only kvgate's cache does (kvgate_cache_bytes_read_total, "
                "kvgate_cache_load_latency_seconds{tier=\"disk\"}: its server, or its connector's sidecar in vLLM "
                "with cache_layer: kvgate and cache_layer_url)")
        return
    run = cold_read_pairs
    for pair in run.pairs:
        record("cold_read_pair", pair.ratio, **pair.context("aa" if run.aa else "tier"),
               **run.best_side.round_context(pair.round), aa=run.aa)
    judged = paired_ratio(run.pairs, run.stopping, run.looks)
    g1 = gate_context.store.latest("g1", "seq_read_gbps")
    beside = f"; G1's fio matrix {g1['value']:.2f} GB/s, not used" if g1 is not None else ""
    record(METRIC, judged.value, "%", **judged.record_context(), tier_gbps=judged.subject_gbps,
           best_job=run.best_job, **run.best.context("read"),
           same_pattern_job=run.own_job, aa=run.aa, g1_seq_read_gbps=None if g1 is None else g1["value"])
    subject = "A/A: the best job" if run.aa else "G2 cold-read KV bandwidth"
    if run.aa:
        record(G2_AA_FALSE_DECISION, ratio_excludes_one(judged.interval), of=METRIC, **judged.aa_context())
    draws = max((len(pair.subject_draws) for pair in run.pairs), default=0)    # as the pairs ran (A/A: none)
    equal = f"each pair the faster of {draws} tier loads, as of {draws} jobs" if draws > 1 else ""
    notes = "".join(f"; {note}" for note in (equal, run.best_side.describe_wins(run.pairs), judged.diagnostic())
                    if note)
    verdict(f"{subject} / the storage's best read ({run.best.describe()}), side by side ({judged.describe()}"
            f"{notes}{beside})", METRIC, judged.value, **judged.verdict_options())
