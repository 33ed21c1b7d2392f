"""Request errors: their types, a summary by type for reasons, and telling a target that stopped answering.

A record's `error_type` is set by the streaming client (`workloads.traffic.client`):

- `connection_refused`, `connection_reset`, `timeout`: the target did not answer (CONNECTION_ERRORS);
- `http_<status>`: it answered with an error status (the message starts with the error's code);
- `read`, `stream_error`, `incomplete_stream`: the answer broke off or was malformed;
- `bad_response`: a field of the answer had the wrong type (`workloads.traffic.target_json`; the message names
  the field, what was expected and what was found).

`DeadTargetDetector` watches the outcomes of a load process: a run of connection errors with
no answered request between them (`StopRule`: so many in a row, or for so long) means the
target stopped answering, and the step ends early instead of hammering it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

CONNECTION_ERRORS = frozenset({"connection_refused", "connection_reset", "timeout"})
EXAMPLE_CHARS = 80


def summarize_errors(records: Iterable[dict]) -> dict[str, dict]:
    """{error_type: {"count": n, "example": the first message}} of the failed records, most frequent first."""
    found: dict[str, dict] = {}
    for r in records:
        if r.get("ok"):
            continue
        kind = r.get("error_type") or "unknown"
        entry = found.setdefault(kind, {"count": 0, "example": r.get("error_message") or ""})
        entry["count"] += 1
    return dict(sorted(found.items(), key=lambda item: -item[1]["count"]))


def merge_error_summaries(summaries: Iterable[dict[str, dict]]) -> dict[str, dict]:
    """One summary of several (the G4 windows'): counts added, the first example kept, most frequent first."""
    found: dict[str, dict] = {}
    for summary in summaries:
        for kind, entry in (summary or {}).items():
            merged = found.setdefault(kind, {"count": 0, "example": entry.get("example", "")})
            merged["count"] += entry.get("count", 0)
    return dict(sorted(found.items(), key=lambda item: -item[1]["count"]))


def describe_errors(summary: dict[str, dict], limit: int = 4) -> str:
    """"412 connection_refused (e.g. 'Connection refused'), 3 http_400 (e.g. 'context_length_exceeded: …')"."""
    parts = [f"{e['count']} {kind} (e.g. {_shorten(e['example'])!r})" for kind, e in list(summary.items())[:limit]]
    rest = sum(e["count"] for e in list(summary.values())[limit:])
    return ", ".join(parts + ([f"{rest} more ({len(summary) - limit} other types)"] if rest else []))


def describe_error(error_type: Optional[str], message: Optional[str]) -> str:
    """One failure in words: 'connection refused', 'HTTP 400 context_length_exceeded: …', 'timed out'."""
    message = message or ""
    if error_type == "connection_refused":
        return "connection refused"
    if error_type == "connection_reset":
        return f"connection reset ({message})" if message else "connection reset"
    if error_type == "timeout":
        return f"timed out ({message})" if message and message != "timed out" else "timed out"
    if error_type and error_type.startswith("http_"):
        return f"HTTP {error_type[5:]} {message}".rstrip()
    return f"{error_type}: {message}" if message else str(error_type)


def _shorten(text: str) -> str:
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 1] + "…"


@dataclass(frozen=True)
class StopRule:
    """When a load process judges its target dead: connection errors with no answer between them,
    `errors_in_a_row` of them, or for `silent_s` seconds (whichever comes first)."""

    errors_in_a_row: int = 10
    silent_s: float = 5.0

    def __post_init__(self) -> None:
        if self.errors_in_a_row < 1 or not self.silent_s > 0:
            raise ValueError(f"stop rule: expected errors_in_a_row >= 1 and silent_s > 0, found {self}")


class DeadTargetDetector:
    """Counts connection errors since the last answer (any HTTP response counts as an answer)."""

    def __init__(self, rule: StopRule, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule, self._clock = rule, clock
        self.in_a_row = 0
        self._since: Optional[float] = None
        self._last: tuple[Optional[str], Optional[str]] = (None, None)

    def observe(self, error_type: Optional[str], message: Optional[str] = None) -> bool:
        """Take one request's outcome (error_type None: it succeeded); True when the target is judged dead."""
        if error_type not in CONNECTION_ERRORS:
            self.in_a_row, self._since = 0, None
            return False
        self.in_a_row += 1
        self._since = self._clock() if self._since is None else self._since
        self._last = (error_type, message)
        return self.in_a_row >= self.rule.errors_in_a_row or self.silent_s >= self.rule.silent_s

    @property
    def silent_s(self) -> float:
        return 0.0 if self._since is None else self._clock() - self._since

    def reason(self) -> str:
        """'target stopped answering: connection refused (10 in a row)' (or '… for 5.1 s')."""
        what = describe_error(*self._last)
        if self.in_a_row >= self.rule.errors_in_a_row:
            return f"target stopped answering: {what} ({self.in_a_row} in a row)"
        return f"target stopped answering: {what} ({self.in_a_row} in a row over {self.silent_s:.1f} s)"
