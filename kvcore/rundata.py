"""The run data's schema, below both `gates/` (which write it) and `reports/` (which read it).

How it works: docs/methods/measurement.md (kvcore/rundata.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from .files import JsonlTail, append_jsonl, read_jsonl, read_jsonl_file, write_json
from .settings import ConfigError

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
STATUSES = (PASS, FAIL, INCONCLUSIVE)
GATES = ("g1", "g2", "g3", "g4")


def finite_number(value: Any) -> Optional[float]:
    """A stored figure as a float when it is a finite number (not a bool, None, NaN or text); else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None
PROGRESS_KINDS = ("step", "live")
GATE_TITLES = {"g1": "G1 arrival acceptance", "g2": "G2 single-node baseline", "g3": "G3 main gate",
               "g4": "G4 stability"}


@dataclass(frozen=True)
class Verdict:
    """One judged check."""

    gate: str
    check: str
    metric: str
    status: str
    reason: str
    value: Optional[float]
    unit: str
    rule: dict
    interval: Optional[tuple[float, float]] = None
    note: str = ""
    context: dict = field(default_factory=dict)
    valid: bool = True              # False: the figure came from an invalid step (INCONCLUSIVE, `invalid_reason`)
    invalid_reason: str = ""

    def to_dict(self) -> dict:
        row: dict[str, Any] = {"gate": self.gate, "check": self.check, "metric": self.metric,
                               "status": self.status, "reason": self.reason,
                               "value": None if self.value is None else float(self.value),
                               "unit": self.unit, "rule": dict(self.rule)}
        if self.interval is not None:
            row["interval"] = [float(self.interval[0]), float(self.interval[1])]
        if self.note:
            row["note"] = self.note
        if self.context:
            row["context"] = dict(self.context)
        if not self.valid:   # written only when invalid: a row without it is valid (kvcore.judged)
            row["valid"], row["invalid_reason"] = False, self.invalid_reason
        return row

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        interval = data.get("interval")
        return cls(gate=data["gate"], check=data["check"], metric=data["metric"], status=data["status"],
                   reason=data["reason"], value=data.get("value"), unit=data.get("unit", ""),
                   rule=dict(data.get("rule", {})), interval=None if interval is None else tuple(interval),
                   note=data.get("note", ""), context=dict(data.get("context") or {}),
                   valid=bool(data.get("valid", True)), invalid_reason=str(data.get("invalid_reason") or ""))


@dataclass(frozen=True)
class Unjudged:
    """A check the gate measured but did not judge, and why (shown at the top of the gate's section)."""

    gate: str
    check: str
    metric: str
    label: str
    reason: str
    value: Optional[float] = None
    unit: str = ""
    context: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, "", {})} | {"reason": self.reason}


@dataclass(frozen=True)
class Errored:
    """A check that erred outside its verdict: its setup (a fixture), its call or its teardown raised.

    `reason` is the exception's one line (no traceback: that stays in pytest.log); `metrics` are the declared
    metrics the check would have judged, as far as its code names them (the claims table says why one is
    missing).
    """

    gate: str
    check: str
    phase: str                      # setup, call or teardown
    reason: str
    metrics: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"gate": self.gate, "check": self.check, "phase": self.phase, "reason": self.reason,
                "metrics": list(self.metrics)}


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
        """A Measurement: {gate, check, metric, value, unit, t, context?}."""
        row = {"gate": gate, "check": check, "metric": metric, "value": value, "unit": unit, "t": time.time()}
        if context:
            row["context"] = context
        append_jsonl(self.gate_dir(gate) / "measurements.jsonl", row)
        return row

    def add_verdict(self, verdict: Verdict | dict) -> None:
        row = verdict.to_dict() if isinstance(verdict, Verdict) else dict(verdict)
        append_jsonl(self.gate_dir(row["gate"]) / "verdicts.jsonl", {**row, "t": time.time()})

    def add_unjudged(self, unjudged: Unjudged) -> None:
        append_jsonl(self.gate_dir(unjudged.gate) / "unjudged.jsonl", {**unjudged.to_dict(), "t": time.time()})

    def add_error(self, errored: Errored) -> None:
        append_jsonl(self.gate_dir(errored.gate) / "errors.jsonl", {**errored.to_dict(), "t": time.time()})

    def measurements(self, gate: Optional[str] = None) -> list[dict]:
        return self._rows(gate, "measurements.jsonl")

    def verdicts(self, gate: Optional[str] = None) -> list[dict]:
        return self._rows(gate, "verdicts.jsonl")

    def unjudged(self, gate: Optional[str] = None) -> list[dict]:
        return self._rows(gate, "unjudged.jsonl")

    def errors(self, gate: Optional[str] = None) -> list[dict]:
        return self._rows(gate, "errors.jsonl")

    def latest(self, gate: str, metric: str, check: Optional[str] = None) -> Optional[dict]:
        """The last measurement of a metric in a gate."""
        rows = [m for m in self.measurements(gate) if m["metric"] == metric and (check is None or m["check"] == check)]
        return rows[-1] if rows else None

    def set_status(self, gate: str, status: str, reason: str = "", **extra: Any) -> None:
        write_json(self.gate_dir(gate) / "status.json", {"gate": gate, "status": status, "reason": reason, **extra})

    def add_predictions(self, stage: str, rows: Iterable[dict]) -> None:
        """The sizing model's predicted figures at one stage of the run ("before g2": from the config and
        what the gates before G2 measured), appended as made."""
        for row in rows:
            append_jsonl(self.root / "predictions.jsonl", {**row, "stage": stage, "t": time.time()})

    def predictions(self) -> list[dict]:
        return read_jsonl_file(self.root / "predictions.jsonl")

    def write_sizing(self, sizing: dict) -> None:
        write_json(self.root / "sizing.json", sizing)

    def sizing(self) -> dict:
        """sizing.json ({} when the run has none)."""
        path = self.root / "sizing.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def set_progress(self, gate: str, text: str, kind: str = "step") -> None:
        """What the gate is doing now, one line (the console shows it beside the gate's spinner).

        kind "step": a step started or ended (also appended to the step lines, which a console that is
        not a terminal prints, one each); "live": the figures of a running step, replaced every few
        seconds (shown by the spinner only, so CI logs do not fill with them).
        """
        if kind not in PROGRESS_KINDS:
            raise ValueError(f"progress kind: expected one of {', '.join(PROGRESS_KINDS)}, found {kind!r}")
        row = {"gate": gate, "text": text, "kind": kind, "t": time.time()}
        if kind == "step":
            append_jsonl(self.gate_dir(gate) / "progress.jsonl", row)
        write_json(self.gate_dir(gate) / "progress.json", row)

    def progress(self, gate: str) -> str:
        """The gate's last progress line, step or live ("" when none, or unreadable mid-replace)."""
        try:
            return str(json.loads((self.gate_dir(gate) / "progress.json").read_text()).get("text", ""))
        except (OSError, ValueError):
            return ""

    def progress_steps(self, gate: str) -> JsonlTail:
        """A reader of the gate's step lines: each `read_new()` gives the rows appended since the last."""
        return JsonlTail(self.gate_dir(gate), "progress.jsonl")

    def status(self, gate: str) -> Optional[dict]:
        path = self.gate_dir(gate) / "status.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run_info(self) -> dict:
        """run.json ({} when absent); ConfigError when it is not a JSON object (a run directory it is not)."""
        path = self.root / "run.json"
        if not path.exists():
            return {}
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: expected a run's JSON object, found unreadable JSON ({error})") from None
        if not isinstance(info, dict):
            raise ConfigError(f"{path}: expected a run's JSON object, found a {type(info).__name__}")
        return info

    def write_run_info(self, info: dict) -> None:
        write_json(self.root / "run.json", info)

    def write_preflight(self, rows: list[dict]) -> None:
        write_json(self.root / "preflight.json", rows)

    def preflight(self) -> list[dict]:
        path = self.root / "preflight.json"
        return json.loads(path.read_text()) if path.exists() else []

    def write_machine_probe(self, figures: dict) -> None:
        """What the pre-flight measured of this machine for the sizing model (sizing/machine.py)."""
        write_json(self.root / "machine_probe.json", figures)

    def machine_probe(self) -> dict:
        """machine_probe.json ({} when the run has none)."""
        path = self.root / "machine_probe.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _rows(self, gate: Optional[str], name: str) -> list[dict]:
        gates: Iterable[str] = [gate] if gate else GATES
        return [row for g in gates for row in read_jsonl_file(self.gate_dir(g) / name)]


def read_records(directory: Path) -> list[dict]:
    """Every request record of every load process in a directory (workloads/traffic/client.py's RecordWriter writes
    one records-NAME.jsonl per process)."""
    return read_jsonl(directory, "records-*.jsonl")
