"""Run the locustfile headless: one process (forked from one that imported locust: locust_process.py), or a master
with N workers on loopback in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from kvcore.files import JsonlTail, read_jsonl
from workloads.loadgen.locust_process import ForkedLocust, start_locust
from workloads.traffic.errors import StopRule
from workloads.traffic.processes import die_with_parent, free_port
from workloads.traffic.requests import Workload, save_workload
from workloads.traffic.target import Target

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
LoadProcess = Union[subprocess.Popen, ForkedLocust]
STOP_WAIT_S = 30.0          # a load told to stop early: its users' requests in flight end (--stop-timeout 5)


@dataclass
class LoadRun:
    records_dir: Path
    started_at: float
    ended_at: float
    returncode: int
    log: str
    stopped: Optional[dict] = None   # the first load process that judged the target dead: {"reason", "at", ...}
    # due requests with no record: {"request_id", "scheduled_at", "sent_at" (None: never sent), "state":
    # "not_sent" | "unfinished"} (workloads/loadgen/locustfile.py says when a request is due)
    unanswered: list = field(default_factory=list)
    ended_early: bool = False        # `on_progress` asked the load to end before its time or requests ran out


@dataclass(frozen=True)
class LoadProgress:
    """What a running load recorded since it last said (`run_load`'s `on_progress`, every `progress_every_s`)."""

    started_at: float
    elapsed_s: float
    new_records: list[dict]        # request records landed since the previous call, in no particular order


def run_load(workload: Workload, target: Target, users: int, duration_s: float, out_dir: Path,
             workers: int = 0, max_requests: Optional[int] = None, sample_interval_s: float = 1.0,
             stop_rule: Optional[StopRule] = None,
             on_progress: Optional[Callable[[LoadProgress], Optional[bool]]] = None,
             progress_every_s: float = 2.0) -> LoadRun:
    """Drive `users` concurrent sessions for `duration_s` (or until `max_requests`); records land in out_dir.

    With a `stop_rule` a load process that sees the target stop answering ends the run early
    (`LoadRun.stopped` says why); without one the load goes on, backing off, to the end.
    `on_progress` is told every `progress_every_s` while the load runs what it recorded meanwhile
    (the records are read from where the previous call stopped, never whole again); when it returns True
    the load ends there (`LoadRun.ended_early`): locust is told to stop (SIGTERM), its users' requests in
    flight end, and every record that landed stays.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    records_dir = out_dir / "records"
    if records_dir.exists() and any(records_dir.iterdir()):
        raise FileExistsError(f"{records_dir}: already holds records of another run; use a fresh directory")
    save_workload(workload, out_dir / "workload.json")
    per_worker = None if max_requests is None else -(-max_requests // max(1, workers))
    run_time_s = max(1, round(duration_s))
    settings = {"run_time_s": run_time_s, "workload_path": str(out_dir / "workload.json"),
                "records_dir": str(records_dir),
                "target": asdict(target), "workers": max(1, workers), "max_requests_per_worker": per_worker,
                "sample_interval_s": sample_interval_s, "stop_rule": asdict(stop_rule) if stop_rule else None}
    (out_dir / "load.json").write_text(json.dumps(settings, indent=1))
    env = {**os.environ, "KVGATE_LOAD_CONFIG": str(out_dir / "load.json")}
    options = ["-f", str(LOCUSTFILE), "--loglevel", "WARNING"]
    headless = options + ["--headless", "-u", str(users), "-r", str(users), "-t", f"{run_time_s}s",
                          "--stop-timeout", "5", "--only-summary", "--exit-code-on-error", "0", "--host", target.url]
    base, main = [sys.executable, "-m", "locust", *options], [sys.executable, "-m", "locust", *headless]
    log_path = out_dir / "locust.log"
    started = time.time()
    tail = JsonlTail(records_dir, "records-*.jsonl")
    ended_early: list[float] = []       # when on_progress asked the load to end

    def tell() -> bool:
        if on_progress is None or not on_progress(LoadProgress(started, time.time() - started, tail.read_new())):
            return False
        ended_early.append(time.time())
        return True

    with open(log_path, "w") as log:
        if workers <= 0:
            proc = start_locust(headless, env, log)     # forked from a process that imported locust once
            try:
                returncode = _wait(proc, duration_s + 120, tell, progress_every_s)
            finally:
                _end(proc)
        else:
            returncode = _run_distributed(main, base, workers, env, log, duration_s, tell, progress_every_s)
    stops = sorted(read_jsonl(records_dir, "stop-*.jsonl"), key=lambda row: row["at"])
    return LoadRun(records_dir, started, time.time(), returncode, log_path.read_text(), stops[0] if stops else None,
                   read_unanswered(records_dir), ended_early=bool(ended_early))


def read_unanswered(records_dir: Path) -> list[dict]:
    """Every load process's due requests that have no record (never sent, or unfinished when the run ended)."""
    rows = []
    for path in sorted(records_dir.glob("due-*.json")):
        rows.extend(json.loads(path.read_text()))
    return rows


def _wait(process: LoadProcess, timeout_s: float, tell: Callable[[], Optional[bool]], every_s: float) -> int:
    """The process's exit code, calling `tell` every `every_s` while it runs (TimeoutExpired past `timeout_s`);
    when `tell` returns True the process is told to stop (SIGTERM: locust stops its users and ends the test, so
    its due files are written) and waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return process.wait(timeout=max(0.0, min(every_s, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
            if tell():
                process.send_signal(signal.SIGTERM)
                try:
                    return process.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:     # records already written stay; the process goes
                    process.kill()
                    return process.wait()


def _end(process: LoadProcess) -> None:
    """Kill a load process still running (a timeout, or an error while it ran) and reap it."""
    if process.poll() is None:
        process.kill()
        process.wait()


def _run_distributed(main: list[str], base: list[str], workers: int, env: dict, log, duration_s: float,
                     tell: Callable[[], Optional[bool]], every_s: float) -> int:
    port = free_port()
    master = subprocess.Popen(main + ["--master", "--expect-workers", str(workers), "--master-bind-host",
                                      "127.0.0.1", "--master-bind-port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    worker_procs = [subprocess.Popen(base + ["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
                    for _ in range(workers)]
    try:
        returncode = _wait(master, duration_s + 120, tell, every_s)
        for proc in worker_procs:
            proc.wait(timeout=30)
        return returncode
    finally:
        for proc in [master, *worker_procs]:
            _end(proc)
