"""The run data's schema, below both `gates/` (which write it) and `reports/` (which read it).

How it works: docs/methods/measurement.md (kvcore/rundata.py).
"""

from __future__ import annotations

import fcntl
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from .files import TORN, JsonlTail, append_jsonl, read_jsonl, read_jsonl_file, read_jsonl_lines, write_json
from .settings import ConfigError

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
STATUSES = (PASS, FAIL, INCONCLUSIVE)
GATES = ("g1", "g2", "g3", "g4")
RUN_LOCK = ".kvgate-run.lock"    # held (flock) by the kvgate run writing the directory: gates/run_claim.py


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
        self.left_out: dict[str, str] = {}   # "FILE:LINE" -> why a row read was left out (damaged, not a row)

    def ended_unfinished(self) -> bool:
        """Whether the run that wrote here has ended (its lock is no longer held) without writing its end: killed or
        crashed. False while it runs, and for a directory no locking run wrote."""
        lock = self.root / RUN_LOCK
        if not lock.is_file() or "ended_at" in self.run_info():
            return False
        with open(lock, "rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False            # held: the run is still going
            fcntl.flock(handle, fcntl.LOCK_UN)
        return True

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
        rows = [m for m in self.measurements(gate)
                if m["metric"] == metric and (check is None or m.get("check") == check)]
        return rows[-1] if rows else None

    def figures(self, gate: Optional[str] = None) -> list[dict]:
        """The measurements whose value is a finite number: what a model is fitted to and compared with (text, a
        flag, or NaN where a gate could compute nothing, is no figure)."""
        return [row for row in self.measurements(gate) if finite_number(row.get("value")) is not None]

    def latest_figure(self, gate: str, metric: str) -> Optional[dict]:
        """The last measurement of a metric in a gate whose value is a finite number."""
        rows = [m for m in self.figures(gate) if m["metric"] == metric]
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
        return self._json("sizing.json", dict, {})

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
        """The gate's status record (None before it ends); one that cannot be read (written whole by an atomic
        replace: damaged) is the gate in error, saying so."""
        try:
            return self._json(f"gates/{gate}/status.json", dict, None)
        except ConfigError as error:
            return {"status": "error", "reason": f"its status cannot be read ({error})"}

    def run_info(self) -> dict:
        """run.json ({} when absent); ConfigError when it is not a JSON object (a run directory it is not)."""
        return self._json("run.json", dict, {}, "a run's JSON object")

    def _json(self, name: str, kind: type, default: Any, what: str = "") -> Any:
        """A JSON file of the run (`default` when absent); ConfigError naming it when it cannot be read whole, or
        holds another kind of value than `kind` (a damaged or half-copied run directory)."""
        path = self.root / name
        if not path.exists():
            return default
        what = what or ("a JSON object" if kind is dict else "a JSON list")
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:     # unreadable, a directory, not UTF-8, torn JSON
            raise ConfigError(f"{path}: expected {what}, found {_unreadable(error)}") from None
        if not isinstance(value, kind):
            raise ConfigError(f"{path}: expected {what}, found a {type(value).__name__}")
        return value

    def write_run_info(self, info: dict) -> None:
        write_json(self.root / "run.json", info)

    def write_preflight(self, rows: list[dict]) -> None:
        write_json(self.root / "preflight.json", rows)

    def preflight(self) -> list[dict]:
        return [row for row in self._json("preflight.json", list, []) if isinstance(row, dict)]

    def write_machine_probe(self, figures: dict) -> None:
        """What the pre-flight measured of this machine for the sizing model (sizing/machine.py)."""
        write_json(self.root / "machine_probe.json", figures)

    def machine_probe(self) -> dict:
        """machine_probe.json ({} when the run has none)."""
        return self._json("machine_probe.json", dict, {})

    def _rows(self, gate: Optional[str], name: str) -> list[dict]:
        """The rows of a gate's JSON-lines file that have a row's shape; each line left out is said in `left_out`
        (a torn last line, a damaged one: the rest of the run is read as far as it is whole)."""
        gates: Iterable[str] = [gate] if gate else GATES
        rows = []
        for g in gates:
            path = self.gate_dir(g) / name
            for number, row in enumerate(read_jsonl_lines(path), 1):
                why = _not_a_row(row, name)
                if why:
                    self.left_out[f"{path.relative_to(self.root)}:{number}"] = why
                else:
                    rows.append(row)
        return rows


def left_out_note(store: "RunStore") -> Optional[str]:
    """What of a run's rows was left out as damaged, said in a line (None when nothing was)."""
    if not store.left_out:
        return None
    shown = "; ".join(f"{where} ({why})" for where, why in list(store.left_out.items())[:3])
    more = f"; and {len(store.left_out) - 3} more" if len(store.left_out) > 3 else ""
    return (f"{len(store.left_out)} row{'s' if len(store.left_out) != 1 else ''} of {store.root} left out, "
            f"damaged: {shown}{more}")


def _not_a_row(row: Any, name: str) -> str:
    """Why a JSON line is not a row of its file ("" when it is one)."""
    if not isinstance(row, dict):
        return "not a JSON object" if row is not TORN else "not JSON (torn or damaged)"
    if name in ("measurements.jsonl", "verdicts.jsonl") and not isinstance(row.get("metric"), str):
        return f"metric: expected a name, found {row.get('metric')!r}"
    if not isinstance(row.get("context", {}), dict):
        return f"context: expected a mapping, found {type(row['context']).__name__}"
    return ""      # a NaN value is a figure a gate could not compute (no request completed): kept, no figure to fit


def _unreadable(error: Exception) -> str:
    if isinstance(error, IsADirectoryError):
        return "a directory"
    if isinstance(error, OSError):
        return f"an unreadable file ({error.strerror or error})"
    return f"unreadable JSON ({error})"


def read_records(directory: Path) -> list[dict]:
    """Every request record of every load process in a directory (workloads/traffic/client.py's RecordWriter writes
    one records-NAME.jsonl per process)."""
    return read_jsonl(directory, "records-*.jsonl")
