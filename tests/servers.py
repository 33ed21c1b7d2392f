"""A real `kvgate serve` subprocess for tests: free loopback port, own cache directory, clean stop."""

from __future__ import annotations

import os
import random
import secrets
import signal
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cache_impl.server.auth import ADMIN_TOKEN_ENV
from workloads.traffic.processes import free_port

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 30

# `kvgate serve` exits 0 after SIGTERM (a graceful drain); anything else is a failure.
TEARDOWN_EXIT_CODES = (0,)
# The admin token of every --admin server the tests start; tests/conftest.py puts it in this
# process's environment, where workloads.probes.faults.AdminClient looks for it (as in a gate suite).
ADMIN_TOKEN = secrets.token_urlsafe(24)


# -- the server subprocess ---------------------------------------------------------


# the storage sweep (fio.sweep) cut to one read and one write point, for runs whose G1/G2 sweep is not the subject
TINY_SWEEP = {"read_bs": ["1M"], "iodepths": [4], "numjobs": [1], "modes": ["direct"], "ioengines": ["libaio"],
              "write_bs": ["1M"], "write_numjobs": [1], "write_modes": ["buffered"], "size": "16M", "runtime_s": 1}

def http_client(port: int, timeout: float = 30) -> httpx.Client:
    # trust_env=False: no proxy from the environment, the traffic stays on loopback.
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout, trust_env=False)


def metrics(http: httpx.Client) -> dict[str, list]:
    """Prometheus samples of GET /metrics by sample name (e.g. `kvgate_cache_hits_total`)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric_value(samples: dict[str, list], name: str, **labels: str) -> float:
    """The value of one sample; 0 for a labelled sample not exported yet (a counter never incremented)."""
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    if not matching and labels:
        return 0.0
    assert len(matching) == 1, f"expected one sample {name}{labels}, found {matching}"
    return matching[0]


class ServerProcess:
    """One `kvgate serve` subprocess; its output goes to a log file read on failure."""

    def __init__(self, workdir: Path, api_key: Optional[str] = None, preset: Optional[str] = "tiny",
                 mode: str = "tiered", engine: Optional[dict] = None, cache_dir: Optional[Path] = None,
                 admin: bool = False, extra_args: tuple[str, ...] = (),
                 entry: tuple[str, ...] = ("gates.cli", "serve")) -> None:
        """`engine`: settings of the config file's `engine:` section; `cache_dir`: default workdir/cache;
        `admin`: with the admin routes, guarded by ADMIN_TOKEN; `preset` None: no --preset (--weights names it);
        `entry`: the module run with `python -m` and its arguments (("cache_impl.server.serve_command",):
        kvgate-serve)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.cache_dir = cache_dir or workdir / "cache"
        self.log_path = workdir / f"server-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_API_KEY", ADMIN_TOKEN_ENV)}
        if api_key is not None:
            env["KVGATE_API_KEY"] = api_key
        if admin:
            env[ADMIN_TOKEN_ENV] = ADMIN_TOKEN
        command = [sys.executable, "-m", *entry, *(("--preset", preset) if preset else ()),
                   "--mode", mode, "--host", "127.0.0.1", "--port", str(self.port), "--cache-dir", str(self.cache_dir)]
        if engine is not None:
            config = workdir / f"engine-{self.port}.yaml"
            config.write_text(yaml.safe_dump({"engine": engine}))
            command += ["--config", str(config)]
        if admin:
            command.append("--admin")
        command += list(extra_args)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with http_client(self.port, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    pytest.fail(f"kvgate serve exited with {self.process.returncode} at startup:\n{self.log()}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        pytest.fail(f"kvgate serve was not healthy within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> Optional[int]:
        """SIGTERM and wait; the exit code, or None when it had to be killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return None


def started_server(workdir: Path, api_key: Optional[str] = None, **options):
    """Fixture body: a healthy server, stopped at teardown; it must exit by itself, cleanly."""
    server = ServerProcess(workdir, api_key, **options)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()  # never leave a half-started server behind
        raise
    yield server
    code = server.stop()
    assert code in TEARDOWN_EXIT_CODES, f"kvgate serve exit code {code} after SIGTERM:\n{server.log()}"


def started_pool_nodes(workdirs, pool_url: str):
    """Fixture body: tiered `kvgate serve --admin` nodes, each with its own disk directory, sharing the pool at
    `pool_url` (`--remote URL`); healthy, and stopped at teardown."""
    nodes = [ServerProcess(workdir, admin=True, extra_args=("--remote", pool_url)) for workdir in workdirs]
    try:
        for node in nodes:
            node.wait_healthy()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


# -- asking a server, and the recompute oracle ----------------------------------------

TINY_MODEL = "kvgate-tiny"


def distinct_prompt(tag: str, length: int = 1400) -> str:
    """A distinct printable prompt (one token per character): 5 full 256-token blocks at 1400 characters."""
    rng = random.Random(tag)
    return tag + ": " + "".join(rng.choice(string.ascii_letters + " ") for _ in range(length - len(tag) - 2))


def ask(server, prompt: str, max_tokens: int = 12) -> dict:
    """A greedy completion; its text and how many prompt tokens came from the cache (asserts HTTP 200)."""
    with http_client(server.port, timeout=60) as http:
        response = http.post("/v1/completions", json={"model": TINY_MODEL, "prompt": prompt,
                                                      "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, f"HTTP {response.status_code}: {response.text}"
    body = response.json()
    return {"text": body["choices"][0]["text"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


class Oracle:
    """Answers of a recompute-mode server, asked once per prompt."""

    def __init__(self, server) -> None:
        self.server, self.answers = server, {}

    def __call__(self, prompt: str) -> str:
        if prompt not in self.answers:
            answer = ask(self.server, prompt)
            assert answer["cached"] == 0
            self.answers[prompt] = answer["text"]
        return self.answers[prompt]
