"""G3's workload as each target serves it: the requests of every step in the order G3's load sends them,
the node each goes to, and the hits each one gets from each tier (replayed through the target's tiers).

How it works: docs/methods/sizing-model.md (sizing/g3_inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from kvcore.block_pairs import level_looks
from kvcore.settings import ConfigError
from workloads.loadgen.steady import cached_share, order_segment, requests_per_part, warm_up_end
from workloads.loadgen.sweep import closed_loop, primer, rate_multiplied, trace_parts
from workloads.traffic.requests import Workload, WorkloadRequest, load_order
from workloads.traffic.routing import Router, Routing

from .g3_figures import LevelPrediction, TargetReplay, combine, pairs_prediction
from .queueing import Engines, ServedRequest, SimulatedRequest, engine_of, noisy, simulate_source
from .replay import (
    POOL_TIER,
    CacheSimulator,
    Key,
    ReplayResult,
    RequestKeys,
    TierCapacity,
    infinite_cache_hits,
    replay,
)
from .sequences import embedded_chat_tokens, requests_block_keys, word_chat_tokens
from .settings import G3Section
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
    hits: dict                      # role -> {"per_tier", "overall", "infinite_cache_bound", "pool_share", "per_level",
    #                                            "bound_per_level": the infinite cache's bound over each level's part}
    arrivals_s: dict                # multiplier -> arrival seconds of its part's requests


def g3_segments(g3: G3Section, workload: Workload) -> list[Segment]:
    """What G3 sends each target, in order: the primer (when `g3.prime`), then the measured parts."""
    segments = []
    if g3.prime:
        warm = primer(workload)
        segments.append(Segment(tuple(load_order(warm))))
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


def primer_spared(g3: G3Section, workload: Workload, inputs: TargetInputs) -> dict[str, int]:
    """Per compared target, how many of the primer's first requests it can be spared: the most whose leaving out
    ends priming with its caches holding the same blocks, in the same order of use, as after the whole primer (the
    simulation of its levels: the cache's own placement over their capacities), every level full, so whatever the
    target held before G3 is evicted either way. A baseline whose device tier holds a few prompts keeps only the
    primer's last ones; a candidate whose disk holds them all is sent all. 0 where the simulation is not exact
    for the target: an external engine (its tokens approximated), a fleet, a trace's warm-up, no priming."""
    roles = {"candidate": inputs.candidate_nodes, "baseline": inputs.baseline_nodes}
    if not g3.prime or workload.trace or not inputs.embedded:
        return dict.fromkeys(roles, 0)
    keys = requests_block_keys(load_order(primer(workload)), embedded_chat_tokens, block_tokens=inputs.block_tokens)
    capacities = inputs.capacities()
    return {role: 0 if nodes > 1 else _spared(keys, capacities[role]) for role, nodes in roles.items()}


def _spared(keys: Sequence[RequestKeys], capacities: Sequence[TierCapacity]) -> int:
    whole = _primed(keys, capacities)
    if not whole.full():
        return 0
    after_all = whole.state()
    return next((first for first in range(len(keys) - 1, 0, -1)
                 if _primed(keys[first:], capacities).state() == after_all), 0)


def _primed(keys: Sequence[RequestKeys], capacities: Sequence[TierCapacity]) -> CacheSimulator:
    """A cache of `capacities`, empty, after serving the requests in order."""
    cache = CacheSimulator(capacities)
    for request in keys:
        cache.serve(request)
    return cache


def route(segments: Sequence[Segment], nodes: int, routing: Routing) -> list[list[int]]:
    """The node of each request of each segment: a fresh Router per load run, as each run's process has."""
    routed = []
    for segment in segments:
        router = Router(nodes, routing)
        routed.append([router.pick(request) for request in segment.requests])
    return routed


def g3_replays(g3: G3Section, workload: Workload, inputs: TargetInputs) -> G3Replays:
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
        per_level, bounds, start = {}, {}, 0
        measured = [(s, r) for s, r in zip(replayed, routed) if s.level is not None]
        for segment, segment_nodes in measured:
            end = start + len(segment.requests)
            per_level[segment.level] = TargetReplay(
                _served(segment.requests, result, start, end, inputs.block_tokens, tokenizer),
                segment_nodes if nodes > 1 else None, nodes)
            bounds[segment.level] = _bound(result, start, end)
            start = end
        hits[role] = _hit_figures(result, measured)
        hits[role]["per_level"] = {level: _token_hit_ratio(replay.requests) for level, replay in per_level.items()}
        if not workload.trace:  # one pass replayed for every level: the same figures (and bound) at each
            last = segments[-1].level
            per_level = {level: per_level[last] for level in g3.levels}
            hits[role]["per_level"] = {level: hits[role]["per_level"][last] for level in g3.levels}
            bounds = {level: bounds[last] for level in g3.levels}
        hits[role]["bound_per_level"] = bounds
        replays[role] = per_level
    arrivals = {m: a for s in segments for m, a in s.arrivals_s.items()}
    return G3Replays(replays, hits, arrivals)


def _served(requests: Sequence[WorkloadRequest], result: ReplayResult, start: int, end: int,
            block_tokens: int, tokenizer) -> list[ServedRequest]:
    """Requests [start, end) of the counted replay as the timing model takes them."""
    return [ServedRequest(len(tokenizer(request)), request.max_tokens,
                          {tier: blocks * block_tokens for tier, blocks in zip(result.tiers, result.hits[i]) if blocks})
            for i, request in zip(range(start, end), requests)]


def _token_hit_ratio(requests: Sequence[ServedRequest]) -> float:
    """G3's hit ratio: cached tokens ÷ prompt tokens (a prompt's tail beyond its last whole block is never cached)."""
    prompt = sum(r.prompt_tokens for r in requests)
    return sum(sum(r.cached.values()) for r in requests) / prompt if prompt else 0.0


def _bound(result: ReplayResult, start: int, end: int) -> float:
    """The infinite cache's bound over counted requests [start, end): a level's own part of the replay
    (each part starts from what the earlier ones stored, as G3's steps do)."""
    prompt = sum(result.prompt_blocks[start:end])
    return sum(result.seen_blocks[start:end]) / prompt if prompt else 0.0


def _hit_figures(result: ReplayResult, measured: list) -> dict:
    """The replay's figures in blocks (per tier, overall, the infinite cache's, the pool's share)."""
    return {"per_tier": result.hit_ratio, "overall": result.overall_hit_ratio,
            "infinite_cache_bound": result.infinite_cache_bound, "pool_share": result.pool_share_of_hits}


# --------------------------------------------------------------------------- G3's matched blocks


class BlockSource:
    """One of G3's matched blocks (workloads/loadgen/blocks.py): a segment of the load order, each request sent once and
    in order by whichever user is free, routed by the block's own router (each block is a load run of its own),
    each request's cache operations made when the engine makes them: its prefix loaded as it is sent (admitted at
    once below max_running), its prompt's blocks stored and its hits promoted when its first token comes (after
    its prefill), the blocks its output fills when it is answered. So a block's first c requests, sent together,
    load before any of them stores, and a request still computing its prompt has evicted nothing yet."""

    def __init__(self, requests: Sequence[WorkloadRequest], caches: list[CacheSimulator], keys: dict[str, RequestKeys],
                 tokens: dict[str, int], block_tokens: int, router: Router) -> None:
        self.requests, self.caches, self.keys, self.tokens = list(requests), caches, keys, tokens
        self.block_tokens, self.router = block_tokens, router
        self.served: dict[int, tuple[RequestKeys, list[int], int]] = {}   # per send: its keys, hit row, node
        self._next = 0

    def take(self) -> Optional[int]:
        if self._next >= len(self.requests):
            return None
        self._next += 1
        return self._next - 1

    def serve(self, index: int) -> tuple[ServedRequest, int, None]:
        request = self.requests[index]
        node, keys = self.router.pick(request), self.keys[request.request_id]
        cache = self.caches[node]
        row = cache.load(keys.prompt)
        self.served[index] = (keys, row, node)
        cached = {tier: n * self.block_tokens for tier, n in zip(cache.names, row) if n}
        return ServedRequest(self.tokens[request.request_id], request.max_tokens, cached), node, None

    def first_token(self, index: int) -> int:
        keys, row, node = self.served[index]
        return self._copied(node, lambda cache: cache.after_prefill(keys, sum(row)))

    def answered(self, index: int) -> int:
        keys, _, node = self.served[index]
        return self._copied(node, lambda cache: cache.store(keys.output))

    def _copied(self, node: int, operation: Callable[[CacheSimulator], object]) -> int:
        """The blocks `operation` on the node's cache copied into its tiers."""
        cache = self.caches[node]
        before = cache.blocks_written
        operation(cache)
        return cache.blocks_written - before


def matched_blocks(g3: G3Section, workload: Workload, inputs: TargetInputs) -> bool:
    """Whether G3's closed loop over this workload is simulated block by block as G3 runs it (matched pairs of
    segments of an interleaved load order)."""
    return g3.replay == "closed_loop" and not workload.trace and workload.interleaved


WARMUP_PAIRS = 1    # the pairs G3's steady rule leaves out on a candidate's TTFT (it settles at pair 2 or later)


def concurrencies(g3: G3Section) -> list[int]:
    """G3's levels as its closed loop's concurrencies (gates.config.G3Config checks they are integers there)."""
    levels = [level for level in g3.levels if isinstance(level, int)]
    if g3.replay != "closed_loop" or len(levels) != len(g3.levels):
        raise ConfigError(f"g3.levels: expected concurrencies (integers >= 1) of a closed loop, found "
                          f"{list(g3.levels)} (replay: {g3.replay})")
    return levels


@dataclass
class _Counted:
    """One target's measured blocks over the sweep."""

    per_level: dict[int, list[float]]                       # each measured block's hit ratio (cached ÷ prompt tokens)
    rows: list[list[int]] = field(default_factory=list)     # each measured request's hit blocks per level
    blocks: int = 0                                         # their prompt blocks
    bound: int = 0                                          # the prompt blocks an infinite cache would have served


@dataclass(frozen=True)
class _Block:
    """One target's simulated block: its requests as served, each one's hit blocks per tier, its prompt tokens and
    blocks, and the prompt blocks an infinite cache would have served."""

    done: list[SimulatedRequest]
    rows: list[list[int]]
    prompt_tokens: list[int]
    prompt_blocks: int
    bound: int

    def cached_tokens(self, block_tokens: int) -> int:
        return sum(map(sum, self.rows)) * block_tokens


def simulate_blocks(g3: G3Section, workload: Workload, inputs: TargetInputs, engines: Engines,
                    seeds: Sequence[int] = (0,), share_block_tokens: Optional[int] = None
                    ) -> tuple[list[LevelPrediction], dict[str, dict]]:
    """G3's closed loop as G3 runs it (workloads/loadgen/blocks.py, matched): level after level, pairs of blocks, each
    block both targets' serving of one segment of the load order (the first level's segments 8 requests a user,
    the later ones what the baseline answered in `duration_s` at the level before, `steady.requests_per_part`), its
    warm-up pairs left out, then `g3.blocks.min` measured; each target's caches carried from the primer through
    every block, as its servers carry them. The warm-up: where G3 judges the candidate's cached share of its prompts'
    whole blocks (`share_block_tokens`, the block size it judges them in), G3's own steady rule on the simulated
    blocks' shares; else `WARMUP_PAIRS`. Returns (a LevelPrediction per level, hit figures per target, each with the
    levels' warm-up pairs); with noise (an engine's jitter), the whole sweep once per seed, each level's runs combined
    (`g3_figures.combine`). `engines`: one engine for both targets, or each target's own."""
    tokenizer = embedded_chat_tokens if inputs.embedded else word_chat_tokens
    everything = [r for s in workload.sessions for r in s]
    keys = dict(zip((r.request_id for r in everything),
                    requests_block_keys(everything, tokenizer, block_tokens=inputs.block_tokens)))
    tokens = {r.request_id: len(tokenizer(r)) for r in everything}
    capacities = inputs.capacities()
    primer = g3_segments(g3, workload)[0].requests if g3.prime else ()
    seeds = seeds if noisy(engines) else seeds[:1]
    levels = concurrencies(g3)
    rule = g3.steady.rule()
    runs: dict[int, list[LevelPrediction]] = {level: [] for level in levels}
    counted = {role: _Counted({level: [] for level in levels}) for role in ("candidate", "baseline")}
    roles = (("baseline", inputs.baseline_nodes), ("candidate", inputs.candidate_nodes))
    names: dict[str, tuple[str, ...]] = {}
    warmup: dict[int, int] = {}             # each level's warm-up pairs (the first seed's)

    def serve(segment, level: int, caches, seen, seed: int) -> dict[str, _Block]:
        """Both targets' blocks of one segment, each request's hits and stores on that target's caches."""
        served = {}
        for role, nodes in roles:
            source = BlockSource(segment, caches[role], keys, tokens, inputs.block_tokens,
                                 Router(nodes, inputs.routing))
            done = simulate_source(source, level, [engine_of(engines, role)] * nodes, seed=seed,
                                   one_machine=inputs.embedded)   # each block's own noise, the same per seed
            bound = sum(infinite_cache_hits(seen[role], source.served[index][0])   # every send, in order
                        for index in range(len(segment)))
            served[role] = _Block(done, [source.served[r.index][1] for r in done],
                                  [tokens[segment[r.index].request_id] for r in done],
                                  sum(len(source.served[r.index][0].prompt) for r in done), bound)
        return served

    def share(block: _Block) -> Optional[float]:
        """The block's cached share of its prompts' whole blocks, read as G3's steady rule reads its records."""
        return cached_share([{"ok": True, "prompt_tokens": n, "cached_tokens": sum(row) * inputs.block_tokens}
                             for n, row in zip(block.prompt_tokens, block.rows)], share_block_tokens)

    for seed in seeds:
        caches: dict[str, list[CacheSimulator]] = {}
        seen: dict[str, set[Key]] = {}
        for role, nodes in roles:
            caches[role] = CacheSimulator.fleet(nodes, capacities[role])
            names[role] = caches[role][0].names
            seen[role] = set()              # what an infinite cache would hold, in this run's send order
            router = Router(nodes, inputs.routing)
            for request in primer:
                caches[role][router.pick(request)].serve(keys[request.request_id])
                infinite_cache_hits(seen[role], keys[request.request_id])
        start, block = 0, 0
        rate: Optional[float] = None
        for level in levels:
            count = requests_per_part(workload, level, rate, g3.duration_s)
            pairs: list[dict[str, _Block]] = []
            first: Optional[int] = None if share_block_tokens else WARMUP_PAIRS
            while first is None or len(pairs) < first + g3.blocks.min:
                block += 1
                pairs.append(serve(order_segment(workload, start, count).requests, level, caches, seen,
                                   seed * 10_000 + block))
                start += count
                done = pairs[-1]["baseline"].done
                span = max(r.done_s for r in done) - min(r.sent_s for r in done)
                if span > 0:
                    rate = len(done) / span             # what sizes the next level's segments, as in G3
                if first is None:                       # G3's warm-up on the candidate's shares (blocks.py)
                    end = warm_up_end([{"cached_share": share(p["candidate"])} for p in pairs], len(pairs), rule)
                    first = None if end is None else end[0]
            warmup.setdefault(level, first)
            measured = pairs[first:first + g3.blocks.min]
            for role, _ in roles:
                for served in (p[role] for p in measured):
                    prompt_tokens = sum(served.prompt_tokens)
                    counted[role].per_level[level].append(   # as G3 measures it: cached ÷ prompt tokens
                        served.cached_tokens(inputs.block_tokens) / prompt_tokens if prompt_tokens else 0.0)
                    counted[role].rows += served.rows
                    counted[role].blocks += served.prompt_blocks
                    counted[role].bound += served.bound
            runs[level].append(pairs_prediction(level, [{role: p[role].done for role, _ in roles} for p in measured],
                                                g3.min_requests, level_looks(g3.blocks.max)))
    hits = {}
    for role, c in counted.items():
        totals = {name: sum(row[i] for row in c.rows) for i, name in enumerate(names[role])}
        hit, blocks = sum(totals.values()), c.blocks
        hits[role] = {"per_tier": {name: n / blocks if blocks else 0.0 for name, n in totals.items()},
                      "overall": hit / blocks if blocks else 0.0,
                      "infinite_cache_bound": c.bound / blocks if blocks else 0.0,
                      "per_level": {level: float(np.mean(v)) for level, v in c.per_level.items()},
                      "pool_share": totals[POOL_TIER] / hit if POOL_TIER in totals and hit else None,
                      "warmup_pairs": dict(warmup)}
    return [combine(runs[level]) for level in levels], hits
