"""The run directory: append-only raw data first, everything else derived from it.

Layout of `reports/runs/<run-id>/` (or `--out`)::

    run.json                      run id, profile, requested gates, environment fingerprint
    config.yaml                   the resolved configuration the run used
    gates/<gate>/measurements.jsonl   one JSON object per measurement, appended as measured
    gates/<gate>/verdicts.jsonl       one JSON object per judged check, appended as judged
    gates/<gate>/status.json          the gate's outcome once it ended (or "not run")
    gates/<gate>/junit.xml            pytest's JUnit report of the gate's suite
    gates/<gate>/raw/                 raw files (fio JSON, request records, soak windows)
    results.json, junit.xml, index.html   rendered by `reports` from the above

A measurement: {"gate", "check", "metric", "value", "unit", "t", "context"?: {...}}.
A verdict: {"gate", "check", "metric", "status": PASS|FAIL|INCONCLUSIVE, "reason",
"value", "unit", "rule", "interval"?: [lo, hi], "note"?, "t"}.
A gate status: {"gate", "status": passed|failed|inconclusive|error|not run, "reason",
"started_at"?, "ended_at"?, "pytest_exit_code"?}.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from workloads.client import read_jsonl_file

GATES = ("g1", "g2", "g3", "g4")
GATE_TITLES = {"g1": "G1 arrival acceptance", "g2": "G2 single-node baseline", "g3": "G3 main gate",
               "g4": "G4 stability"}
_lock = threading.Lock()


def append_jsonl(path: Path, row: dict) -> None:
    """Append one JSON line and flush it to the file at once (a crash loses nothing already written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode()
    with _lock:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


read_jsonl = read_jsonl_file  # the run store's JSONL files follow the load engine's append-only rules


def write_json(path: Path, data: Any) -> None:
    """Replace a JSON file atomically (temp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temp, path)


class RunStore:
    """Reads and appends the raw data of one run directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def gate_dir(self, gate: str) -> Path:
        return self.root / "gates" / gate

    def raw_dir(self, gate: str) -> Path:
        path = self.gate_dir(gate) / "raw"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def record(self, gate: str, check: str, metric: str, value: Any, unit: str = "", **context: Any) -> dict:
        row = {"gate": gate, "check": check, "metric": metric, "value": value, "unit": unit, "t": time.time()}
        if context:
            row["context"] = context
        append_jsonl(self.gate_dir(gate) / "measurements.jsonl", row)
        return row

    def add_verdict(self, verdict: dict) -> None:
        append_jsonl(self.gate_dir(verdict["gate"]) / "verdicts.jsonl", {**verdict, "t": time.time()})

    def measurements(self, gate: Optional[str] = None) -> list[dict]:
        return [row for g in self._gates(gate) for row in read_jsonl(self.gate_dir(g) / "measurements.jsonl")]

    def verdicts(self, gate: Optional[str] = None) -> list[dict]:
        return [row for g in self._gates(gate) for row in read_jsonl(self.gate_dir(g) / "verdicts.jsonl")]

    def latest(self, gate: str, metric: str, check: Optional[str] = None) -> Optional[dict]:
        """The last measurement of a metric in a gate (e.g. G2 reading G1's fio figure)."""
        rows = [m for m in self.measurements(gate) if m["metric"] == metric and (check is None or m["check"] == check)]
        return rows[-1] if rows else None

    def set_status(self, gate: str, status: str, reason: str = "", **extra: Any) -> None:
        write_json(self.gate_dir(gate) / "status.json", {"gate": gate, "status": status, "reason": reason, **extra})

    def status(self, gate: str) -> Optional[dict]:
        path = self.gate_dir(gate) / "status.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run_info(self) -> dict:
        path = self.root / "run.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def write_run_info(self, info: dict) -> None:
        write_json(self.root / "run.json", info)

    def _gates(self, gate: Optional[str]) -> Iterable[str]:
        return [gate] if gate else GATES
