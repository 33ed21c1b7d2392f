"""G3 per concurrency level: each target's TTFT p50 and throughput, from per-request service times in a
closed loop, hence the candidate's TTFT p50 reduction and throughput gain over the baseline.

**The model: a step-level simulation of the engine's own scheduler in a closed loop** (deterministic,
no random numbers). `c` users each send a request, wait for its last token and send the next one,
taking requests in the replay's order (as G3's locust users take turns), with nothing between two
requests but the fixed overhead. One server, the engine, repeats a step::

    step = Σ loads of the requests admitted now        (the cached prefix, read before anything runs)
         + one prefill chunk of the first prefilling request (FIFO; chunks are block-aligned, ≤ 1 block)
         + decode(b) = step_s + per_sequence_s · b      (one token for each of the b generating requests)

at most `max_running` requests at once (the rest wait, FIFO). A chunk covering positions [s, e)
costs compute(e) − compute(s) (the recompute curve, so a request's chunks add up to its uncached
tail: gates/sizing/timing.py); a full hit's only chunk is the one-token pass. A request's first
token comes at the end of its last chunk; it then decodes in that same step, and finishes after its
output tokens. TTFT = first token − sent, the fixed overhead (HTTP, tokenizing: outside the
scheduler thread, so it delays the request, not the others) included; at c = 1 that is exactly
`TimingModel.ttft`, and throughput is outputs / (TTFT + (outputs − 1) · decode(1)).

Why this and not mean-value analysis or processor sharing: (1) G3 judges a p50 and MVA gives only
means; (2) the engine is not a product-form station: its step time depends on the mix of phases
running (a prefill chunk beside a batch of decodes), and prefill is FIFO one chunk per step while
decode is shared by all, neither FCFS-exponential nor PS; (3) the service demands are deterministic
and known request by request (hits and misses from the replay), so simulating the discipline itself
is exact for those costs and takes milliseconds per level. Left out: CPU the write-behind mover and
the load client take from the engine, and a decode step's growth with context length beyond what
`per_sequence_s` absorbs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

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

    def seconds(self, batch: int) -> float:
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
    """What a step costs: the TTFT model's loads and recompute curve, the decode cost, the batch limit."""

    timing: TimingModel
    decode: DecodeCost
    max_running: int = 8

    def __post_init__(self) -> None:
        check_tokens("max_running", self.max_running, 1)

    def chunks(self, prompt: int, cached: int) -> list[float]:
        """Seconds of each prefill step of a prompt with `cached` tokens loaded: block-aligned chunks
        of the tail, or the one-token pass of a full hit."""
        curve, block = self.timing.curve, self.timing.block_size
        if cached >= prompt:
            return [curve.tail(prompt, cached)]
        costs, start = [], cached
        while start < prompt:
            end = min((start // block + 1) * block, prompt)
            costs.append(curve.compute(end) - curve.compute(start))
            start = end
        return costs


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

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s


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


def simulate_closed_loop(requests: Sequence[ServedRequest], concurrency: int, engine: EngineModel,
                         duration_s: Optional[float] = None) -> list[SimulatedRequest]:
    """Every request's timeline, `concurrency` users in a closed loop (the module's model). Without a
    duration the replay is sent once; with one, users send until `duration_s` (the replay cycling, as
    G3's users cycle a workload that a run outlasts) and the requests in flight then finish."""
    check_tokens("concurrency", concurrency, 1)
    if not requests:
        raise ConfigError("requests: expected at least one request to replay, found none")
    for i, r in enumerate(requests):
        check_tokens(f"requests[{i}].output_tokens", r.output_tokens, 1)
        engine.timing.checked(r.prompt_tokens, r.cached)
    order = itertools.cycle(enumerate(requests)) if duration_s is not None else iter(enumerate(requests))
    overhead, arrivals, counter = engine.timing.overhead, [], itertools.count()

    def send(now: float) -> None:
        if duration_s is not None and now >= duration_s:
            return
        nxt = next(order, None)
        if nxt is None:
            return
        index, request = nxt
        active = _Active(index, request, now, engine.timing.load_seconds(request.cached),
                         deque(engine.chunks(request.prompt_tokens, sum(request.cached.values()))))
        heapq.heappush(arrivals, (now + overhead, next(counter), active))

    for _ in range(concurrency):
        send(0.0)
    t, waiting, running, done = 0.0, deque(), [], []
    while arrivals or waiting or running:
        while arrivals and arrivals[0][0] <= t:
            waiting.append(heapq.heappop(arrivals)[2])
        if not waiting and not running:
            t = arrivals[0][0]
            continue
        step, finished = 0.0, []
        while waiting and len(running) < engine.max_running:
            admitted = waiting.popleft()
            step += admitted.load
            running.append(admitted)
        prefilling = next((a for a in running if a.chunks), None)
        if prefilling is not None:
            step += prefilling.chunks.popleft()
            if not prefilling.chunks:
                prefilling.generated, prefilling.first_token = 1, t + step
                prefilling.last_token = prefilling.first_token
                if prefilling.generated >= prefilling.request.output_tokens:
                    finished.append((prefilling, t + step))
        batch = [a for a in running if not a.chunks and a.generated < a.request.output_tokens]
        if batch:
            step += engine.decode.seconds(len(batch))
            for a in batch:
                a.generated += 1
                a.itl.append(t + step - a.last_token)
                a.batch.append(len(batch))
                a.last_token = t + step
                if a.generated >= a.request.output_tokens:
                    finished.append((a, t + step))
        t += step
        for a, at in finished:
            running.remove(a)
            done.append(SimulatedRequest(a.index, a.sent, a.first_token, at, a.generated, tuple(a.itl),
                                         tuple(a.batch)))
            send(at)
    return sorted(done, key=lambda r: r.sent_s)


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


@dataclass(frozen=True)
class LevelPrediction:
    """G3 at one concurrency: every target's figures; the candidate's reduction and gain over the baseline."""

    concurrency: int
    targets: Mapping[str, TargetFigures]

    @property
    def ttft_p50_reduction(self) -> float:
        """1 − candidate TTFT p50 / baseline TTFT p50 (0.31: 31% lower), as G3 computes it."""
        return 1.0 - self.targets["candidate"].ttft_p50_s / self.targets["baseline"].ttft_p50_s

    @property
    def throughput_gain(self) -> float:
        """candidate output tokens/s ÷ baseline's − 1 (0.35: +35%)."""
        return self.targets["candidate"].output_tokens_per_s / self.targets["baseline"].output_tokens_per_s - 1.0


Replay = Sequence[ServedRequest] | Mapping[int, Sequence[ServedRequest]]


def predict_g3(replays: Mapping[str, Replay], levels: Sequence[int], engine: EngineModel,
               duration_s: Optional[float] = None, warmup_s: float = 0.0) -> list[LevelPrediction]:
    """Per level, every target's figures. `replays` maps a target ("baseline", "candidate", and any
    other) to its requests, one list for every level or a list per level (hits may differ with the
    concurrency)."""
    missing = [role for role in ("baseline", "candidate") if role not in replays]
    if missing:
        raise ConfigError(f"replays: expected a baseline and a candidate replay, found none for {missing}")
    predictions = []
    for level in levels:
        figures = {}
        for role, replay in replays.items():
            requests = replay.get(level) if isinstance(replay, Mapping) else replay
            if requests is None:
                raise ConfigError(f"replays.{role}: expected requests for c={level}, found levels {sorted(replay)}")
            figures[role] = summarize(simulate_closed_loop(requests, level, engine, duration_s), warmup_s)
        predictions.append(LevelPrediction(level, figures))
    return predictions
