"""The pre-flight's probes for the sizing model (sizing/machine.py reads their figures): this machine's speed at
the embedded model's shapes (`python -m cache_impl.machine_probe`, in its own process, on the machine and device
the embedded engine uses), and the prefill probe: the recompute server's own first-token times at a few prompt
lengths across the run's range, over HTTP as the gates send them, one request at a time."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from workloads.client import StreamingClient
from workloads.datasets import CHAT_FRAMING_TOKENS, context_request

PROBE_TIMEOUT_S = 120.0       # the probe takes a second or two and torch's import; a stuck one is dropped
PREFILL_ROLE = "recompute"    # the embedded server that computes every prompt from scratch
# The prefill probe's prompt lengths: the shortest the server takes (its fixed cost), one cache block, and
# 3/16, 9/16 and 15/16 of the longest context the run asks for (off G2's usual lengths, across its range)
PREFILL_SHORT = (CHAT_FRAMING_TOKENS + 8, 256)
PREFILL_FRACTIONS = (3 / 16, 9 / 16, 15 / 16)
PREFILL_ROUNDS = 3            # each length's figure is the median of its rounds
PREFILL_TIMEOUT_S = 120.0     # per request


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


def probe_machine(embedded, endpoints: dict, longest_context: int, run_id: str = "run") -> dict:
    """The probe's figures (`run_machine_probe`) with the prefill probe's (`prefill_probe`) under "prefill"."""
    probe = run_machine_probe(embedded)
    if "error" not in probe and PREFILL_ROLE in endpoints:
        probe["prefill"] = prefill_probe(endpoints[PREFILL_ROLE], longest_context, run_id)
    return probe


def prefill_lengths(longest_context: int, block_tokens: int = 256) -> list[int]:
    """The context lengths the prefill probe sends (module constants), each a distinct length ≤ the longest."""
    spread = {max(block_tokens, round(longest_context * f / 64) * 64) for f in PREFILL_FRACTIONS}
    return sorted({n for n in (*PREFILL_SHORT, *spread) if n <= longest_context})


def prefill_probe(endpoint, longest_context: int, run_id: str = "run", rounds: int = PREFILL_ROUNDS) -> dict:
    """The server's first-token time at each of `prefill_lengths`, sent one at a time, round after round (each
    prompt new: nothing is cached), {"role", "points": [{"context_tokens", "prompt_tokens", "seconds" (the
    median), "rounds"}], "seconds"}; {"error": why} when a request failed."""
    started = time.monotonic()
    client = StreamingClient(endpoint.url, endpoint.model, endpoint.api, target=f"preflight-{endpoint.role}",
                             timeout_s=PREFILL_TIMEOUT_S)
    lengths = prefill_lengths(longest_context)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    prompts: dict[int, int] = {}
    try:
        for round_ in range(rounds):
            for n in lengths:
                record = client.send(context_request(n, f"{run_id}/{n}/{round_}", endpoint.tokenizer, 1,
                                                     "preflight-prefill"))
                if not record.ok or record.ttft_s is None:
                    return {"role": endpoint.role, "error": f"the prefill probe's {n}-token request failed: "
                                                            f"{record.error_type}: {record.error_message}"}
                times[n].append(record.ttft_s)
                prompts[n] = record.prompt_tokens or n
    finally:
        client.close()
    points = [{"context_tokens": n, "prompt_tokens": prompts[n], "seconds": statistics.median(times[n]),
               "rounds": times[n]} for n in lengths]
    return {"role": endpoint.role, "points": points, "seconds": time.monotonic() - started}
