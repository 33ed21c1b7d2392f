"""The G4 soak: constant load measured in windows, with consistency probes, resumable after a kill.

Everything lands in the gate's raw directory as it happens:
- `probes.json`: the fixed probe prompts and the answers recorded at the start (temperature 0);
- `windows.jsonl`: one row per completed window (appended; a resumed soak continues the numbering);
- `load-<segment>/`: the load engine's raw records of each (re)started stretch;
- `faults.jsonl`: one row per scheduled fault, with what the system did (see `fault_schedule`).
A resumed soak reads them back, keeps every completed window and fault, and runs only the remaining time.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from gates.config import FaultSpec
from gates.g4_soak.fault_schedule import FaultSchedule
from kvcore.files import append_jsonl, read_jsonl_file as read_jsonl, write_json
from workloads.client import StreamingClient, read_records
from workloads.errors import summarize_errors
from workloads.faults import AdminClient, counter, per_tier
from workloads.load import Target, run_load
from workloads.requests import Workload, WorkloadRequest

PROBE_MAX_TOKENS = 16


@dataclass
class SoakSettings:
    duration_s: float
    window_s: float
    concurrency: int


def probe_requests(workload: Workload, count: int = 3) -> list[WorkloadRequest]:
    """Fixed prompts drawn from the workload (the first turn of the first sessions), asked for 16 tokens."""
    firsts = [session[0] for session in workload.sessions[:count]]
    return [WorkloadRequest(f"probe-{i}", f"probe-{i}", 0, r.messages, PROBE_MAX_TOKENS, r.prompt_tokens)
            for i, r in enumerate(firsts)]


def _answer(client: StreamingClient, request: WorkloadRequest) -> Optional[str]:
    """The probe's answer text (greedy), or None when the request failed."""
    record = client.send(request, keep_text=True)
    return record.text if record.ok else None


def server_figures(server_root: str) -> dict:
    """Process memory, per-tier hits and disk usage from the server's /metrics."""
    samples = AdminClient(server_root, timeout_s=30).metrics()
    used = per_tier(samples, "kvgate_cache_used_bytes")
    return {"rss_bytes": counter(samples, "process_resident_memory_bytes"),
            "hits": per_tier(samples, "kvgate_cache_hits_total"),
            "disk_used_bytes": used.get("disk", 0),
            # the device and host pools live in the server's memory (the disk's and the pool's do not)
            "cache_memory_bytes": used.get("device", 0) + used.get("host", 0)}


def _window_row(index: int, start_s: float, records: list[dict], server: dict, probes: list[bool],
                window_s: float) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "index": index, "start_s": start_s, "requests": len(records), "completed": len(ok),
        "errors": len(records) - len(ok), "errors_by_type": summarize_errors(records),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3 if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3 if ttft else None,
        "output_tokens_per_s": sum(r["completion_tokens"] or 0 for r in ok) / window_s,
        "rss_mib": server.get("rss_bytes", 0) / 2**20, "hits": server.get("hits", {}),
        # memory that is not the cache's own pools (those fill up to their capacity by design)
        "rss_minus_cache_mib": (server.get("rss_bytes", 0) - server.get("cache_memory_bytes", 0)) / 2**20,
        "disk_used_mib": server.get("disk_used_bytes", 0) / 2**20,
        "probes": len(probes), "probes_identical": sum(probes),
    }


def window_line(row: dict, planned: int) -> str:
    """A soak window in one line for the console: where the soak is and what the window measured."""
    p50, p99 = row.get("ttft_p50_ms"), row.get("ttft_p99_ms")
    ttft = "no TTFT" if p50 is None else f"TTFT p50 {p50:.0f} / p99 {p99:.0f} ms"
    return (f"soak window {row['index'] + 1} / {planned} ({row['start_s']:.0f} s in): {row['requests']} requests, "
            f"{row['errors']} errors, {ttft}, {row['output_tokens_per_s']:.1f} tokens/s, probes "
            f"{row['probes_identical']} / {row['probes']} identical, memory {row['rss_minus_cache_mib']:.0f} MiB "
            "outside the cache")


class Soak:
    """Runs (or resumes) a soak against one endpoint, appending a row per window."""

    def __init__(self, raw_dir: Path, target: Target, server_root: str, workload: Workload,
                 settings: SoakSettings, faults: Sequence[FaultSpec] = ()) -> None:
        self.raw_dir, self.target, self.server_root = raw_dir, target, server_root
        self.workload, self.settings, self.faults = workload, settings, list(faults)
        self.windows_path = raw_dir / "windows.jsonl"
        self.faults_path = raw_dir / "faults.jsonl"

    def windows(self) -> list[dict]:
        return read_jsonl(self.windows_path)

    def run(self, on_window=None) -> list[dict]:
        done = self.windows()
        remaining_windows = int(round(self.settings.duration_s / self.settings.window_s)) - len(done)
        if remaining_windows <= 0:
            return done
        client = StreamingClient(self.target.url, self.target.model, self.target.api, target="probe")
        try:
            expected = self._expected_answers(client)
            self._soak(client, expected, done, remaining_windows, on_window)
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

    def _soak(self, client, expected: dict, done: list[dict], windows: int, on_window) -> None:
        segment = self.raw_dir / f"load-{len(list(self.raw_dir.glob('load-*')))}"
        duration = windows * self.settings.window_s
        load = threading.Thread(target=run_load, name="g4-load", daemon=True, args=(
            self.workload, self.target, self.settings.concurrency, duration + 5, segment))
        load.start()
        offset = (done[-1]["start_s"] + self.settings.window_s) if done else 0.0
        begin = time.time() + 3.0  # locust's start-up; windows begin once users are sending
        probes = [r for r in probe_requests(self.workload) if r.request_id in expected]
        schedule = FaultSchedule(self.faults, AdminClient(self.server_root), self.target, probes[0],
                                 expected[probes[0].request_id], self.faults_path)
        schedule.start(begin, offset, begin + duration)
        for k in range(windows):
            window_start = begin + k * self.settings.window_s
            time.sleep(max(0.0, window_start + self.settings.window_s - time.time()))
            records = [r for r in read_records(segment / "records")
                       if window_start <= r["sent_at"] < window_start + self.settings.window_s]
            identical = [_answer(client, p) == expected[p.request_id] for p in probes]
            row = _window_row(len(done) + k, offset + k * self.settings.window_s, records,
                              server_figures(self.server_root), identical, self.settings.window_s)
            append_jsonl(self.windows_path, row)
            if on_window is not None:
                on_window(row)
        schedule.stop(timeout_s=60)
        load.join(timeout=duration + 150)

