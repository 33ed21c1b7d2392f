"""Locust users that drive a kvgate workload through the streaming client.

Run by `workloads.loadgen.load` in its own process (gevent patches the interpreter),
standalone or as master + workers. Its settings come from the JSON file named
by KVGATE_LOAD_CONFIG. Figures come from our per-request records (appended as
each request completes), never from locust's rounded statistics; locust
provides users, spawning, run time and distribution.

Every due request is accounted for: a request with an arrival time (open loop) is due when that
time falls within the run (`run_time_s`); one that is past it is never sent. When the run stops,
each process writes `due-<worker>.json`: the due requests it never sent (all users busy, or late)
and those it sent that never finished, each with when it was due (`workloads.loadgen.load.read_unanswered`).
A later turn of a session has no arrival time: it is due once sent (its previous turn answered).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import gevent
import psutil
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from workloads.traffic.client import RecordWriter, RequestRecord, StreamingClient
from workloads.traffic.errors import DeadTargetDetector, StopRule
from workloads.traffic.requests import WorkloadRequest, load_workload
from workloads.traffic.routing import Router

SETTINGS = json.loads(Path(os.environ["KVGATE_LOAD_CONFIG"]).read_text())
WORKLOAD = load_workload(SETTINGS["workload_path"])
RECORDS = Path(SETTINGS["records_dir"])
ROUTERS: dict[str, Router] = {}  # one router per process, shared by its users (round-robin across all of them)


@dataclass
class _Run:
    """This process's part of the run, from its test start (a master has none: it only coordinates)."""

    start: float
    worker: str
    mine: list[int]                       # the workload's sessions this process sends
    next_session: Iterator[int]           # not interleaved: the next of them a user runs whole, cycling
    # interleaved: sessions wait in a round-robin queue; a user takes the first one's next turn and
    # puts the session back at the end once the turn is answered
    ready: collections.deque[int]
    turn: dict[int, int]                  # interleaved: each session's next turn
    writer: RecordWriter
    detector: Optional[DeadTargetDetector]
    sent: int = 0
    done: int = 0
    stopped: bool = False
    in_flight: dict[str, tuple[float, float]] = field(default_factory=dict)   # request id: (scheduled, sent)
    finished: set[str] = field(default_factory=set)


_run: Optional[_Run] = None


def _this_run() -> _Run:
    """This process's run (its users and its client sampler start only after its test start made it)."""
    if _run is None:
        raise RuntimeError("locustfile: this process has no run yet (its test has not started)")
    return _run


def _worker_slot(environment) -> tuple[int, int]:
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        return runner.worker_index, max(1, int(SETTINGS.get("workers", 1)))
    return 0, 1


@events.test_start.add_listener
def _on_test_start(environment, **_):
    global _run
    if isinstance(environment.runner, MasterRunner):
        return  # the master only coordinates; its workers send and record
    index, count = _worker_slot(environment)
    start, worker = time.time(), f"w{index}-{os.getpid()}"
    # worker i takes sessions i, i + count, i + 2*count, ... cycling when a run outlasts the workload
    mine = list(range(index, len(WORKLOAD.sessions), count)) or [0]
    rule = SETTINGS.get("stop_rule")
    _run = _Run(start, worker, mine, itertools.cycle(mine), collections.deque(mine), dict.fromkeys(mine, 0),
                RecordWriter(RECORDS, worker), DeadTargetDetector(StopRule(**rule)) if rule else None)
    gevent.spawn(_sample_client_load, environment)


def _sample_client_load(environment) -> None:
    """Once a second: this process's CPU and how late the event loop wakes up (client saturation)."""
    process = psutil.Process()
    process.cpu_percent(None)
    path = RECORDS / f"client-{_this_run().worker}.jsonl"
    with open(path, "a", buffering=1) as out:
        while True:
            before = time.perf_counter()
            gevent.sleep(SETTINGS.get("sample_interval_s", 1.0))
            lag = time.perf_counter() - before - SETTINGS.get("sample_interval_s", 1.0)
            out.write(json.dumps({"t": time.time(), "cpu_percent": process.cpu_percent(None),
                                  "loop_lag_s": max(0.0, lag)}) + "\n")


@events.test_stop.add_listener
def _on_test_stop(environment, **_):
    """Once the users are stopped: this process's due requests that were never sent or never finished."""
    run = _run
    if isinstance(environment.runner, MasterRunner) or run is None:
        return
    horizon = SETTINGS.get("run_time_s")
    not_sent = [{"request_id": r.request_id, "scheduled_at": run.start + r.arrival_s, "sent_at": None,
                 "state": "not_sent"}
                for i in run.mine for r in WORKLOAD.sessions[i]
                if r.arrival_s is not None and (horizon is None or r.arrival_s <= horizon)
                and r.request_id not in run.in_flight and r.request_id not in run.finished]
    unfinished = [{"request_id": request_id, "scheduled_at": scheduled, "sent_at": sent, "state": "unfinished"}
                  for request_id, (scheduled, sent) in run.in_flight.items()]
    (RECORDS / f"due-{run.worker}.json").write_text(json.dumps(not_sent + unfinished))


class WorkloadUser(User):
    wait_time = constant(0)

    def on_start(self) -> None:
        target = SETTINGS["target"]
        api_key = os.environ.get(target.get("api_key_env") or "", "") or None
        urls = target.get("nodes") or [target["url"]]
        self.clients = [StreamingClient(url, target["model"], target.get("api", "chat"), api_key,
                                        target.get("name", "target"), temperature=target.get("temperature", 0.0))
                        for url in urls]
        self.node_urls = urls if len(urls) > 1 else [None]
        self.router = ROUTERS.setdefault("router", Router(len(urls), target.get("routing", "round-robin")))
        for client in self.clients:  # before its first turn: it sends each turn as it takes it, in the users' order
            client.connect()

    def on_stop(self) -> None:
        for client in self.clients:
            client.close()

    @task
    def run_session(self) -> None:
        if WORKLOAD.interleaved:
            self._run_next_turn()
            return
        for request in WORKLOAD.sessions[next(_this_run().next_session)]:
            self._send(request)

    def _run_next_turn(self) -> None:
        run = _this_run()
        ready = run.ready
        if not ready:  # more users than sessions: every session has a turn in flight
            gevent.sleep(0.01)
            return
        index = ready.popleft()
        session = WORKLOAD.sessions[index]
        try:
            self._send(session[run.turn[index]])
        finally:
            run.turn[index] = (run.turn[index] + 1) % len(session)
            ready.append(index)

    def _send(self, request: WorkloadRequest) -> None:
        run = _this_run()
        limit = SETTINGS.get("max_requests_per_worker")
        if limit is not None and run.sent >= limit:
            raise StopUser()
        horizon = SETTINGS.get("run_time_s")
        if request.arrival_s is not None and horizon is not None and request.arrival_s > horizon:
            raise StopUser()  # due after the run's end: not part of it (and nor are the later arrivals)
        run.sent += 1  # counted before waiting for its arrival, so users asleep meanwhile stop at the budget
        scheduled = time.time()
        if request.arrival_s is not None:
            scheduled = run.start + request.arrival_s
            gevent.sleep(max(0.0, scheduled - time.time()))
        node = self.router.pick(request)
        run.in_flight[request.request_id] = (scheduled, time.time())
        record = self.clients[node].send(request, scheduled_at=scheduled)
        record.node = self.node_urls[node]
        run.writer.write(record)
        del run.in_flight[request.request_id]
        run.finished.add(request.request_id)
        run.done += 1
        _stop_if_dead(self.environment, run, record)
        if limit is not None and run.done >= limit:
            gevent.spawn(self.environment.runner.quit)  # the budget is spent: end the run now
        self.environment.events.request.fire(
            request_type="STREAM", name=self.clients[node].target, response_time=(record.e2e_s or 0) * 1000,
            response_length=record.completion_tokens or 0,
            exception=None if record.ok else RuntimeError(record.error_type), context={},
        )


def _stop_if_dead(environment, run: _Run, record: RequestRecord) -> None:
    """End this process's run once its target stopped answering (the stop rule), saying why in stop-*.jsonl."""
    detector = run.detector
    if detector is None or run.stopped or not detector.observe(record.error_type, record.error_message):
        return
    run.stopped = True
    now = time.time()
    row = {"at": now, "t_s": now - run.start, "worker": run.worker, "errors_in_a_row": detector.in_a_row,
           "error_type": record.error_type, "reason": f"{detector.reason()} at t={now - run.start:.1f} s"}
    with open(RECORDS / f"stop-{run.worker}.jsonl", "a") as out:
        out.write(json.dumps(row) + "\n")
    gevent.spawn(environment.runner.quit)
