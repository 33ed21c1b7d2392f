"""G3's figures from simulated runs (sizing/queueing.py), judged as G3 judges its measured ones.

**Intervals.** G3's matched blocks are judged over their pairs as G3 judges them (`pairs_prediction`:
`kvcore.block_pairs.pair_figures` over each simulated block's figures, `block_row`). Otherwise a simulated step
becomes G3's records (`SimulatedRequest.record`) and G3's own analysis (`kvcore.g3_analysis.level_figures`)
gives the reduction and the gain with their 95% bootstrap intervals over the requests (TTFTs; output tokens
per 2-second window). Either way a figure near its threshold comes out INCONCLUSIVE as the measured one
would; a block or step with fewer than `min_requests` requests is invalid as in G3.

With noise, each level is simulated once per seed (`sizing.runs`) and `combine`d:
the median figure, the interval from the lowest run's low end to the highest run's high end. The
interval covers the spread of the requests within a run and which order of turns a run happens to
take; it does not cover the machine's minute-to-minute swing (a baseline step measured at a slow
minute and the candidate's at a fast one), nor the errors of the fitted constants themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import numpy as np

from kvcore.block_pairs import pair_figures
from kvcore.g3_analysis import Ladder, LevelFigures, SustainedFigures, level_figures, slo_latencies, sustained_rate_gain
from kvcore.sequential import Looks
from kvcore.settings import ConfigError

from .queueing import EngineModel, Engines, ServedRequest, SimulatedRequest, engine_of, noisy, simulate
from .timing import check_number


@dataclass(frozen=True)
class TargetFigures:
    """One target at one level, over the requests sent after the warm-up."""

    ttft_p50_s: float
    output_tokens_per_s: float      # their output tokens ÷ (last completion − warm-up end)
    requests: int
    itl_mean_s: Optional[float]     # mean gap between tokens (None: every request made one token)


def summarize(simulated: Sequence[SimulatedRequest], warmup_s: float = 0.0) -> TargetFigures:
    measured = [r for r in simulated if r.sent_s >= warmup_s]
    if not measured:
        raise ConfigError(f"warmup_s: expected a warm-up shorter than the simulated run, found {warmup_s} s "
                          f"with every request sent before it")
    span = max(r.done_s for r in measured) - warmup_s
    gaps = [g for r in measured for g in r.itl_s]
    return TargetFigures(float(np.median([r.ttft_s for r in measured])),
                         sum(r.output_tokens for r in measured) / span, len(measured),
                         float(np.mean(gaps)) if gaps else None)


def g3_step(simulated: Sequence[SimulatedRequest], warmup_s: float = 0.0, min_requests: int = 1) -> dict:
    """A simulated step as G3's analysis takes one: {"summary": its validity, "records": the requests sent
    after the warm-up, in G3's record shape}; fewer than `min_requests` makes it invalid, as in G3."""
    records = [r.record() for r in simulated if r.sent_s >= warmup_s]
    valid = len(records) >= min_requests
    return {"summary": {"valid": valid, "invalid_reasons": "" if valid else
                        f"{len(records)} completed requests < minimum {min_requests}"},
            "records": records}


@dataclass(frozen=True)
class TargetReplay:
    """One target's replay: its requests in order, the node of each (a fleet; None: one node) and how
    many nodes it has (each an engine of the same model)."""

    requests: Sequence[ServedRequest]
    nodes: Optional[Sequence[int]] = None
    engines: int = 1

    def simulate(self, users: int, engine: EngineModel, **settings) -> list[SimulatedRequest]:
        return simulate(self.requests, users, [engine] * self.engines, nodes=self.nodes, **settings)


@dataclass(frozen=True)
class LevelPrediction:
    """G3 at one level (a concurrency, or a rate multiplier): every target's figures, and the candidate's
    reduction and gain over the baseline as G3's own analysis gives them from the simulated records
    (`kvcore.g3_analysis.level_figures`: the point and its 95% bootstrap interval)."""

    concurrency: float
    targets: Mapping[str, TargetFigures]
    g3: LevelFigures
    steps: Mapping[str, dict] = field(default_factory=dict)   # each target's simulated step (g3_step)
    runs: tuple[LevelFigures, ...] = ()                       # combined from runs with several noise seeds

    @property
    def ttft_p50_reduction(self) -> float:
        """1 − candidate TTFT p50 / baseline TTFT p50 (0.31: 31% lower), as G3 computes it."""
        return 1.0 - self.targets["candidate"].ttft_p50_s / self.targets["baseline"].ttft_p50_s

    @property
    def throughput_gain(self) -> float:
        """candidate output tokens/s ÷ baseline's − 1 (0.35: +35%), each over its whole window (G3's
        judged gain is `g3.throughput_gain`: over its block pairs, or 2-second windows)."""
        return self.targets["candidate"].output_tokens_per_s / self.targets["baseline"].output_tokens_per_s - 1.0


Replay = Sequence[ServedRequest] | TargetReplay | Mapping[float, Sequence[ServedRequest] | TargetReplay]


def _replay_at(role: str, replay: Replay, level: float) -> TargetReplay:
    if isinstance(replay, Mapping):
        found = replay.get(level)
        if found is None:
            raise ConfigError(f"replays.{role}: expected requests for level {level:g}, found levels {sorted(replay)}")
    else:
        found = replay
    return found if isinstance(found, TargetReplay) else TargetReplay(found)


def _check_roles(replays: Mapping[str, Replay]) -> None:
    missing = [role for role in ("baseline", "candidate") if role not in replays]
    if missing:
        raise ConfigError(f"replays: expected a baseline and a candidate replay, found none for {missing}")


def level_prediction(level: float, simulated: Mapping[str, list[SimulatedRequest]], warmup_s: float,
           min_requests: int) -> LevelPrediction:
    steps = {role: g3_step(requests, warmup_s, min_requests) for role, requests in simulated.items()}
    figures = {role: summarize(requests, warmup_s) for role, requests in simulated.items()}
    return LevelPrediction(level, figures, level_figures(steps["baseline"], steps["candidate"]), steps)


def block_row(block: int, role: str, simulated: Sequence[SimulatedRequest], min_requests: int) -> dict:
    """A simulated block as G3 summarises one of its matched blocks (workloads/loadgen/blocks.py): measured from its
    start (the simulated block's 0: its users start at once, no warm-up inside a block), its TTFT p50 and its output
    tokens ÷ (its last answer − its start); invalid with fewer than `min_requests` requests, as in G3."""
    step = g3_step(simulated, 0.0, min_requests)
    last = max((r.done_s for r in simulated), default=0.0)
    return {"block": block, "target": role, "valid": step["summary"]["valid"],
            "invalid_reasons": step["summary"]["invalid_reasons"],
            "ttft_p50_s": float(np.median([r.ttft_s for r in simulated])) if simulated else None,
            "output_tokens_per_s": sum(r.output_tokens for r in simulated) / last if last > 0 else None}


def pairs_prediction(level: float, pairs: Sequence[Mapping[str, Sequence[SimulatedRequest]]], min_requests: int,
                     looks: Looks) -> LevelPrediction:
    """A level of G3's matched blocks from its simulated pairs (each pair: every target's block, each simulated from
    its own 0): every target's figures over its blocks laid end to end (G3 pools a target's blocks), and the
    reduction and gain as G3 judges them, over the pairs' ratios (`kvcore.block_pairs.pair_figures`, the interval
    at this many pairs of the level's schedule `looks`)."""
    laid: dict[str, list[SimulatedRequest]] = {role: [] for role in pairs[0]} if pairs else {}
    clock = dict.fromkeys(laid, 0.0)                 # where each target's next block starts
    for pair in pairs:
        for role, block in pair.items():
            laid[role] += [replace(r, sent_s=r.sent_s + clock[role], first_token_s=r.first_token_s + clock[role],
                                   done_s=r.done_s + clock[role]) for r in block]
            clock[role] += max((r.done_s for r in block), default=0.0)
    rows = [{role: block_row(k, role, block, min_requests) for role, block in pair.items()}
            for k, pair in enumerate(pairs)]
    return LevelPrediction(level, {role: summarize(requests) for role, requests in laid.items()},
                           pair_figures([(row["baseline"], row["candidate"]) for row in rows], looks),
                           {role: g3_step(requests, 0.0, min_requests) for role, requests in laid.items()})


def combine(replicas: Sequence[LevelPrediction]) -> LevelPrediction:
    """One level's prediction from runs simulated with different noise seeds (each a run the machine
    could give: its turns answered in another order, so other nodes and hits): every figure the median
    of the runs', each interval from the lowest run's low end to the highest run's high end (it covers
    the requests' spread within a run and which of these runs happens). One run: itself."""
    if len(replicas) == 1:
        return replicas[0]
    first = replicas[0]

    def median(values):
        known = [v for v in values if v is not None]
        return float(np.median(known)) if known else None

    def span(intervals):
        known = [i for i in intervals if i is not None]
        return (min(i[0] for i in known), max(i[1] for i in known)) if known else None

    targets = {role: TargetFigures(median([r.targets[role].ttft_p50_s for r in replicas]),
                                   median([r.targets[role].output_tokens_per_s for r in replicas]),
                                   int(median([r.targets[role].requests for r in replicas])),
                                   median([r.targets[role].itl_mean_s for r in replicas]))
               for role in first.targets}
    runs = [r.g3 for r in replicas]
    reasons = "; ".join(sorted({g.invalid_reason for g in runs if g.invalid_reason}))
    g3 = LevelFigures(median([g.ttft_reduction for g in runs]), span([g.ttft_interval for g in runs]),
                      median([g.throughput_gain for g in runs]), span([g.throughput_interval for g in runs]),
                      all(g.valid for g in runs), reasons)
    return LevelPrediction(first.concurrency, targets, g3, first.steps, tuple(runs))


def predict_g3(replays: Mapping[str, Replay], levels: Sequence[int], engines: Engines,
               duration_s: Optional[float] = None, warmup_s: float = 0.0,
               min_requests: int = 1, seeds: Sequence[int] = (0,)) -> list[LevelPrediction]:
    """Per concurrency level, every target's figures, closed loop. `replays` maps a target ("baseline",
    "candidate", and any other) to its replay: requests (one node), a TargetReplay (a fleet), or either
    per level (hits may differ with the level: a trace's levels each replay their own part). With
    noise (an engine's jitter), one run per seed in `seeds`, combined (`combine`). `engines`: one engine for every
    target, or each target's own."""
    _check_roles(replays)
    seeds = seeds if noisy(engines) else seeds[:1]
    predictions = []
    for level in levels:
        runs = [level_prediction(level, {role: _replay_at(role, replay, level).simulate(
                    level, engine_of(engines, role), duration_s=duration_s, seed=seed)
                    for role, replay in replays.items()},
                    warmup_s, min_requests) for seed in seeds]
        predictions.append(combine(runs))
    return predictions


@dataclass(frozen=True)
class RatePrediction:
    """G3 with `replay: rate_multipliers`: each multiplier's figures (TTFT p50 reduction as G3 judges
    it there) and the sustained-rate gain over the ladder (`analysis.sustained_rate_gain`)."""

    levels: list[LevelPrediction]
    sustained: SustainedFigures
    slo_s: float


def predict_rate_ladder(replays: Mapping[str, Replay], multipliers: Sequence[float],
                        arrivals_s: Mapping[float, Sequence[float]], engines: Engines, users: int,
                        slo_s: float, duration_s: Optional[float] = None, warmup_s: float = 0.0,
                        min_requests: int = 1) -> RatePrediction:
    """G3's open-loop ladder: at each multiplier m each target's requests (its own trace part) arrive
    at `arrivals_s[m]` (the part's timestamps ÷ m, `workloads.loadgen.sweep.rate_multiplied`), sent by `users`
    load users (a request waits in the client while all are busy); then G3's judgement of the ladder:
    per step the SLO latencies (client wait + TTFT, `analysis.slo_latencies`), the highest multiplier
    each target sustains with its TTFT p90 within `slo_s`, and the gain with its interval."""
    _check_roles(replays)
    check_number("ttft_slo_s", slo_s)
    levels = []
    ladders: dict[str, list[tuple[float, bool, str, tuple[float, ...]]]] = {role: [] for role in replays}
    for m in multipliers:
        if m not in arrivals_s:
            raise ConfigError(f"arrivals_s: expected the arrival times at {m:g}x, found {sorted(arrivals_s)}")
        simulated = {role: _replay_at(role, replay, m).simulate(users, engine_of(engines, role),
                                                                  duration_s=duration_s, arrivals_s=arrivals_s[m])
                     for role, replay in replays.items()}
        level = level_prediction(m, simulated, warmup_s, min_requests)
        levels.append(level)
        for role, step in level.steps.items():
            ladders[role].append((m, step["summary"]["valid"], step["summary"]["invalid_reasons"],
                                  tuple(slo_latencies(step["records"]))))
    sustained = sustained_rate_gain(Ladder(tuple(ladders["baseline"])), Ladder(tuple(ladders["candidate"])), slo_s)
    return RatePrediction(levels, sustained, slo_s)
