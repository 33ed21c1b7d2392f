"""The pre-flight's machine probe, run by the gates for the sizing model (sizing/machine.py reads its figures):
`python -m cache_impl.machine_probe` in its own process, on the machine and device the embedded engine uses,
and the fixed overhead of a warm two-token request measured on the embedded servers."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

from .preflight import run_preflight

PROBE_TIMEOUT_S = 120.0       # the probe takes a second or two and torch's import; a stuck one is dropped


def run_machine_probe(embedded, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The probe's figures for the embedded targets' preset (`python -m cache_impl.machine_probe`), or
    {"error": why} when it could not run: the sizing model is informational, a probe never stops a run."""
    command = [sys.executable, "-m", "cache_impl.machine_probe", "--preset", embedded.preset,
               "--max-batch", str(embedded.max_running)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the machine probe did not finish within {timeout_s:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return {"error": f"the machine probe exited {done.returncode}: {last}"}
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"error": f"the machine probe printed no JSON: {done.stdout[:200]!r}"}


def probe_machine(embedded, endpoints: dict) -> dict:
    """The probe's figures (`run_machine_probe`) with the fixed overhead measured on the warm `endpoints`."""
    probe = run_machine_probe(embedded)
    if "error" not in probe:
        probe["fixed_overhead_s"] = warm_first_token_s(endpoints)
    return probe


def warm_first_token_s(endpoints: dict) -> Optional[float]:
    """The least first-token time of the pre-flight's request sent again to every node, or None when none answered."""
    ttfts = [r.ttft_s for r in run_preflight(endpoints) if r.ok and r.ttft_s is not None]
    return min(ttfts) if ttfts else None
