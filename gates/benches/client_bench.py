"""`kvgate client-bench`: how faithful and how scalable the load engine's measurements are.

(1) Fidelity: on the embedded server, TTFT p50 of our streaming client against
    an independent minimal timer (raw asyncio socket, written here and sharing
    no code with the client), alternating request by request.
(2) Scale: against the trivial reference server (fixed TTFT), locust with
    `streams` concurrent users; the TTFT p50 it records minus the p50 a single
    minimal-timer stream sees is the latency the load engine adds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcore.rundata import read_records
from workloads.loadgen.load import run_load
from workloads.traffic.client import StreamingClient
from workloads.traffic.processes import die_with_parent, free_port
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target


@dataclass
class ClientBenchSettings:
    directory: Path
    fidelity_requests: int = 40
    streams: int = 200
    scale_duration_s: float = 20.0
    ttft_ms: float = 100.0
    itl_ms: float = 50.0
    tokens: int = 10
    workers: int = 1


async def minimal_ttft(host: str, port: int, path: str, body: dict) -> float:
    """Seconds from writing the request to the first SSE line carrying generated text."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    start = time.perf_counter()
    writer.write(request)
    await writer.drain()
    ttft = None
    try:
        while True:  # read to the end, so the server is idle again when the next request comes
            line = await reader.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if ttft is None and line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content") or choice.get("text"):
                        ttft = time.perf_counter() - start
    finally:
        writer.close()
    if ttft is None:
        raise RuntimeError("the stream ended before any text")
    return ttft


@contextmanager
def _process(command: list[str], port: int, health_path: str, timeout_s: float = 60):
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                asyncio.run(_get(port, health_path))
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{command[2]} did not start on port {port}") from None
                time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


async def _get(port: int, path: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    status = await reader.readline()
    writer.close()
    if b" 200 " not in status:
        raise OSError(f"not ready: {status!r}")


def _request(i: int) -> WorkloadRequest:
    text = f"Fidelity probe {i}: " + "tell me about tiered caches. " * 8
    return WorkloadRequest(f"r{i}", f"s{i}", 0, ({"role": "user", "content": text},), 16, len(text))


def _openai_ttft(client, body: dict) -> float:
    """TTFT as seen through the official openai client (a well-known reference, when installed)."""
    start = time.perf_counter()
    ttft = None
    for chunk in client.chat.completions.create(**body):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the openai client's stream ended before any text")
    return ttft


def bench_fidelity(settings: ClientBenchSettings) -> dict:
    """Our client vs the minimal timer (and the openai client) on the embedded server, alternating."""
    port = free_port()
    command = [sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--mode", "recompute",
               "--port", str(port)]
    try:
        import openai  # deferred: openai takes seconds to import and is a test extra
        reference = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    except ImportError:
        reference = None
    times: dict[str, list[float]] = {"ours": [], "minimal": [], "openai": []}
    with _process(command, port, "/health"):
        client = StreamingClient(f"http://127.0.0.1:{port}/v1", "kvgate-tiny")
        try:
            for i in range(settings.fidelity_requests):
                request = _request(i)
                record = client.send(request)
                if not record.ok:
                    raise RuntimeError(f"client-bench: {record.error_type}: {record.error_message}")
                if record.ttft_s is None:
                    raise RuntimeError("client-bench: our client's stream ended before any text")
                times["ours"].append(record.ttft_s)
                body = client.body(request)
                times["minimal"].append(asyncio.run(minimal_ttft("127.0.0.1", port, "/v1/chat/completions", body)))
                if reference is not None:
                    times["openai"].append(_openai_ttft(reference, body))
        finally:
            client.close()
    ours, minimal = statistics.median(times["ours"]), statistics.median(times["minimal"])
    reference_p50 = statistics.median(times["openai"]) if times["openai"] else None
    return {"requests": len(times["ours"]), "ours_ttft_p50_ms": ours * 1e3, "minimal_ttft_p50_ms": minimal * 1e3,
            "openai_client_ttft_p50_ms": reference_p50 * 1e3 if reference_p50 else None,
            "difference_percent": (ours / minimal - 1) * 100}


def bench_scale(settings: ClientBenchSettings) -> dict:
    """Locust with many concurrent streams against the reference server: TTFT added by the load engine."""
    port = free_port()
    command = [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), "--ttft-ms",
               str(settings.ttft_ms), "--itl-ms", str(settings.itl_ms), "--tokens", str(settings.tokens)]
    sessions = tuple((_request(i),) for i in range(settings.streams * 4))
    with _process(command, port, "/health"):
        body = StreamingClient(f"http://127.0.0.1:{port}/v1", "reference").body(sessions[0][0])
        single = [asyncio.run(minimal_ttft("127.0.0.1", port, "/v1/chat/completions", body)) for _ in range(20)]
        out = Path(tempfile.mkdtemp(prefix="kvgate-client-bench-", dir=settings.directory))
        run = run_load(Workload("reference", sessions), Target("reference", f"http://127.0.0.1:{port}/v1", "reference"),
                       settings.streams, settings.scale_duration_s, out, workers=settings.workers)
    records = [r for r in read_records(run.records_dir) if r["ok"]]
    warm = run.started_at + settings.scale_duration_s / 3  # after every user has started
    measured = [r for r in records if r["sent_at"] >= warm]
    ttft = [r["ttft_s"] for r in measured]
    baseline = statistics.median(single)
    return {
        "streams": settings.streams, "workers": settings.workers, "requests": len(measured),
        "errors": sum(not r["ok"] for r in read_records(run.records_dir)),
        "peak_concurrent_streams": _peak_concurrency(records),
        "server_ttft_ms": settings.ttft_ms, "single_stream_ttft_p50_ms": baseline * 1e3,
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3 if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3 if ttft else None,
        "added_ttft_p50_ms": (float(np.percentile(ttft, 50)) - baseline) * 1e3 if ttft else None,
        "records_dir": str(run.records_dir),
    }


def _peak_concurrency(records: list[dict]) -> int:
    events = sorted([(r["sent_at"], 1) for r in records] + [(r["sent_at"] + r["e2e_s"], -1) for r in records])
    peak = level = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    return peak


def run_client_bench(settings: ClientBenchSettings) -> dict:
    settings.directory.mkdir(parents=True, exist_ok=True)
    fidelity = bench_fidelity(settings)
    scale = bench_scale(settings)
    return {"fidelity": fidelity, "scale": scale,
            "targets": {"fidelity_difference_percent": "within ±5", "added_ttft_p50_ms": "<= 1 at >= 200 streams"}}


def format_client_report(figures: dict) -> str:
    f, s = figures["fidelity"], figures["scale"]
    fid_ok = abs(f["difference_percent"]) <= 5
    add_ok = s["added_ttft_p50_ms"] is not None and s["added_ttft_p50_ms"] <= 1 and s["peak_concurrent_streams"] >= 200
    return "\n".join(
        [
            "kvgate client-bench",
            "",
            f"(1) fidelity on the embedded server, {f['requests']} requests alternating:",
            f"    our client TTFT p50 {f['ours_ttft_p50_ms']:.2f} ms, "
            f"minimal asyncio timer {f['minimal_ttft_p50_ms']:.2f} ms"
            f"  -> {f['difference_percent']:+.1f}%  "
            f"(target within ±5%: {'meets target' if fid_ok else 'OUTSIDE TARGET'})",
            f"    the official openai client on the same requests: TTFT p50 {f['openai_client_ttft_p50_ms']:.2f} ms"
            if f["openai_client_ttft_p50_ms"]
            else "    (openai client not installed: no comparison)",
            f"(2) scale against the reference server (TTFT {s['server_ttft_ms']:.0f} ms), {s['streams']} users, "
            f"{s['workers'] or 1} locust process(es):",
            f"    peak concurrent streams {s['peak_concurrent_streams']}, {s['requests']} measured requests, "
            f"{s['errors']} errors",
            f"    TTFT p50 {s['ttft_p50_ms']:.2f} ms (p99 {s['ttft_p99_ms']:.2f}) vs one stream "
            f"{s['single_stream_ttft_p50_ms']:.2f} ms -> added {s['added_ttft_p50_ms']:.2f} ms"
            f"  (target <= 1 ms at >= 200 streams: {'meets target' if add_ok else 'OUTSIDE TARGET'})",
        ]
    )
