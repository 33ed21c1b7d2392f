"""G3's capacity search, predicted: the same search (kvcore/capacity.py) over the step simulation.

Each probe of a target at `users` is the target's replay sent once in closed loop by that many users
(sizing/queueing.py); open loop, a probe at a multiple m of the trace's rate sends the replay at its
arrival times ÷ m by the load's users (a request waiting for a free one is late by that). Its simulated requests judged
against the SLO as G3 judges a probe's
(workloads.loadgen.capacity_probe.SLO.misses: TTFT or TPOT over its limit); the probe meets the SLO when at most
the SLO's allowance of them miss. The search ramps and bisects as G3's does, so the predicted
capacity is the one G3 would find if the simulation were the target. With noise (engine.jitter) one
search per seed: the prediction is their median capacity.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from kvcore.attainment import MEETS, MISSES
from kvcore.capacity import CapacitySearch, Probe
from workloads.loadgen.capacity_probe import SLO

from .g3_figures import TargetReplay
from .queueing import EngineModel, SimulatedRequest


def simulated_record(request: SimulatedRequest) -> dict:
    """A simulated request as the SLO reads a record: its TTFT and TPOT (after the first token)."""
    tokens = request.output_tokens
    tpot = (request.done_s - request.first_token_s) / (tokens - 1) if tokens > 1 else None
    return {"ok": True, "ttft_s": request.ttft_s, "tpot_s": tpot, "client_wait_s": request.client_wait_s}


@dataclass(frozen=True)
class OpenLoop:
    """Open-loop probes: the replay's arrival times at 1x the trace's rate, sent by `users`, loads in `unit` steps."""

    arrivals_s: Sequence[float]
    users: int
    unit: float


def predicted_search(replay: TargetReplay, engine: EngineModel, slo: SLO, start: float, most: float,
                     seed: int = 0, open_loop: Optional[OpenLoop] = None) -> CapacitySearch:
    """The search over the simulation, each probe decided by its simulated requests' miss share."""
    search = CapacitySearch(start, most, open_loop.unit if open_loop else 1)
    while (load := search.next_load()) is not None:
        if open_loop is None:
            simulated = replay.simulate(int(load), engine, seed=seed)
        else:
            simulated = replay.simulate(open_loop.users, engine, seed=seed,
                                        arrivals_s=[a / load for a in open_loop.arrivals_s])
        misses = sum(slo.misses(simulated_record(r)) for r in simulated)
        share = misses / len(simulated) if simulated else 1.0
        search.record(Probe(load, MEETS if share <= slo.allowed else MISSES, len(simulated), misses,
                            (share, share)))
    return search


def predicted_capacity(replay: TargetReplay, engine: EngineModel, slo: SLO, start: float, most: float,
                       seeds: Sequence[int] = (0,), open_loop: Optional[OpenLoop] = None) -> Optional[float]:
    """The capacity the search would find over the simulation (the median over `seeds` with noise); None when a
    search met the SLO up to `most` (open above)."""
    seeds = seeds if engine.jitter else seeds[:1]
    searched = [predicted_search(replay, engine, slo, start, most, seed, open_loop).capacity for seed in seeds]
    found = [c for c in searched if c is not None]
    return float(statistics.median(found)) if len(found) == len(searched) else None
