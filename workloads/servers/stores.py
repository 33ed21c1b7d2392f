"""Start the shared pool's stores on loopback for tests, examples and local multi-node runs.

- `RedisServer`: Debian's `redis-server` on a free 127.0.0.1 port (protected mode on), no persistence,
  LRU eviction at `maxmemory` (an evicted block is a miss).
- `MooncakePool`: Mooncake Store's HTTP metadata server, its master, and one
  `mooncake_client` that lends `segment` bytes of memory to the pool, on free
  ports, every listener that has a setting bound to 127.0.0.1 (`--host`,
  `-rpc_address`, `-metrics_host`, `-host`; `MC_TCP_BIND_ADDRESS` names the
  address the transfer engine advertises). The transfer engine inside
  `mooncake_client` (and inside every node's client) also listens on every
  interface on two ports that no setting binds: see the README's shared pool section.

Both are context managers that stop what they started, and `url` is what
`kvgate serve --remote` takes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, cast

from workloads.traffic.processes import die_with_parent, free_port


class StoreStartError(RuntimeError):
    """A store's program is missing or did not become ready."""


def _program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise StoreStartError(f"{name}: not found on PATH (see the README's shared pool section)")
    return path


def _wait_port(port: int, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    program = cast(list[str], process.args)[0]   # a store's command is a list of strings (`_Processes.spawn`)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StoreStartError(f"{program} exited with {process.returncode}: "
                                  f"{log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise StoreStartError(f"{program} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


class _Processes:
    """Processes started in order and stopped in reverse (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Optional[Path]) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvgate-store-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []

    def spawn(self, name: str, command: list[str], env: Optional[dict] = None) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                                       env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
        self.processes.append(process)
        return process, log

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisServer(_Processes):
    def __init__(self, workdir: Optional[Path] = None, port: Optional[int] = None, maxmemory: str = "512mb") -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.maxmemory = maxmemory

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20) -> "RedisServer":
        process, log = self.spawn(
            "redis",
            [
                _program("redis-server"),
                "--bind",
                "127.0.0.1",
                "--protected-mode",
                "yes",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                self.maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
                "--dir",
                str(self.workdir),
            ],
        )
        _wait_port(self.port, process, log, timeout_s)
        return self


# A get holds a lease on the value for this long; a transfer still running when it ends fails (LEASE_EXPIRED).
# At 100 ms a get of a block on a busy machine (load average 6-8 on 2 cores) ran past it and a value
# that was there read as a miss. Our removes are forced (cache_impl/cache/tiers/remote.py), so nothing waits
# on a lease: Mooncake's own default.
LEASE_TTL_MS = 5000


class MooncakePool(_Processes):
    def __init__(self, workdir: Optional[Path] = None, segment: str = "512MB") -> None:
        super().__init__(workdir)
        self.metadata_port, self.master_port = free_port(), free_port()
        self.metrics_port, self.client_port = free_port(), free_port()
        self.segment = segment

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.master}?metadata={self.metadata_url}"

    def start(self, timeout_s: float = 30) -> "MooncakePool":
        loopback = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        process, log = self.spawn("metadata", [
            _program("mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port", str(self.metadata_port),
            "--log-level", "WARNING"], loopback)
        _wait_port(self.metadata_port, process, log, timeout_s)
        process, log = self.spawn("master", [
            _program("mooncake_master"), "-rpc_address=127.0.0.1", f"-rpc_port={self.master_port}",
            "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
            "-enable_http_metadata_server=false", f"-default_kv_lease_ttl={LEASE_TTL_MS}"], loopback)
        _wait_port(self.master_port, process, log, timeout_s)
        process, log = self.spawn("client", [
            _program("mooncake_client"), "-host=127.0.0.1", f"-port={self.client_port}",
            f"-master_server_address={self.master}", f"-metadata_server={self.metadata_url}",
            f"-global_segment_size={self.segment}", "-protocol=tcp"], loopback)
        _wait_port(self.client_port, process, log, timeout_s)
        return self
