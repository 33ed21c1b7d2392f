"""The endpoints a run measures: embedded `kvgate serve` processes (one per mode) or external URLs."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, Optional, Union, cast

import yaml

from cache_impl.server.auth import ADMIN_TOKEN_ENV
from engines.settings import TargetSettings
from kvcore.settings import parse_size
from workloads.servers.stores import MooncakePool, RedisServer
from workloads.traffic.datasets import BYTE_TOKENIZER_ID
from workloads.traffic.processes import die_with_parent, free_port
from workloads.traffic.routing import Routing
from workloads.traffic.target import Target

from .config import EmbeddedTargets, GatesConfig

EMBEDDED_ROLES = {"recompute": "recompute", "baseline": "device-only", "candidate": "tiered"}


@dataclass(frozen=True)
class Endpoint:
    """A role (recompute, baseline, candidate) and where to reach it: the one endpoint class of a run, made from
    gates.yaml's `TargetSettings` for an external target (`from_settings`) or by `EmbeddedServers` for the
    harness's own servers; it travels to the gate suites as JSON (`endpoints_to_json`)."""

    role: str
    url: str                     # base URL ending in /v1
    model: str
    api: Literal["chat", "completions"] = "chat"
    api_key_env: Optional[str] = None
    admin: bool = False          # embedded: /admin/cache/* is available
    mode: Optional[str] = None   # embedded: the cache mode
    nodes: tuple[str, ...] = ()  # several nodes serving this role (base URLs, the first is `url`)
    routing: Routing = "round-robin"
    tokenizer: Optional[str] = None   # its tokenizer id when kvgate knows it (prompts sized in its tokens)
    cache_dir: Optional[str] = None   # the first node's disk-tier directory when on this host (embedded: its
                                      # NodePlan.cache_dir; external: targets.<role>.cache_dir)

    @classmethod
    def from_settings(cls, role: str, settings: TargetSettings) -> "Endpoint":
        """An external target's endpoint, from its gates.yaml section (`targets.<role>`)."""
        cache_dir = None if settings.cache_dir is None else str(settings.cache_dir)
        return cls(role, settings.url.rstrip("/"), settings.model, settings.api, settings.api_key_env,
                   tokenizer=settings.tokenizer, cache_dir=cache_dir)

    def target(self, name: Optional[str] = None) -> Target:
        return Target(name or self.role, self.url, self.model, self.api, self.api_key_env,
                      nodes=tuple(self.nodes), routing=self.routing)

    @property
    def node_roots(self) -> list[str]:
        """Each node's server root (no /v1)."""
        return [url.removesuffix("/v1") for url in (self.nodes or (self.url,))]

    @property
    def server_root(self) -> str:
        return self.url.removesuffix("/v1")


def external_endpoints(config: GatesConfig) -> dict[str, Endpoint]:
    targets = config.targets
    found = {"baseline": targets.baseline, "candidate": targets.candidate, "recompute": targets.recompute}
    endpoints = {role: Endpoint.from_settings(role, e) for role, e in found.items() if e is not None}
    if targets.candidate_nodes and "candidate" in endpoints:
        first = endpoints["candidate"]
        nodes = (first.url, *(url.rstrip("/") for url in targets.candidate_nodes))
        endpoints["candidate"] = replace(first, nodes=nodes, routing=targets.routing)
    return endpoints


class ServerStartError(RuntimeError):
    """An embedded server did not come up; the message says which and what its log said last."""


def _last_words(log: Path, lines: int = 3) -> str:
    """What a server said last before it exited: its error line when it wrote one, else its last lines."""
    try:
        text = [line.strip() for line in log.read_text(errors="replace").strip().splitlines() if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in text if re.match(r"^(kvgate[\w ]*: |[\w.]*(Error|Exception)\b)", line)]
    return errors[-1] if errors else (" | ".join(text[-lines:]) or "nothing in its log")


@dataclass(frozen=True)
class NodePlan:
    """One embedded server to start: its role, cache mode, place in its role's fleet and whether it uses the pool."""

    role: str
    mode: str
    index: int
    count: int                   # nodes of its role
    pooled: bool
    storage: Path                # storage.path, resolved: the storage under test, where its disk tier lives

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.index}" if self.count > 1 else self.mode

    @property
    def cache_dir(self) -> Path:
        """Its disk tier's directory on this host, the one place it is decided: given to the server once
        (`--cache-dir`) and to the gates with its endpoint (`Endpoint.cache_dir`)."""
        return self.storage / f"kv-{self.name}"


def fleet_plan(config: GatesConfig) -> list[NodePlan]:
    """Every embedded server of a run: one recompute reference, and as many device-only baseline nodes as tiered
    candidate nodes (`candidate_nodes`), only the candidate's on the pool, each with its own disk tier directory
    under `storage.path` (`NodePlan.cache_dir`). Every server reads one engine setting
    (`engine_settings`) and both fleets are routed by `targets.routing`, so throughput compares equal fleets: the
    same node count, routing and device tier per node, the candidate adding its lower tiers and the pool."""
    embedded, storage = config.targets.embedded, Path(config.storage.path).resolve()
    plan = []
    for role, mode in EMBEDDED_ROLES.items():
        count = embedded.candidate_nodes if role in ("candidate", "baseline") else 1
        plan += [NodePlan(role, mode, node, count, role == "candidate" and embedded.pool != "none", storage)
                 for node in range(count)]
    return plan


def engine_settings(embedded: EmbeddedTargets) -> dict:
    """The `engine:` section every embedded server starts from; its mode and its disk tier's directory are its
    command line's (`--mode`, `--cache-dir`: NodePlan.cache_dir), so the file holds no placeholder for either."""
    return {"preset": embedded.preset, "seed": embedded.seed, "max_running": embedded.max_running,
            "cache": {"device_capacity_blocks": embedded.device_capacity_blocks,
                      "host_capacity_bytes": embedded.host_capacity,
                      "disk": {"capacity_bytes": embedded.disk_capacity,
                               "io_mode": embedded.disk_io_mode,
                               "read_workers": embedded.disk_read_workers}}}


class EmbeddedServers:
    """Starts one `kvgate serve --admin` per mode on free loopback ports; stops them (SIGTERM) at exit.

    With `candidate_nodes` > 1 the tiered candidate runs as that many nodes, each with its own disk
    directory, sharing the pool the harness starts first (`pool`: redis or mooncake, on loopback);
    the device-only baseline runs as as many nodes (no pool), routed the same way (`fleet_plan`); the
    fleet's tiers and pool are sized by gates/fleet.py where gates.yaml does not set them.

    Their admin routes share one token made for this run; it reaches the servers and the gate
    suites (`client_environment`) through the environment only, never a file or a command line.
    """

    def __init__(self, config: GatesConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.pool: Optional[Union[RedisServer, MooncakePool]] = None
        self._admin_token = secrets.token_urlsafe(32)

    def client_environment(self) -> dict[str, str]:
        """What a process that calls the admin routes (a gate suite's AdminClient) needs in its environment."""
        return {ADMIN_TOKEN_ENV: self._admin_token}

    def start(self, timeout_s: float = 120) -> dict[str, Endpoint]:
        embedded = self.config.targets.embedded
        settings = self.run_dir / "engine.yaml"
        settings.write_text(yaml.safe_dump({"engine": engine_settings(embedded)}))
        pool_url = self._start_pool(embedded)
        env = {k: v for k, v in os.environ.items() if k != "KVGATE_API_KEY"} | self.client_environment()
        urls: dict[str, list[str]] = {}
        first_dirs: dict[str, Path] = {}
        for node in fleet_plan(self.config):
            port = free_port()
            command = [sys.executable, "-m", "gates.cli", "serve", "--config", str(settings), "--mode", node.mode,
                       "--host", "127.0.0.1", "--port", str(port), "--admin", "--cache-dir", str(node.cache_dir)]
            if node.pooled:
                if pool_url is None:    # pooled only where embedded.pool names the pool _start_pool started
                    raise ServerStartError(f"the {node.name} node: expected the fleet's pool, found none started")
                command += ["--remote", pool_url]
            key = f"{node.role}-{node.index}"
            self.logs[key] = self.run_dir / f"server-{node.name}.log"
            self.processes[key] = subprocess.Popen(
                command, stdout=open(self.logs[key], "wb"), stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent, env=env)
            urls.setdefault(node.role, []).append(f"http://127.0.0.1:{port}/v1")
            first_dirs.setdefault(node.role, node.cache_dir)
        for role, found in urls.items():
            self.endpoints[role] = Endpoint(role, found[0], f"kvgate-{embedded.preset}", admin=True,
                                            mode=EMBEDDED_ROLES[role], nodes=tuple(found) if len(found) > 1 else (),
                                            routing=self.config.targets.routing, tokenizer=BYTE_TOKENIZER_ID,
                                            cache_dir=str(first_dirs[role]))
        for name, process in self.processes.items():
            role, index = name.rsplit("-", 1)
            self._wait_healthy(process, self.endpoints[role].node_roots[int(index)], self.logs[name], timeout_s)
        return self.endpoints

    def _start_pool(self, embedded: EmbeddedTargets) -> Optional[str]:
        """The pool the candidate nodes share, holding `pool_capacity` bytes; its URL (None: no pool)."""
        if embedded.pool == "none":
            return None

        pool_dir, nbytes = self.run_dir / "pool", parse_size(embedded.pool_capacity)
        self.pool = (RedisServer(pool_dir, maxmemory=str(nbytes)) if embedded.pool == "redis"
                     else MooncakePool(pool_dir, segment=f"{-(-nbytes // 2**20)}MB")).start()
        return self.pool.url

    def _wait_healthy(self, process: subprocess.Popen, root: str, log: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                command = cast(list[str], process.args)     # start() runs each server from a list of strings
                raise ServerStartError(f"the embedded server ({' '.join(command[5:8])}) exited at start "
                                       f"(exit {process.returncode}): {_last_words(log)} (see {log})")
            try:
                with urllib.request.urlopen(root + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise ServerStartError(f"the embedded server at {root} was not healthy within {timeout_s:.0f} s "
                               f"(see {log})")

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
        if self.pool is not None:
            self.pool.stop()

    def __enter__(self) -> "EmbeddedServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def endpoints_to_json(endpoints: dict[str, Endpoint]) -> dict:
    return {role: asdict(e) for role, e in endpoints.items()}


def endpoints_from_json(data: dict) -> dict[str, Endpoint]:
    return {role: Endpoint(**{**e, "nodes": tuple(e.get("nodes") or ())}) for role, e in data.items()}
