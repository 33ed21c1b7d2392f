"""A run's overall outcome from its gates' statuses: the one place it is decided.

`kvgate run` exits on it (0: passed, else 1) and the renderer writes it into results.json and shows
it; neither decides it again. The order is failed > inconclusive > incomplete > passed: a gate in
error counts as failed, a requested gate that did not pass (not run, running, stopped by a failure
before it) leaves the run incomplete, and a run with no gate requested is incomplete too.
Torch-free.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

PASSED, FAILED, INCONCLUSIVE, INCOMPLETE = "passed", "failed", "inconclusive", "incomplete"
PROBLEM = ("failed", "error")   # gate statuses that fail the run


def _stopped(gate: Mapping) -> bool:
    """A gate not run because an earlier one failed (stop-loss): that failure, not this gate, is the reason."""
    return gate["status"] == "not run" and "stopped" in str(gate.get("reason", "")).lower()


def overall_status(gates: Sequence[Mapping]) -> tuple[str, Optional[Mapping]]:
    """The run's status and the gate that decides it (None when every requested gate passed, or none was).

    Each gate is a mapping with `gate`, `status`, `requested` and `reason` (results.json's gate rows)."""
    requested = [g for g in gates if g["requested"]]
    failed = [g for g in gates if g["status"] in PROBLEM]
    if failed:
        return FAILED, failed[0]
    inconclusive = [g for g in gates if g["status"] == INCONCLUSIVE]
    if inconclusive:
        return INCONCLUSIVE, inconclusive[0]
    not_passed = [g for g in requested if g["status"] != PASSED]
    if not requested or not_passed:
        unfinished = [g for g in not_passed if not _stopped(g)]
        first = unfinished or not_passed
        return INCOMPLETE, first[0] if first else None
    return PASSED, None


def overall(gates: Sequence[Mapping]) -> dict:
    """results.json's `overall`: the status and a one-line summary naming the deciding gate and every requested
    gate's status ("G3 failed: <its reason> — G1 passed · G2 passed · G3 failed")."""
    status, first = overall_status(gates)
    listing = " · ".join(f"{g['gate'].upper()} {g['status']}" for g in gates if g["requested"])
    if first is None:
        headline = "all requested gates passed" if any(g["requested"] for g in gates) else "no gates requested"
    else:
        reason = str(first.get("reason", "")).strip()
        reason = reason.splitlines()[0] if reason else ""
        headline = f"{first['gate'].upper()} {first['status']}" + (f": {reason}" if reason else "")
    return {"status": status, "summary": f"{headline} — {listing}" if listing else headline}


def exit_code(status: str) -> int:
    """`kvgate run`'s exit code for an overall status: 0 passed, 1 anything else (2, a usage or configuration
    error, is decided before any gate runs)."""
    return 0 if status == PASSED else 1
