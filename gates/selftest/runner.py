"""Run each control through the real gates: start its servers, write its gates.yaml, run `kvgate run` as a
subprocess, read the verdicts from the run's results.json and judge them against the control's expectations.

Everything a control leaves is under `<out>/<control key>/`: gates.yaml, the servers' logs, gate.log (the
gate run's output) and run/ (the run directory, rendered as any run is). `<out>/selftest.json` is the
summary: per control its verdicts, what it should have got and OK / WRONG.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from kvcore.files import write_json
from workloads.traffic.client import StreamingClient, TargetError
from workloads.traffic.processes import die_with_parent, free_port

from .controls import Control, Server, g3_run_seconds, gates_yaml
from .expectations import Finding, invalid_steps, run_completed

START_TIMEOUT_S = {"mock": 30.0, "serve": 180.0}
GATE_TIMEOUT_S = {"quick": 900.0, "full": 3600.0}
SERVE_TOKENIZER = "kvgate-byte-v1"


class ServerStartError(RuntimeError):
    """A control's server did not come up: its name and last log lines."""


@dataclass
class ControlResult:
    """A control's outcome: what it got, what it should have got, and whether the two agree."""

    key: str
    title: str
    findings: list[Finding]
    exit_code: Optional[int] = None
    problem: str = ""            # the run itself went wrong (a server did not start, the gate wrote no results)
    seconds: float = 0.0
    run_dir: str = ""
    invalid_steps: list[dict] = field(default_factory=list)   # the run's invalid G3 steps (expectations.py)
    expects: list[str] = field(default_factory=list)   # what the control expects, said even when its run gave nothing

    @property
    def ok(self) -> bool:
        return not self.problem and bool(self.findings) and all(f.ok for f in self.findings)

    def got(self) -> str:
        parts = [text for finding in self.findings for text in finding.got()]
        return "; ".join(dict.fromkeys(parts)) or "no verdicts"

    def line(self) -> str:
        expected = "; ".join(f.expected for f in self.findings) or "; ".join(self.expects) or "-"
        why = [self.problem] if self.problem else [f.problem for f in self.findings if f.problem]
        verdict = "OK" if self.ok else "WRONG: " + "; ".join(why)
        invalid = ", ".join(step["step"] for step in self.invalid_steps)
        return f"{self.key}: got {self.got()}" + (f" (invalid steps: {invalid})" if invalid else "") + \
            f" | expected {expected} | {verdict}"

    def to_dict(self) -> dict:
        return {"control": self.key, "title": self.title, "ok": self.ok, "problem": self.problem,
                "exit_code": self.exit_code, "seconds": round(self.seconds, 1), "run_dir": self.run_dir,
                "invalid_steps": self.invalid_steps,
                "expectations": [{"expected": f.expected, "ok": f.ok, "problem": f.problem, "rows": list(f.rows)}
                                 for f in self.findings]}


@dataclass
class Started:
    """A server a control started: its process, base URL, the model it serves and the tokenizer to size prompts."""

    process: subprocess.Popen
    url: str
    model: str
    tokenizer: Optional[str]


def _command(server: Server, port: int, profile: str, directory: Path) -> list[str]:
    if server.kind == "serve":
        return [sys.executable, "-m", "gates.cli", "serve", "--mode", "tiered", "--port", str(port),
                "--cache-dir", str(directory / "kv-serve")]
    drift = ("--drift-s", f"{g3_run_seconds(profile):g}") if server.drifts else ()
    return [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), *server.flags, *drift]


def start_server(name: str, server: Server, profile: str, directory: Path) -> Started:
    """Start one server and wait until it lists a model (GET /v1/models); ServerStartError otherwise."""
    port = free_port()
    log = directory / f"server-{name}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(_command(server, port, profile, directory), stdout=output,
                                   stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_TIMEOUT_S[server.kind]
    while time.monotonic() < deadline and process.poll() is None:
        client = StreamingClient(url, "probe", timeout_s=2.0)
        try:
            models = client.served_models()
            if models:
                return Started(process, url, models[0], SERVE_TOKENIZER if server.kind == "serve" else None)
        except TargetError:
            pass
        finally:
            client.close()
        time.sleep(0.3)
    exited = process.poll()
    stop_server(process)
    what = (f"exited ({exited}) before it listed a model" if exited is not None
            else f"listed no model within {START_TIMEOUT_S[server.kind]:.0f} s")
    last = _last_line(log)
    raise ServerStartError(f"server {name} {what}" + (f": {last}" if last else ""))


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s (`kvgate serve` drains and flushes on SIGTERM)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def run_gates(control: Control, config_path: Path, run_dir: Path, log: Path, timeout_s: float) -> int:
    """`kvgate run <gates> --config … --out …` as a subprocess of this interpreter; its exit code (124: timeout)."""
    command = [sys.executable, "-m", "gates.cli", "run", *control.gates, "--config", str(config_path),
               "--out", str(run_dir)]
    with log.open("wb") as output:
        try:
            return subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=config_path.parent, preexec_fn=die_with_parent).returncode
        except subprocess.TimeoutExpired:
            return 124


def run_control(control: Control, profile: str, out: Path) -> ControlResult:
    """Start what the control needs, run its gates, stop what it started and judge the results."""
    directory = out / control.key
    directory.mkdir(parents=True, exist_ok=True)
    result = ControlResult(control.key, control.title, [], run_dir=str(directory / "run"),
                           expects=[expectation.describe() for expectation in control.expectations])
    started: dict[str, Started] = {}
    begun = time.monotonic()
    try:
        for name, server in control.servers.items():
            started[name] = start_server(name, server, profile, directory)
        config = gates_yaml(control, profile, str(directory / "storage"), {n: s.url for n, s in started.items()},
                            {n: s.model for n, s in started.items()}, {n: s.tokenizer for n, s in started.items()})
        config_path = directory / "gates.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        result.exit_code = run_gates(control, config_path, directory / "run", directory / "gate.log",
                                     GATE_TIMEOUT_S[profile])
    except ServerStartError as error:
        result.problem = str(error)
    finally:
        for running in started.values():
            stop_server(running.process)
        result.seconds = time.monotonic() - begun
    if not result.problem:
        _judge(control, result, directory)
    return result


def _judge(control: Control, result: ControlResult, directory: Path) -> None:
    results_path = directory / "run" / "results.json"
    if not run_completed(control.expectations, result.exit_code) or not results_path.exists():
        what = "timed out" if result.exit_code == 124 else f"exit {result.exit_code}"
        how = "did not end as expected" if run_completed(control.expectations, 2) else "did not complete"
        result.problem = f"the gate run {how} ({what}): {_last_line(directory / 'gate.log') or 'no output'}"
    if results_path.exists():
        results = json.loads(results_path.read_text())
        result.findings = [expectation.check(results) for expectation in control.expectations]
        result.invalid_steps = invalid_steps(results)


@dataclass
class Selftest:
    """The whole suite's outcome."""

    profile: str
    results: list[ControlResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    def to_dict(self) -> dict:
        return {"profile": self.profile, "ok": self.ok, "seconds": round(self.seconds, 1),
                "controls": [r.to_dict() for r in self.results]}


def run_selftest(controls: list[Control], profile: str, out: Path,
                 on_result: Callable[[ControlResult], None] = lambda result: None) -> Selftest:
    """Every control in turn (one at a time: they measure timing); `<out>/selftest.json` rewritten after each.
    A relative `out` is taken from the current directory (each control's run starts in its own directory)."""
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    suite = Selftest(profile)
    begun = time.monotonic()
    for control in controls:
        suite.results.append(run_control(control, profile, out))
        suite.seconds = time.monotonic() - begun
        write_json(out / "selftest.json", suite.to_dict())
        on_result(suite.results[-1])
    return suite
