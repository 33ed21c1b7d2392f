"""G3 per level: each target's TTFT p50 and throughput, from per-request service times in a closed loop
(or an open loop of a trace's arrivals), hence the candidate's TTFT p50 reduction and throughput gain
over the baseline (sizing/g3_figures.py judges them as G3 does).

How it works: docs/methods/sizing-model.md (sizing/queueing.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

from kvcore.settings import ConfigError

from .timing import TimingModel, check_number, check_tokens


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one decode step over a batch of b sequences: `step_s + per_sequence_s · b`."""

    step_s: float = 0.0             # s per step (reading the weights once, launching the step)
    per_sequence_s: float = 0.0     # s per generating sequence (its token's FLOPs, its attention)

    def __post_init__(self) -> None:
        check_number("decode.step_s", self.step_s, allow_zero=True)
        check_number("decode.per_sequence_s", self.per_sequence_s, allow_zero=True)

    def seconds(self, batch: float) -> float:
        return self.step_s + self.per_sequence_s * batch

    @classmethod
    def roofline(cls, params: float, layers: int, dim: int, context_tokens: int, device_flops: float,
                 weight_bytes: float = 0.0, memory_gbps: Optional[float] = None) -> "DecodeCost":
        """Per sequence: one token's FLOPs, 2·params + 4·layers·context·dim (its query against every
        earlier key, 2·context·dim per layer, and as much to mix the values), ÷ device FLOP/s; per step:
        reading the weights once, weight_bytes ÷ memory bandwidth (decode at small batches is bound
        by it), 0 when no bandwidth is given."""
        flops = check_number("device_flops", device_flops)
        per_sequence = (2.0 * check_number("params", params)
                        + 4.0 * check_tokens("layers", layers, 1) * check_tokens("context_tokens", context_tokens)
                        * check_tokens("dim", dim, 1)) / flops
        step = 0.0 if memory_gbps is None else check_number("weight_bytes", weight_bytes, True) / (
            check_number("memory_gbps", memory_gbps) * 1e9)
        return cls(step, per_sequence)


@dataclass(frozen=True)
class EngineModel:
    """What a step costs: the TTFT model's loads and recompute curve, the decode cost, the batch limit, the
    machine's step-to-step noise (`jitter`: each step's seconds × a lognormal factor of mean 1 whose log has
    this standard deviation; 0: none), and what the engine's thread spends copying one block into a tier of
    its cache (`block_copy_s`: stored after a prefill, promoted after a hit, demoted; 0: an engine whose cache
    copies nothing, as vLLM's prefix cache keeps its blocks where they were computed). `stall_s`: what the
    server's stalls (a pause of it all now and then) cost a request on average, held by its user after the answer:
    the closed loop loses that time, and the median first token stays where it is."""

    timing: TimingModel
    decode: DecodeCost
    max_running: int = 8
    jitter: float = 0.0
    block_copy_s: float = 0.0
    prefill_budget: Optional[int] = None    # tokens of a prompt a step prefills (None: one cache block, kvgate's)
    stall_s: float = 0.0

    def __post_init__(self) -> None:
        check_tokens("max_running", self.max_running, 1)
        check_number("jitter", self.jitter, allow_zero=True)
        check_number("block_copy_s", self.block_copy_s, allow_zero=True)
        check_number("stall_s", self.stall_s, allow_zero=True)
        if self.prefill_budget is not None:
            check_tokens("prefill_budget", self.prefill_budget, 1)

    def chunks(self, prompt: int, cached: int) -> list[float]:
        """Seconds of each prefill step of a prompt with `cached` tokens loaded: block-aligned chunks of the tail
        (kvgate's engine), or chunks of `prefill_budget` tokens (vLLM's chunked prefill: up to its token budget a
        step), or the one-token pass of a full hit."""
        curve, block = self.timing.curve, self.timing.block_size
        if cached >= prompt:
            return [curve.tail(prompt, cached)]
        costs, start = [], cached
        while start < prompt:
            end = min(start + self.prefill_budget if self.prefill_budget else (start // block + 1) * block, prompt)
            costs.append(curve.compute(end) - curve.compute(start))
            start = end
        return costs


# G3's engines: one for every target, or each target's own ({"baseline": …, "candidate": …}), as a target's steps
# under load may cost what the other's do not (sizing/machine.py's `load_costs`)
Engines = Union[EngineModel, Mapping[str, EngineModel]]


def engine_of(engines: Engines, role: str) -> EngineModel:
    """The engine that serves `role` (a target): the one engine, or the target's own."""
    if isinstance(engines, EngineModel):
        return engines
    if role not in engines:
        raise ConfigError(f"engines: expected an engine for the {role}, found them for {sorted(engines)}")
    return engines[role]


def noisy(engines: Engines) -> bool:
    """Whether any of the engines has step noise (then a prediction is simulated once per seed)."""
    return any(e.jitter for e in ([engines] if isinstance(engines, EngineModel) else engines.values()))


@dataclass(frozen=True)
class ServedRequest:
    """One request of a replay: its prompt, its output tokens, and its cached tokens per tier."""

    prompt_tokens: int
    output_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SimulatedRequest:
    index: int                      # position in the replay
    sent_s: float
    first_token_s: float
    done_s: float
    output_tokens: int
    itl_s: tuple[float, ...]        # gaps between its tokens
    itl_batch: tuple[int, ...]      # the decode batch of the step that ended each gap
    node: int = 0                   # the fleet's node that served it
    client_wait_s: float = 0.0      # open loop: how late it was sent after its arrival (every user busy)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    def record(self) -> dict:
        """As G3's records have it (workloads/traffic/client.py), for G3's own analysis (kvcore/g3_analysis.py)."""
        return {"ok": True, "sent_at": self.sent_s, "ttft_s": self.ttft_s, "e2e_s": self.done_s - self.sent_s,
                "completion_tokens": self.output_tokens, "itl_s": list(self.itl_s),
                "client_wait_s": self.client_wait_s, "node": self.node}


@dataclass
class _Active:
    index: int
    request: ServedRequest
    sent: float
    load: float
    chunks: deque
    generated: int = 0
    first_token: float = 0.0
    last_token: float = 0.0
    itl: list = field(default_factory=list)
    batch: list = field(default_factory=list)
    node: int = 0
    client_wait: float = 0.0


class _Node:
    """One engine's scheduler: requests arriving, waiting (FIFO), running; its clock is the end of its last step."""

    def __init__(self, engine: EngineModel, rng: Optional[np.random.Generator] = None) -> None:
        self.engine, self.t, self.rng = engine, 0.0, rng
        self.arrivals: list = []            # (arrival s, order, _Active), a heap
        self.waiting: deque = deque()
        self.running: list[_Active] = []

    def next_start(self) -> Optional[float]:
        """When its next step starts (None: nothing to do and nothing coming)."""
        if self.waiting or self.running:
            return self.t
        return max(self.t, self.arrivals[0][0]) if self.arrivals else None

    def busy_at(self, t: float) -> bool:
        """Something to run at time t (a request running, waiting, or arrived)."""
        return bool(self.waiting or self.running or (self.arrivals and self.arrivals[0][0] <= t))

    def step(self, sharing: float = 1.0, copied: Callable[[_Active], int] = lambda active: 0
             ) -> list[tuple[_Active, float]]:
        """Run one step (the module's formula) from `next_start()`, its seconds × `sharing` (nodes sharing
        one machine's cores); the requests it finished, with when. `copied(request)`, when a request's first
        token is out: the blocks the engine then copies into its cache (its prompt stored, its hits
        promoted), each `block_copy_s` of the step before its decode."""
        start = self.next_start()
        if start is None:
            raise RuntimeError("a step of a node with nothing to do")   # callers step only a node that has a start
        self.t = start
        engine = self.engine
        while self.arrivals and self.arrivals[0][0] <= self.t:
            self.waiting.append(heapq.heappop(self.arrivals)[2])
        t, step, finished = self.t, 0.0, []
        noise = 1.0
        if engine.jitter and self.rng is not None:
            noise = float(np.exp(engine.jitter * self.rng.standard_normal() - engine.jitter ** 2 / 2))
        while self.waiting and len(self.running) < engine.max_running:
            admitted = self.waiting.popleft()
            step += noise * sharing * admitted.load
            self.running.append(admitted)
        prefilling = next((a for a in self.running if a.chunks), None)
        if prefilling is not None:
            step += noise * sharing * prefilling.chunks.popleft()
            if not prefilling.chunks:
                prefilling.generated, prefilling.first_token = 1, t + step
                prefilling.last_token = prefilling.first_token
                if prefilling.generated >= prefilling.request.output_tokens:
                    finished.append((prefilling, t + step))
                step += sharing * engine.block_copy_s * copied(prefilling)
        batch = [a for a in self.running if not a.chunks and a.generated < a.request.output_tokens]
        if batch:
            step += noise * engine.decode.seconds(len(batch))
            for a in batch:
                a.generated += 1
                a.itl.append(t + step - a.last_token)
                a.batch.append(len(batch))
                a.last_token = t + step
                if a.generated >= a.request.output_tokens:
                    finished.append((a, t + step))
        self.t = t + step
        for a, _ in finished:
            self.running.remove(a)
        return finished


def _checked_replay(requests: Sequence[ServedRequest], engines: Sequence[EngineModel],
                    nodes: Optional[Sequence[int]]) -> list[int]:
    if not requests:
        raise ConfigError("requests: expected at least one request to replay, found none")
    nodes = [0] * len(requests) if nodes is None else list(nodes)
    if len(nodes) != len(requests):
        raise ConfigError(f"nodes: expected a node per request ({len(requests)}), found {len(nodes)}")
    for i, (r, node) in enumerate(zip(requests, nodes)):
        check_tokens(f"requests[{i}].output_tokens", r.output_tokens, 1)
        if type(node) is not int or not 0 <= node < len(engines):
            raise ConfigError(f"nodes[{i}]: expected a node index in 0..{len(engines) - 1}, found {node!r}")
        engines[node].timing.checked(r.prompt_tokens, r.cached)
    return nodes


class LoadSource(Protocol):
    """What the load users send, asked as they send it (a replay fixed beforehand, or G3's blocks served live)."""

    def take(self) -> Optional[int]:
        """The next request a free user sends (an index), or None when none is ready (the user waits)."""

    def serve(self, index: int) -> tuple[ServedRequest, int, Optional[float]]:
        """The request as it is served now: its cached tokens per tier, its node, its arrival (open loop)."""

    def first_token(self, index: int) -> int:
        """Its prompt is computed (its first token is out): the engine stores the prompt's blocks and promotes
        its hits now; the blocks it copied into its cache's tiers doing so."""

    def answered(self, index: int) -> int:
        """Its last token came back (the blocks its output filled are stored); the blocks copied doing so."""


class ReplaySource:
    """Requests in order, each with its hits known beforehand (a replay), cycled when `cycle`."""

    def __init__(self, requests: Sequence[ServedRequest], nodes: Sequence[int], cycle: bool = False,
                 arrivals_s: Optional[Sequence[float]] = None) -> None:
        self.requests, self.nodes, self.arrivals_s = requests, nodes, arrivals_s
        self._order = itertools.cycle(range(len(requests))) if cycle else iter(range(len(requests)))

    def take(self) -> Optional[int]:
        return next(self._order, None)

    def serve(self, index: int) -> tuple[ServedRequest, int, Optional[float]]:
        arrival = None if self.arrivals_s is None else float(self.arrivals_s[index])
        return self.requests[index], self.nodes[index], arrival

    def first_token(self, index: int) -> int:
        return 0    # a replay's hits were decided beforehand: no cache to copy into

    def answered(self, index: int) -> int:
        return 0


def simulate(requests: Sequence[ServedRequest], users: int, engines: EngineModel | Sequence[EngineModel], *,
             duration_s: Optional[float] = None, arrivals_s: Optional[Sequence[float]] = None,
             nodes: Optional[Sequence[int]] = None, seed: int = 0) -> list[SimulatedRequest]:
    """Every request's timeline: `users` load users sending `requests` in order to one engine, or to a
    fleet (`engines`, one per node; `nodes[i]`: the node request i is routed to), each engine stepping
    on its own (the module's model).

    Closed loop (no `arrivals_s`): a user sends its next request as soon as its previous one is answered.
    Open loop (`arrivals_s`, seconds from the start): a free user takes the next request and sends it
    at its arrival time, or at once when it is already late (the wait is `client_wait_s`), as the
    locust users do; with every user busy requests wait in the client. Without a duration the replay
    is sent once; with one, nothing is sent from `duration_s` on (a closed loop cycles the replay, as
    G3's users cycle a workload that a run outlasts) and the requests in flight then finish.
    """
    engines = [engines] if isinstance(engines, EngineModel) else list(engines)
    if not engines:
        raise ConfigError("engines: expected at least one engine, found none")
    nodes = _checked_replay(requests, engines, nodes)
    if arrivals_s is not None and len(arrivals_s) != len(requests):
        raise ConfigError(f"arrivals_s: expected an arrival per request ({len(requests)}), found {len(arrivals_s)}")
    source = ReplaySource(requests, nodes, cycle=duration_s is not None and arrivals_s is None, arrivals_s=arrivals_s)
    return simulate_source(source, users, engines, duration_s=duration_s, seed=seed)


def simulate_source(source: LoadSource, users: int, engines: Sequence[EngineModel], *,
                    duration_s: Optional[float] = None, seed: int = 0,
                    one_machine: bool = False) -> list[SimulatedRequest]:
    """`simulate` with the requests asked of `source` as users send them (a user that finds none ready
    waits until a request is answered, as the locust users wait for a session's turn); `seed` draws
    each node's step noise (EngineModel.jitter), the same for a seed. `one_machine`: the nodes share
    one machine's cores (kvgate's embedded fleet), and each engine's costs were measured with the
    machine to itself, so a step takes as many times its cost as there are nodes busy when it starts."""
    check_tokens("users", users, 1)
    fleet = [_Node(engine, np.random.default_rng([seed, i])) for i, engine in enumerate(engines)]
    counter, done, idle = itertools.count(), [], []

    def send(free: float) -> None:
        if duration_s is not None and free >= duration_s:
            return
        index = source.take()
        if index is None:
            idle.append(free)
            return
        request, node_index, scheduled = source.serve(index)
        scheduled = free if scheduled is None else scheduled
        now = max(free, scheduled)
        if duration_s is not None and now >= duration_s:
            return
        node = fleet[node_index]
        node.engine.timing.checked(request.prompt_tokens, request.cached)
        active = _Active(index, request, now, node.engine.timing.load_seconds(request.cached),
                         deque(node.engine.chunks(request.prompt_tokens, sum(request.cached.values()))),
                         node=node_index, client_wait=now - scheduled)
        heapq.heappush(node.arrivals, (now + node.engine.timing.overhead, next(counter), active))

    for _ in range(users):          # every user at once (a block's locust users send within milliseconds)
        send(0.0)
    while True:
        starts = [(start, i) for i, node in enumerate(fleet) if (start := node.next_start()) is not None]
        if not starts:
            break
        start, chosen = min(starts)
        sharing = sum(node.busy_at(start) for node in fleet) if one_machine else 1
        node, sharing = fleet[chosen], max(1, sharing)
        # a prompt's blocks are stored as its first token comes, before anything sent at the step's end loads
        finished = node.step(sharing, lambda active: source.first_token(active.index))
        for a, at in finished:
            done.append(SimulatedRequest(a.index, a.sent, a.first_token, at, a.generated, tuple(a.itl),
                                         tuple(a.batch), a.node, a.client_wait))
            node.t += sharing * node.engine.block_copy_s * source.answered(a.index)   # its output's blocks
            send(at + node.engine.stall_s)
            waiting, idle[:] = list(idle), []
            for _ in waiting:       # a user that found nothing ready tries again now
                send(at)
    return sorted(done, key=lambda r: r.sent_s)


def simulate_closed_loop(requests: Sequence[ServedRequest], concurrency: int, engine: EngineModel,
                         duration_s: Optional[float] = None) -> list[SimulatedRequest]:
    """Every request's timeline, `concurrency` users in a closed loop on one engine (`simulate`)."""
    check_tokens("concurrency", concurrency, 1)
    return simulate(requests, concurrency, engine, duration_s=duration_s)
