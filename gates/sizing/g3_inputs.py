"""G3's workload as each target serves it: the requests of every step in the order G3's load sends them,
the node each goes to, and the hits each one gets from each tier (replayed through the target's tiers).

What G3 sends (gates/g3_main, workloads/sweep.py), each part a load run of its own:

- priming (`g3.prime`): every session's first turn, or a trace's warm-up requests;
- closed loop over a workload: one pass of its load order per level (the plan replays one pass after
  the primer, and every level serves those hits);
- a trace: its measured requests cut into one part per level (`trace_parts`), each level its own part,
  in order, never cycled; with `rate_multipliers` a part's requests arrive at their timestamps − the
  part's first, ÷ the multiplier (`rate_multiplied`).

**Routing** (`workloads.routing.Router`, used here as is): a load run's process holds one router shared
by its users (workloads/locustfile.py), so round-robin sends the k-th request the run sends to node
k mod N, and a new run (the primer, each step) starts again at node 0; prefix-affinity hashes the
conversation's opening. The k-th request sent is taken as the k-th of the load order: at concurrency
c a user takes the next session as soon as it is free, and a session goes back in the queue when its
turn is answered, so a real run drifts from that order a little (and with it which node serves a
turn: round-robin over 16 sessions and 2 nodes keeps each session on one node in this order).

The candidate's nodes share its pool; the baseline's nodes (kvgate starts as many, device-only) share
nothing. Every request's hits come from one replay of all parts in sending order, so each part starts
from what the earlier ones left in the caches. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from workloads.requests import Workload, WorkloadRequest
from workloads.routing import Router

from .queueing import ServedRequest, TargetReplay
from .replay import ReplayResult, replay
from .sequences import embedded_chat_tokens, load_order, requests_block_keys, word_chat_tokens
from .targets import TargetInputs


@dataclass(frozen=True)
class Segment:
    """One load run's requests in sending order; `level` the G3 level it measures (None: the primer)."""

    requests: tuple[WorkloadRequest, ...]
    level: Optional[float] = None
    arrivals_s: dict = field(default_factory=dict)      # rate multipliers: multiplier -> arrival per request


@dataclass(frozen=True)
class G3Replays:
    """Per target, per level: its TargetReplay; the hit figures per target; the arrivals of rate steps."""

    replays: dict                   # role -> {level: TargetReplay}
    hits: dict                      # role -> {"per_tier", "overall", "infinite_cache_bound", "pool_share", "per_level"}
    arrivals_s: dict                # multiplier -> arrival seconds of its part's requests


def g3_segments(g3, workload: Workload) -> list[Segment]:
    """What G3 sends each target, in order: the primer (when `g3.prime`), then the measured parts."""
    from workloads.sweep import closed_loop, primer, rate_multiplied, trace_parts

    segments = []
    if g3.prime:
        warm = primer(workload)
        segments.append(Segment(tuple(r for s in warm.sessions for r in s)))
    if not workload.trace:
        order = tuple(load_order(workload))
        return segments + [Segment(order, level) for level in g3.levels]
    for level, part in zip(g3.levels, trace_parts(workload, len(g3.levels))):
        if g3.replay == "closed_loop":
            segments.append(Segment(tuple(closed_loop(part).requests), level))
        else:
            paced = rate_multiplied(part, level)
            segments.append(Segment(tuple(paced.requests), level,
                                    {level: tuple(r.arrival_s or 0.0 for r in paced.requests)}))
    return segments


def route(segments: Sequence[Segment], nodes: int, routing: str) -> list[list[int]]:
    """The node of each request of each segment: a fresh Router per load run, as each run's process has."""
    routed = []
    for segment in segments:
        router = Router(nodes, routing)
        routed.append([router.pick(request) for request in segment.requests])
    return routed


def g3_replays(g3, workload: Workload, inputs: TargetInputs) -> G3Replays:
    """Every target's requests with their hits per tier and their node, per level (the module's model)."""
    segments = g3_segments(g3, workload)
    tokenizer = embedded_chat_tokens if inputs.embedded else word_chat_tokens
    # a closed loop over a workload measures the same pass at every level: replay it once after the primer
    replayed = segments if workload.trace else [s for s in segments if s.level is None] + segments[-1:]
    keys = [requests_block_keys(s.requests, tokenizer, block_tokens=inputs.block_tokens) for s in replayed]
    flat = [k for part in keys for k in part]
    warm = sum(len(s.requests) for s in replayed if s.level is None)
    capacities = inputs.capacities()
    replays, hits = {}, {}
    for role, nodes in (("candidate", inputs.candidate_nodes), ("baseline", inputs.baseline_nodes)):
        routed = route(replayed, nodes, inputs.routing)
        result = replay(flat, capacities[role], warmup=warm,
                        nodes=[n for part in routed for n in part] if nodes > 1 else None)
        per_level, start = {}, 0
        measured = [(s, r) for s, r in zip(replayed, routed) if s.level is not None]
        for segment, segment_nodes in measured:
            end = start + len(segment.requests)
            per_level[segment.level] = TargetReplay(
                _served(segment.requests, result, start, end, inputs.block_tokens, tokenizer),
                segment_nodes if nodes > 1 else None, nodes)
            start = end
        hits[role] = _hit_figures(result, measured)
        if not workload.trace:  # one pass replayed for every level
            last = segments[-1].level
            per_level = {level: per_level[last] for level in g3.levels}
            hits[role]["per_level"] = {level: hits[role]["per_level"][last] for level in g3.levels}
        replays[role] = per_level
    arrivals = {m: a for s in segments for m, a in s.arrivals_s.items()}
    return G3Replays(replays, hits, arrivals)


def _served(requests: Sequence[WorkloadRequest], result: ReplayResult, start: int, end: int,
            block_tokens: int, tokenizer) -> list[ServedRequest]:
    """Requests [start, end) of the counted replay as the timing model takes them."""
    return [ServedRequest(len(tokenizer(request)), request.max_tokens,
                          {tier: blocks * block_tokens for tier, blocks in zip(result.tiers, result.hits[i]) if blocks})
            for i, request in zip(range(start, end), requests)]


def _hit_figures(result: ReplayResult, measured: list) -> dict:
    per_level, start = {}, 0
    for segment, _ in measured:
        end = start + len(segment.requests)
        blocks = sum(result.prompt_blocks[start:end])
        per_level[segment.level] = sum(sum(row) for row in result.hits[start:end]) / blocks if blocks else 0.0
        start = end
    return {"per_tier": result.hit_ratio, "overall": result.overall_hit_ratio,
            "infinite_cache_bound": result.infinite_cache_bound, "pool_share": result.pool_share_of_hits,
            "per_level": per_level}
