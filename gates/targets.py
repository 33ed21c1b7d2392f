"""The endpoints a run measures: embedded `kvgate serve` processes (one per mode) or external URLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import yaml

from workloads.load import Target, free_port
from workloads.processes import die_with_parent

from .config import GatesConfig

EMBEDDED_ROLES = {"recompute": "recompute", "baseline": "device-only", "candidate": "tiered"}


@dataclass(frozen=True)
class Endpoint:
    """A role (recompute, baseline, candidate) and where to reach it."""

    role: str
    url: str                     # base URL ending in /v1
    model: str
    api: str = "chat"
    api_key_env: Optional[str] = None
    admin: bool = False          # embedded: /admin/cache/* is available
    mode: Optional[str] = None   # embedded: the cache mode

    def target(self, name: Optional[str] = None) -> Target:
        return Target(name or self.role, self.url, self.model, self.api, self.api_key_env)

    @property
    def server_root(self) -> str:
        return self.url.removesuffix("/v1")


def external_endpoints(config: GatesConfig) -> dict[str, Endpoint]:
    targets = config.targets
    found = {"baseline": targets.baseline, "candidate": targets.candidate, "recompute": targets.recompute}
    return {role: Endpoint(role, e.url.rstrip("/"), e.model, e.api, e.api_key_env)
            for role, e in found.items() if e is not None}


class EmbeddedServers:
    """Starts one `kvgate serve --admin` per mode on free loopback ports; stops them (SIGTERM) at exit."""

    def __init__(self, config: GatesConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self.processes: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, Endpoint] = {}

    def start(self, timeout_s: float = 120) -> dict[str, Endpoint]:
        embedded = self.config.targets.embedded
        engine = {"preset": embedded.preset, "seed": embedded.seed, "max_running": embedded.max_running,
                  "cache": {"device_capacity_blocks": embedded.device_capacity_blocks,
                            "host_capacity_bytes": embedded.host_capacity,
                            "disk": {"path": "unused", "capacity_bytes": embedded.disk_capacity,
                                     "io_mode": embedded.disk_io_mode,
                                     "read_workers": embedded.disk_read_workers}}}
        settings = self.run_dir / "engine.yaml"
        settings.write_text(yaml.safe_dump({"engine": engine}))
        for role, mode in EMBEDDED_ROLES.items():
            port = free_port()
            cache_dir = Path(self.config.storage.path).resolve() / f"kv-{mode}"
            log = open(self.run_dir / f"server-{mode}.log", "wb")
            self.processes[role] = subprocess.Popen(
                [sys.executable, "-m", "gates.cli", "serve", "--config", str(settings), "--mode", mode,
                 "--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache_dir), "--admin"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                env={k: v for k, v in os.environ.items() if k != "KVGATE_API_KEY"})
            self.endpoints[role] = Endpoint(role, f"http://127.0.0.1:{port}/v1", f"kvgate-{embedded.preset}",
                                            admin=True, mode=mode)
        for role, endpoint in self.endpoints.items():
            self._wait_healthy(role, endpoint, timeout_s)
        return self.endpoints

    def _wait_healthy(self, role: str, endpoint: Endpoint, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.processes[role].poll() is not None:
                raise RuntimeError(f"the embedded {endpoint.mode} server exited at start; "
                                   f"see {self.run_dir / f'server-{endpoint.mode}.log'}")
            try:
                with urllib.request.urlopen(endpoint.server_root + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the embedded {endpoint.mode} server was not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> "EmbeddedServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def endpoints_to_json(endpoints: dict[str, Endpoint]) -> dict:
    return {role: asdict(e) for role, e in endpoints.items()}


def endpoints_from_json(data: dict) -> dict[str, Endpoint]:
    return {role: Endpoint(**e) for role, e in data.items()}
