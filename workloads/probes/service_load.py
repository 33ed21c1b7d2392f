"""Model service loading timed from outside: process start → weights loaded → ready → first token.

A vendor's "model loading 1399 → 150 s" is a service's start, not a file read: 141 GB of bf16
weights in 150 s is under 1 GB/s, so start-up, weight loading and readiness must be told apart.
`time_service_start` starts the server's own command (the embedded `kvgate serve --weights`, or an
external engine's), polls its health URL until it answers 200, then sends one streaming request
and takes the first token's arrival. Every time is seconds since the harness started the process.

When the health answer carries a `startup` object (`kvgate serve` does: epoch times of its
`imports_done` (Python, torch and the engine loaded), `weights_loaded` and `ready`, and the weights'
`loader`, `seconds`, `bytes`, `phases`), the start splits into imports → model and weights → ready →
first token; an engine that says nothing gives ready and first token only.
The weights' pages are dropped first (`drop`), so a round reads the device.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

from kvcore.files import drop_cached_pages
from workloads.traffic.client import StreamingClient
from workloads.traffic.processes import die_with_parent
from workloads.traffic.requests import WorkloadRequest

PHASES = ("imports", "weights", "ready", "first_token")   # the order they happen in


class ServiceStartError(RuntimeError):
    """The service did not come up, or did not answer its first request; the message says what and its log's tail."""


@dataclass(frozen=True)
class ServiceStart:
    """One timed start. Times are seconds since the process was started (None: the service did not say)."""

    imports_done_s: Optional[float]       # Python, torch and the server's modules imported
    weights_loaded_s: Optional[float]     # the model built and its weights loaded and checked
    ready_s: float                        # the health URL answered 200
    first_token_s: float                  # the first generated text of one streaming request arrived
    weights: dict = field(default_factory=dict)   # loader, seconds, bytes, phases, as the service reported them

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase, in order: imports, weights (model built, weights loaded and checked),
        ready (the server's own start-up), first_token (a phase the service did not report is folded into
        the next one)."""
        marks = {"imports": self.imports_done_s, "weights": self.weights_loaded_s,
                 "ready": self.ready_s, "first_token": self.first_token_s}
        spans, previous = {}, 0.0
        for name in PHASES:
            mark = marks[name]
            if mark is None:
                continue
            spans[name] = max(0.0, mark - previous)
            previous = mark
        return spans


def _tail(log: Path, chars: int = 600) -> str:
    try:
        text = log.read_text(errors="replace").strip()
    except OSError:
        return "no log"
    return " | ".join(text[-chars:].splitlines()[-6:]) or "nothing in its log"


def _health(url: str) -> Optional[dict]:
    """The health answer's JSON object when it answers 200 ({} when its body is not JSON), else None."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            if response.status != 200:
                return None
            body = response.read()
    except (OSError, urllib.error.URLError):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def time_service_start(command: Sequence[str], health_url: str, base_url: str, model: str, *, log: Path,
                       drop: Sequence[Path] = (), env: Optional[dict] = None,
                       api: Literal["chat", "completions"] = "completions",
                       api_key: Optional[str] = None, timeout_s: float = 600, poll_s: float = 0.02) -> ServiceStart:
    """Start `command`, time it to ready (`health_url` answers 200) and to the first token of one request
    to `base_url` (an OpenAI-compatible /v1), then stop it (SIGTERM). ServiceStartError when it exits or
    does not come up within `timeout_s`, or its first request fails."""
    drop_cached_pages(drop)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        started_wall, started = time.time(), time.monotonic()
        process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=die_with_parent)
    try:
        health = None
        while health is None:
            if process.poll() is not None:
                raise ServiceStartError(f"{command[0]} exited before it was ready (exit {process.returncode}): "
                                        f"{_tail(log)} (see {log})")
            if time.monotonic() - started > timeout_s:
                raise ServiceStartError(f"{command[0]} was not ready at {health_url} within {timeout_s:.0f} s "
                                        f"(see {log})")
            health = _health(health_url)
            if health is None:
                time.sleep(poll_s)
        ready = time.monotonic() - started
        first_token = _first_token(base_url, model, api, api_key, started, log)
        return _start_from(health.get("startup"), started_wall, ready, first_token)
    finally:
        _stop(process)


def _first_token(base_url: str, model: str, api: Literal["chat", "completions"], api_key: Optional[str],
                 started: float, log: Path) -> float:
    request = WorkloadRequest("service-load", "service-load", 0, ({"role": "user", "content": "Hello"},), 1, 8)
    client = StreamingClient(base_url, model, api, api_key=api_key, target="service")
    try:
        sent = time.monotonic()
        record = client.send(request)
    finally:
        client.close()
    if not record.ok or record.ttft_s is None:
        raise ServiceStartError(f"the first request to {base_url} failed: {record.error_type}: "
                                f"{record.error_message} (see {log})")
    return sent - started + record.ttft_s


def _start_from(startup: object, started_wall: float, ready: float, first_token: float) -> ServiceStart:
    """The service's own startup record (epoch times) as seconds since the harness started it."""
    if not isinstance(startup, dict):
        return ServiceStart(None, None, ready, first_token)

    def since(key: str) -> Optional[float]:
        value = startup.get(key)
        return max(0.0, float(value) - started_wall) if isinstance(value, (int, float)) else None

    weights = startup.get("weights")
    return ServiceStart(since("imports_done"), since("weights_loaded"), ready, first_token,
                        dict(weights) if isinstance(weights, dict) else {})
