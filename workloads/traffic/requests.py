"""What a workload hands the load engine: sessions of requests, independent of any target.

A session is a user's conversation: its requests run in order, one at a time.
Workloads are fully determined by their spec and seed; the history of a
multi-round session carries synthetic answers of the configured length, so
baseline and candidate targets receive exactly the same prompts.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str                 # unique within the workload
    session_id: str                 # requests of one session run in order
    turn: int                       # 0-based position within the session
    messages: tuple[dict, ...]      # chat messages [{"role": ..., "content": ...}, ...]
    max_tokens: int
    prompt_tokens: int              # intended prompt size in tokens (as sized by the workload's text sizer)
    arrival_s: Optional[float] = None  # scheduled offset from the start (trace replay); None: as soon as possible

    def prompt_text(self) -> str:
        """The messages as one plain prompt, for the completions API."""
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[tuple[WorkloadRequest, ...], ...]
    # False: a load user runs a session's turns back to back. True: load users take turns of all
    # sessions round-robin (a session's next turn after every other session's), one at a time per session.
    interleaved: bool = False
    # True: the sessions are a trace's requests in the trace's order; a replay sends each at most once
    # (never cycling) and priming sends `warmup`, the trace's requests before them, never these.
    trace: bool = False
    warmup: tuple[tuple[WorkloadRequest, ...], ...] = ()

    @property
    def requests(self) -> list[WorkloadRequest]:
        return [r for session in self.sessions for r in session]


def save_workload(workload: Workload, path) -> None:
    """Write a workload as JSON (the load engine's processes read it back)."""
    Path(path).write_text(json.dumps({"name": workload.name, "interleaved": workload.interleaved,
                                      "sessions": [[asdict(r) for r in s] for s in workload.sessions]}))


def load_workload(path) -> Workload:
    data = json.loads(Path(path).read_text())
    sessions = tuple(
        tuple(WorkloadRequest(**{**r, "messages": tuple(r["messages"])}) for r in session)
        for session in data["sessions"]
    )
    return Workload(data["name"], sessions, data.get("interleaved", False))


def of_pass(request: WorkloadRequest, number: int) -> WorkloadRequest:
    """The request as sent again in pass `number` over a workload (a capacity probe going round it), under its id with
    the pass added ("u3-t1~2"), as ids are unique in a workload; the first pass's (0) unchanged."""
    if not number:
        return request
    return replace(request, request_id=f"{request.request_id}~{number}", session_id=f"{request.session_id}~{number}")


def load_order(workload: Workload, passes: int = 1) -> list[WorkloadRequest]:
    """The requests in the order one load user sends them (`workloads.loadgen.locustfile`), `passes` times over.

    Interleaved: sessions wait in a round-robin queue and each send takes the first session's next
    turn (cycling through its turns); otherwise sessions one after another, each session's turns
    back to back. A trace: its warm-up requests, then its measured ones, once (passes ignored).
    Several users send the same sequence with up to that many requests in flight.
    """
    if workload.trace:
        return [r for s in workload.warmup for r in s] + workload.requests
    total = passes * sum(len(s) for s in workload.sessions)
    if not workload.interleaved:
        return list(itertools.islice(itertools.chain.from_iterable(itertools.cycle(workload.sessions)), total))
    ready, turn = deque(range(len(workload.sessions))), [0] * len(workload.sessions)
    order: list[WorkloadRequest] = []
    while len(order) < total:
        index = ready.popleft()
        session = workload.sessions[index]
        order.append(session[turn[index]])
        turn[index] = (turn[index] + 1) % len(session)
        ready.append(index)
    return order
