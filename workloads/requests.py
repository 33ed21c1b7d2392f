"""What a workload hands the load engine: sessions of requests, independent of any target.

A session is a user's conversation: its requests run in order, one at a time.
Workloads are fully determined by their spec and seed; the history of a
multi-round session carries synthetic answers of the configured length, so
baseline and candidate targets receive exactly the same prompts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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
