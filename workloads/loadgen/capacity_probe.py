"""G3's capacity search against live targets: probes at a load, each decided from its requests.

How it works: docs/methods/confidence-sequence.md (workloads/loadgen/capacity_probe.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from kvcore.attainment import MISSES, UNDECIDED, MissShare
from kvcore.capacity import CapacitySearch, Probe
from kvcore.rundata import read_records
from workloads.loadgen.load import LoadProgress, run_load
from workloads.loadgen.steady import order_segment
from workloads.loadgen.sweep import rate_multiplied, trace_segment
from workloads.traffic.requests import Workload
from workloads.traffic.target import Target

Say = Callable[[str], None]


@dataclass(frozen=True)
class SLO:
    """A request's objective: TTFT and (optionally) TPOT within their limits at `percentile`; errors within a share."""

    ttft_s: float
    tpot_s: Optional[float] = None
    percentile: float = 90.0
    max_error_share: float = 0.001

    @property
    def allowed(self) -> float:
        """The share of requests that may miss: 1 - the percentile."""
        return 1 - self.percentile / 100

    def misses(self, record: dict) -> bool:
        """A finished request's record misses when it failed or a latency is over its limit (a single-token answer
        has no TPOT)."""
        if not record.get("ok"):
            return True
        ttft, tpot = record.get("ttft_s"), record.get("tpot_s")
        if ttft is not None:                # from its scheduled arrival (open loop; closed loop it waited none)
            ttft += record.get("client_wait_s") or 0.0
        return ttft is None or ttft > self.ttft_s or (self.tpot_s is not None and tpot is not None
                                                       and tpot > self.tpot_s)

    def longest_s(self, max_tokens: int) -> float:
        """How long a request of `max_tokens` may take and still meet both limits."""
        return self.ttft_s + (self.tpot_s or 0.0) * max(max_tokens - 1, 0)

    def describe(self) -> str:
        p = f"p{self.percentile:g}"
        tpot = f" and TPOT {p} ≤ {self.tpot_s * 1e3:g} ms" if self.tpot_s is not None else ""
        return f"TTFT {p} ≤ {self.ttft_s * 1e3:g} ms{tpot}, errors ≤ {self.max_error_share:.1%}"


@dataclass(frozen=True)
class ProbeSettings:
    max_requests: int
    budget_s: float
    confidence: float = 0.95
    check_every_s: float = 1.0
    open_loop_users: Optional[int] = None   # open loop: loads are multiples of a trace's rate, sent by these users

    def part(self, workload: Workload, load: float, first_request: int) -> tuple[Workload, int]:
        """What a probe at `load` sends from `first_request` on, and with how many users."""
        if self.open_loop_users is None:
            return order_segment(workload, first_request, self.max_requests, passes=True), int(load)
        return rate_multiplied(trace_segment(workload, first_request, self.max_requests), load), self.open_loop_users


@dataclass
class ProbeResult:
    """One probe: the search's `Probe` and the figures the report draws."""

    target: str
    probe: Probe
    errors: int
    ttft_p90_ms: Optional[float]
    tpot_p90_ms: Optional[float]
    goodput: Optional[float]            # requests that met the SLO / requests counted
    late: int                           # requests in flight past their limits when the budget ran out
    ended_early: bool                   # stopped because decided
    directory: str
    sent: int                           # requests sent (the load order moves on by the most a round sent)

    def to_dict(self) -> dict:
        return {"target": self.target, **self.probe.to_dict(), "errors": self.errors,
                "ttft_p90_ms": self.ttft_p90_ms, "tpot_p90_ms": self.tpot_p90_ms, "goodput": self.goodput,
                "late": self.late, "ended_early": self.ended_early, "directory": self.directory, "sent": self.sent}


def decide(requests: int, misses: int, errors: int, slo: SLO, confidence: float) -> tuple[str, MissShare]:
    """A load's decision from its counts: MISSES when its errors alone are decided above `max_error_share`, else the
    miss share's decision against the SLO's allowance."""
    share = MissShare(requests, misses, slo.allowed, confidence)
    if slo.max_error_share > 0 and MissShare(requests, errors, slo.max_error_share, confidence).decision() == MISSES:
        return MISSES, share
    return share.decision(), share


def _p90_ms(values: list[float]) -> Optional[float]:
    return float(np.percentile(values, 90)) * 1e3 if values else None


def run_probe(workload: Workload, target: Target, load: float, first_request: int, slo: SLO,
              settings: ProbeSettings, directory: Path) -> ProbeResult:
    """One probe of `target` at `load` (users, or a multiple of the trace's rate), from `first_request` of the load
    order, stopped when decided."""
    segment, users = settings.part(workload, load, first_request)
    tokens = {r.request_id: r.max_tokens for session in segment.sessions for r in session}
    landed: list[dict] = []             # the records read while the probe ran, up to its decision

    def decided(progress: LoadProgress) -> bool:
        """Whether the records so far decide the probe (then the load stops: run_load reads nothing more)."""
        landed.extend(progress.new_records)
        misses = sum(slo.misses(r) for r in landed)
        errors = sum(not r.get("ok") for r in landed)
        return decide(len(landed), misses, errors, slo, settings.confidence)[0] != UNDECIDED

    started = time.monotonic()
    run = run_load(segment, target, users, settings.budget_s, directory, max_requests=len(segment.requests),
                   on_progress=decided, progress_every_s=settings.check_every_s)
    # stopped because decided: the probe is the requests that decided it (those still due were cut short by the
    # stop, not late, and are left out); out of requests or budget: every record, and those due (unsent or in
    # flight) longer ago than their limits allow count as late
    every = read_records(run.records_dir)
    records = list(landed) if run.ended_early else every
    late = 0 if run.ended_early else sum(
        1 for u in run.unanswered if (due := _due_at(u)) is not None
        and run.ended_at - due > slo.longest_s(tokens.get(u["request_id"], 1)))
    misses = sum(slo.misses(r) for r in records) + late
    errors = sum(not r.get("ok") for r in records)
    counted = len(records) + late
    decision, share = decide(counted, misses, errors, slo, settings.confidence)
    ok = [r for r in records if r.get("ok")]
    probe = Probe(load, decision, counted, misses, share.interval(), time.monotonic() - started)
    return ProbeResult(target.name, probe, errors, _p90_ms([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
                       _p90_ms([r["tpot_s"] for r in ok if r.get("tpot_s") is not None]),
                       (counted - misses) / counted if counted else None, late, run.ended_early, str(directory),
                       len(every) + len(run.unanswered))


def _due_at(unanswered: dict) -> Optional[float]:
    """When an unanswered request was due: its scheduled arrival (open loop), else when it was sent."""
    return unanswered.get("scheduled_at") if unanswered.get("scheduled_at") is not None else unanswered.get("sent_at")


@dataclass
class CapacityRun:
    """Both searches and every probe, in the order they ran."""

    searches: dict[str, CapacitySearch]
    probes: list[ProbeResult] = field(default_factory=list)


def search_capacity(targets: list[Target], workload: Workload, slo: SLO, settings: ProbeSettings, start: float,
                    most: float, out_dir: Path, first_request: int = 0, say: Say = lambda text: None,
                    unit: float = 1) -> CapacityRun:
    """Each target's capacity search (loads: multiples of `unit`), their probes in turn (AB, BA, ...) from the same
    place in the load order, until every search has stopped."""
    found = CapacityRun({t.name: CapacitySearch(start, most, unit) for t in targets})
    position, round_number = first_request, 0
    while any(s.next_load() is not None for s in found.searches.values()):
        order = targets if round_number % 2 == 0 else targets[::-1]
        sent = 0
        for target in order:
            search = found.searches[target.name]
            load = search.next_load()
            if load is None:
                continue
            say(f"capacity: {target.name} at {describe_load(load, settings)} (round {round_number + 1})")
            result = run_probe(workload, target, load, position, slo, settings,
                               out_dir / target.name / f"probe{len(found.probes) + 1}-{_load_tag(load, settings)}")
            search.record(result.probe)
            found.probes.append(result)
            sent = max(sent, result.sent)
            say(f"capacity: {target.name} at {describe_load(load, settings)}: {describe_probe(result)}")
        position += sent
        round_number += 1
    return found


def describe_load(load: float, settings: ProbeSettings) -> str:
    """'4 users' or '1.5x the trace's rate'."""
    if settings.open_loop_users is not None:
        return f"{load:g}x the trace's rate"
    return f"{load:g} user{'s' if load != 1 else ''}"


def _load_tag(load: float, settings: ProbeSettings) -> str:
    return f"x{load:g}" if settings.open_loop_users is not None else f"u{load:g}"


def describe_probe(result: ProbeResult) -> str:
    """'meets (2 of 40 missed, [0.6%, 17.9%]; TTFT p90 51 ms, TPOT p90 10 ms)'."""
    probe = result.probe
    low, high = probe.interval
    figures = [f"TTFT p90 {result.ttft_p90_ms:.0f} ms" if result.ttft_p90_ms is not None else "",
               f"TPOT p90 {result.tpot_p90_ms:.1f} ms" if result.tpot_p90_ms is not None else ""]
    late = f", {result.late} late" if result.late else ""
    budget = "" if probe.decision != UNDECIDED else ", budget spent"
    return (f"{probe.decision} ({probe.misses} of {probe.requests} missed{late}, miss share [{low:.1%}, "
            f"{high:.1%}]{budget}; " + ", ".join(f for f in figures if f) + ")")


def slo_of(config) -> SLO:
    """The SLO of gates.yaml's `slo` section (workloads.loadgen.settings.SLOConfig)."""
    return SLO(config.ttft_ms / 1e3, None if config.tpot_ms is None else config.tpot_ms / 1e3, config.percentile,
               config.max_error_share)
