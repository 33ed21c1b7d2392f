"""The G4 soak: constant load measured in windows, with consistency probes, resumable after a kill.

How it works: docs/methods/soak-trends.md (gates/g4_soak/soak.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from gates.g4_soak.fault_schedule import FaultSchedule
from kvcore.files import JsonlTail, append_jsonl, write_json
from kvcore.files import read_jsonl_file as read_jsonl
from workloads.loadgen.live import LiveFigures
from workloads.loadgen.load import run_load
from workloads.probes.faults import AdminClient, CacheAdmin, counter, gauge, per_tier
from workloads.probes.settings import FaultSpec
from workloads.traffic.client import StreamingClient
from workloads.traffic.errors import summarize_errors
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target

PROBE_MAX_TOKENS = 16


@dataclass
class SoakSettings:
    duration_s: float
    window_s: float
    concurrency: int
    live_every_s: float = 2.0

    @property
    def planned_windows(self) -> int:
        return int(round(self.duration_s / self.window_s))


def probe_requests(workload: Workload, count: int = 3) -> list[WorkloadRequest]:
    """Fixed prompts drawn from the workload (the first turn of the first sessions), asked for 16 tokens."""
    firsts = [session[0] for session in workload.sessions[:count]]
    return [WorkloadRequest(f"probe-{i}", f"probe-{i}", 0, r.messages, PROBE_MAX_TOKENS, r.prompt_tokens)
            for i, r in enumerate(firsts)]


def _answer(client: StreamingClient, request: WorkloadRequest) -> Optional[str]:
    """The probe's answer text (greedy), or None when the request failed."""
    record = client.send(request, keep_text=True)
    return record.text if record.ok else None


# a window's runtime figure: (the /metrics gauge, its labels); None in the row when the server has no such gauge
RUNTIME_GAUGES = {
    "open_fds": ("process_open_fds", {}),
    "threads": ("kvgate_process_threads", {}),
    "asyncio_tasks": ("kvgate_asyncio_tasks", {}),
    "disk_temp_files": ("kvgate_cache_temp_files", {}),
    "disk_blocks": ("kvgate_cache_blocks", {"tier": "disk"}),
}


def engine_kv_memory(samples) -> Optional[float]:
    """The embedded engine's request KV buffers (running, being started and kept for reuse) in the server's
    memory: their pages, not their bytes (a fresh buffer's pages are not there until touched), and never past
    the bound they have by design (max_running running and as many kept, each at the context), so a pool that
    outgrew its bound still shows in the memory outside the cache. None for a server that does not report them."""
    resident = gauge(samples, "kvgate_engine_kv_buffer_resident_bytes")
    if resident is None:
        return None
    limit = gauge(samples, "kvgate_engine_kv_buffer_limit_bytes")
    return resident if limit is None else min(resident, limit)


def server_figures(server_root: str) -> dict:
    """Process memory, per-tier hits, disk usage and the runtime gauges (`RUNTIME_GAUGES`) from /metrics."""
    samples = AdminClient(server_root, timeout_s=30).metrics()
    used = per_tier(samples, "kvgate_cache_used_bytes")
    resident = per_tier(samples, "kvgate_cache_resident_bytes")
    return {"rss_bytes": counter(samples, "process_resident_memory_bytes"),
            "hits": per_tier(samples, "kvgate_cache_hits_total"),
            "disk_used_bytes": used.get("disk", 0),
            # the pools' pages in the server's memory: touched ones stay resident when blocks are evicted, so the
            # bytes in use would read every eviction (each G4 fault's) as memory outside the cache; a cache that
            # does not say what it holds resident: the device and host tiers' bytes in use
            "cache_memory_bytes": sum(resident.values()) if resident else used.get("device", 0) + used.get("host", 0),
            "engine_kv_resident_bytes": engine_kv_memory(samples),
            **{field: gauge(samples, name, **labels) for field, (name, labels) in RUNTIME_GAUGES.items()}}


def _window_row(index: int, start_s: float, records: list[dict], server: dict, probes: list[bool],
                span_s: float) -> dict:
    """A window's row: `records` the requests that completed in it, `span_s` the seconds their completions span
    (`CompletedWindow`), over which its throughput is taken."""
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "index": index, "start_s": start_s, "requests": len(records), "completed": len(ok),
        "errors": len(records) - len(ok), "errors_by_type": summarize_errors(records),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3 if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3 if ttft else None,
        "output_tokens_per_s": sum(r["completion_tokens"] or 0 for r in ok) / span_s if span_s > 0 else None,
        "span_s": span_s,
        "rss_mib": server.get("rss_bytes", 0) / 2**20, "hits": server.get("hits", {}),
        # memory that is not the cache's own pools (those fill up to their capacity by design)
        "rss_minus_cache_mib": (server.get("rss_bytes", 0) - server.get("cache_memory_bytes", 0)
                                - (server.get("engine_kv_resident_bytes") or 0)) / 2**20,
        "engine_kv_resident_mib": (None if server.get("engine_kv_resident_bytes") is None
                                   else server["engine_kv_resident_bytes"] / 2**20),
        "disk_used_mib": server.get("disk_used_bytes", 0) / 2**20,
        "probes": len(probes), "probes_identical": sum(probes),
        **{field: server.get(field) for field in RUNTIME_GAUGES},
    }


def window_line(row: dict, planned: int) -> str:
    """A soak window in one line for the console: where the soak is and what the window measured."""
    p50, p99 = row.get("ttft_p50_ms"), row.get("ttft_p99_ms")
    ttft = "no TTFT" if p50 is None else f"TTFT p50 {p50:.0f} / p99 {p99:.0f} ms"
    tokens = row.get("output_tokens_per_s")
    return (f"soak window {row['index'] + 1} / {planned} ({row['start_s']:.0f} s in): {row['requests']} requests, "
            f"{row['errors']} errors, {ttft}, {'-' if tokens is None else f'{tokens:.1f}'} tokens/s, probes "
            f"{row['probes_identical']} / {row['probes']} identical, memory {row['rss_minus_cache_mib']:.0f} MiB "
            "outside the cache")


@dataclass(frozen=True)
class LiveWindow:
    """A running soak window: where it is and what it measured so far."""

    index: int                     # 0-based, of `planned`
    planned: int
    start_s: float                 # on the soak's clock (continued across a resume)
    elapsed_s: float
    window_s: float
    requests: int
    errors: int
    ttft_p50_s: Optional[float]
    ttft_p99_s: Optional[float]

    def line(self) -> str:
        """"soak window 3 / 60 (120 s in): 14 / 60 s, 38 requests, 0 errors, TTFT p50 212 / p99 403 ms"
        (the window's own line, `window_line`, in the same words once it ends)."""
        ttft = ("no TTFT yet" if self.ttft_p50_s is None or self.ttft_p99_s is None
                else f"TTFT p50 {self.ttft_p50_s * 1e3:.0f} / p99 {self.ttft_p99_s * 1e3:.0f} ms")
        return (f"soak window {self.index + 1} / {self.planned} ({self.start_s:.0f} s in): {self.elapsed_s:.0f} / "
                f"{self.window_s:.0f} s, {self.requests} requests, {self.errors} errors, {ttft}")


def finished_at(record: dict) -> float:
    """When a request's record says it ended (a failure with no timing: when it was sent)."""
    return record["sent_at"] + (record.get("e2e_s") or 0.0)


@dataclass(frozen=True)
class CompletedWindow:
    """The requests that completed in a window, and the seconds from the previous window's last completion
    (or the window's start) to this window's last (or its end, when none completed)."""

    records: list[dict]
    span_s: float


# a record lands a moment after its request completes: the window is read this long after its end
LANDING_GRACE_S = 0.5


class WindowFeed:
    """A load's request records by window of completion, read as they land (each poll reads only what was
    appended)."""

    def __init__(self, records_dir: Path) -> None:
        self._tail = JsonlTail(records_dir, "records-*.jsonl")
        self._later: list[dict] = []          # landed, not yet completed in a window read
        self._span_from: Optional[float] = None   # the last completion of the window read before

    def wait(self, start: float, window_s: float, every_s: float,
             on_live: Optional[Callable[[LiveFigures, float], None]] = None) -> CompletedWindow:
        """Wait for the window [start, start + window_s) to end; the requests that completed by its end and
        were not in an earlier window (a record landing late joins the next). Meanwhile, every `every_s` once
        it began, `on_live(figures so far, seconds in)` (of the requests sent in the window so far)."""
        end = start + window_s
        rows = list(self._later)
        figures = LiveFigures(since=start, until=end)
        figures.add(rows)
        while (left := end - time.time()) > 0:
            time.sleep(min(every_s, left))
            new = self._tail.read_new()
            rows += new
            figures.add(new)
            if on_live is not None and start <= time.time() < end:
                on_live(figures, time.time() - start)
        time.sleep(max(0.0, end + LANDING_GRACE_S - time.time()))
        rows += self._tail.read_new()
        done = [r for r in rows if finished_at(r) < end]
        self._later = [r for r in rows if finished_at(r) >= end]
        span_from = start if self._span_from is None else self._span_from
        span_to = max((finished_at(r) for r in done), default=end)
        self._span_from = max(span_to, span_from)
        return CompletedWindow(done, self._span_from - span_from)


class Soak:
    """Runs (or resumes) a soak against one endpoint, appending a row per window."""

    def __init__(self, raw_dir: Path, target: Target, cache: CacheAdmin, workload: Workload,
                 settings: SoakSettings, faults: Sequence[FaultSpec] = ()) -> None:
        """`cache`: where faults go, and whose /metrics give the cache's figures and its process's memory."""
        self.raw_dir, self.target, self.cache = raw_dir, target, cache
        self.server_root = cache.admin.server_root
        self.workload, self.settings, self.faults = workload, settings, list(faults)
        self.windows_path = raw_dir / "windows.jsonl"
        self.faults_path = raw_dir / "faults.jsonl"

    def windows(self) -> list[dict]:
        return read_jsonl(self.windows_path)

    def run(self, on_window: Optional[Callable[[dict], None]] = None,
            on_live: Optional[Callable[[LiveWindow], None]] = None) -> list[dict]:
        """Soak the remaining windows; `on_window(row)` as each ends, `on_live` while each runs."""
        done = self.windows()
        remaining_windows = self.settings.planned_windows - len(done)
        if remaining_windows <= 0:
            return done
        client = self.target.client(target="probe")
        try:
            expected = self._expected_answers(client)
            self._soak(client, expected, done, remaining_windows, on_window, on_live)
        finally:
            client.close()
        return self.windows()

    def _expected_answers(self, client: StreamingClient) -> dict:
        path = self.raw_dir / "probes.json"
        if path.exists():
            return json.loads(path.read_text())
        expected = {}
        for request in probe_requests(self.workload):
            answer = _answer(client, request)
            if answer is None:
                raise RuntimeError(f"G4: the probe {request.request_id} failed before the soak started")
            expected[request.request_id] = answer
        write_json(path, expected)
        return expected

    def _soak(self, client, expected: dict, done: list[dict], windows: int, on_window, on_live) -> None:
        segment = self.raw_dir / f"load-{len(list(self.raw_dir.glob('load-*')))}"
        duration = windows * self.settings.window_s
        load = threading.Thread(target=run_load, name="g4-load", daemon=True, args=(
            self.workload, self.target, self.settings.concurrency, duration + 5, segment))
        load.start()
        offset = (done[-1]["start_s"] + self.settings.window_s) if done else 0.0
        begin = time.time() + 3.0  # locust's start-up; windows begin once users are sending
        probes = [r for r in probe_requests(self.workload) if r.request_id in expected]
        schedule = FaultSchedule(self.faults, self.cache, self.target, probes[0],
                                 expected[probes[0].request_id], self.faults_path)
        schedule.start(begin, offset, begin + duration)
        feed = WindowFeed(segment / "records")
        for k in range(windows):
            index, start_s = len(done) + k, offset + k * self.settings.window_s
            window = feed.wait(begin + k * self.settings.window_s, self.settings.window_s,
                               self.settings.live_every_s, self._live_teller(index, start_s, on_live))
            identical = [_answer(client, p) == expected[p.request_id] for p in probes]
            server = server_figures(self.server_root)
            row = _window_row(index, start_s, window.records, server, identical, window.span_s)
            row["sampled_s"] = offset + (time.time() - begin)   # when its server figures were read (soak clock)
            append_jsonl(self.windows_path, row)
            if on_window is not None:
                on_window(row)
        schedule.stop(timeout_s=60)
        load.join(timeout=duration + 150)

    def _live_teller(self, index: int, start_s: float,
                     on_live: Optional[Callable[[LiveWindow], None]]) -> Optional[Callable[[LiveFigures, float], None]]:
        if on_live is None:
            return None
        return lambda figures, elapsed_s: on_live(LiveWindow(
            index, self.settings.planned_windows, start_s, elapsed_s, self.settings.window_s, figures.requests,
            figures.errors, figures.ttft_s(50), figures.ttft_s(99)))
