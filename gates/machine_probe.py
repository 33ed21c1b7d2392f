"""The probes for the sizing model (sizing/machine.py reads their figures): in the pre-flight, this machine's speed
at the embedded model's shapes (`python -m cache_impl.engine.machine_probe`, in its own process, on the machine and
device the embedded engine uses; none for external targets, whose model is not kvgate's); just before the first
gate it predicts (G2, else G3), the prefill probe: the first-token times of the server G2 takes recompute's from
(embedded or external) at a few prompt lengths across the run's range, over HTTP as the gates send them, one new
prompt at a time, and the hit probe: the embedded tiered server's own hits; and the decode probe
(run just before G3, at G3's own context): the same server's gaps between streamed tokens with one sequence and
with its full batch decoding."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Optional

from kvcore.sampling import RoundsConfig
from workloads.probes.faults import AdminClient, AdminError, per_tier
from workloads.traffic.client import StreamingClient
from workloads.traffic.datasets import CHAT_FRAMING_TOKENS, context_request
from workloads.traffic.errors import describe_error

PROBE_TIMEOUT_S = 120.0       # the probe takes a second or two and torch's import; a stuck one is dropped
PREFILL_ROLES = ("recompute", "candidate")   # whose first tokens are recompute's: the recompute reference,
                                             # else the candidate's own misses (as G2 takes them)
BLOCK_TOKENS = 256            # the embedded engine's cache block (and prefill chunk)
# The prefill probe's prompt lengths: the shortest the server takes (its fixed cost), one cache block, and
# 3/16, 9/16 and 15/16 of the longest context the run asks for (off G2's usual lengths, across its range)
PREFILL_SHORT = (CHAT_FRAMING_TOKENS + 8, BLOCK_TOKENS)
PREFILL_FRACTIONS = (3 / 16, 9 / 16, 15 / 16)
# each length's (and hit's) figure is the median of its rounds: 3 of the long ones (a round of every length: ~5 s of
# recompute on the small preset; a fourth left the main job at 10m09s on a slow minute), more of the short ones
# within half a second each (the tiny preset's hits and short prompts take 3-10 ms, and one in three stalls 2-3x)
PREFILL_ROUNDS = RoundsConfig(min=3, max=15, budget_s=0.5)
PREFILL_TIMEOUT_S = 120.0     # per request
# The hit probe: the tiered server's hits at the prefill probe's lengths longer than a block, each placed by the
# admin routes (the tiers evicted above it) before it is asked for again. Per length, the disk hit first: it
# promotes the whole prefix to the tiers above, so the host placement (the device evicted) then finds all of it
# in the host tier, whatever the other lengths' prefixes pushed out of it since (the probe's prefixes together
# may outgrow the host tier, and a host hit asked for first was served from disk). Each hit is checked against
# the server's per-tier hit counters (PLACED_TIER: the tier it must come from).
HITS_ROLE = "candidate"
HIT_PLACEMENTS = {"disk-cold": ("device", "host"), "host-hit": ("device",)}
PLACED_TIER = {"disk-cold": "disk", "host-hit": "host"}
HITS_METRIC = "kvgate_cache_hits_total"
# The decode probe: each sequence generates this many tokens after every other sequence's prompt is in (one
# per step while the others' prompts are computed a block at a time), at least this many gaps timed
DECODE_WINDOW_TOKENS = 32
DECODE_MIN_GAPS = 8


def run_machine_probe(embedded, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The probe's figures for the embedded targets' preset (`python -m cache_impl.engine.machine_probe`), or
    {"error": why} when it could not run: the sizing model is informational, a probe never stops a run."""
    command = [sys.executable, "-m", "cache_impl.engine.machine_probe", "--preset", embedded.preset,
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


def probe_client(endpoint, extra_body: Optional[dict] = None) -> StreamingClient:
    """A client of `endpoint` for a probe's requests (its API key from its `api_key_env`, when it names one)."""
    return endpoint.target(f"preflight-{endpoint.role}").client(timeout_s=PREFILL_TIMEOUT_S, extra_body=extra_body)


def prefill_endpoint(endpoints: dict):
    """The endpoint whose first tokens G2 takes as recompute's (`PREFILL_ROLES`), None when there is none."""
    return next((endpoints[role] for role in PREFILL_ROLES if role in endpoints), None)


def probe_servers(probe: dict, endpoints: dict, longest_context: int, run_id: str = "run",
                  admin_token: Optional[str] = None) -> dict:
    """`probe` (a `run_machine_probe`'s figures; {} for external targets, whose model is not the probe's) with the
    prefill probe's (`prefill_probe`, on `prefill_endpoint`) under "prefill" and the hit probe's (`hit_probe`, the
    tiered server, through its admin routes with `admin_token`) under "hits"; run just before the first gate the
    sizing model predicts, so that they time the servers at that gate's minute."""
    endpoint = prefill_endpoint(endpoints)
    if "error" not in probe and endpoint is not None:
        probe["prefill"] = prefill_probe(endpoint, longest_context, run_id)
    if "error" not in probe and HITS_ROLE in endpoints and endpoints[HITS_ROLE].mode == "tiered":
        probe["hits"] = hit_probe(endpoints[HITS_ROLE], longest_context, run_id, admin_token=admin_token)
    return probe


def prefill_lengths(longest_context: int, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """The context lengths the prefill probe sends (module constants), each a distinct length ≤ the longest."""
    spread = {max(block_tokens, round(longest_context * f / 64) * 64) for f in PREFILL_FRACTIONS}
    return sorted({n for n in (*PREFILL_SHORT, *spread) if n <= longest_context})


def _due(rounds: RoundsConfig, spent: dict[int, list[float]]) -> list[int]:
    """The lengths whose measurement takes another round (`rounds.more` on the seconds each of its rounds took)."""
    return [n for n, seconds in spent.items() if rounds.more(seconds)]


def prefill_probe(endpoint, longest_context: int, run_id: str = "run",
                  rounds: RoundsConfig = PREFILL_ROUNDS) -> dict:
    """The server's first-token time at each of `prefill_lengths`, sent one at a time, round after round (each
    prompt new: nothing is cached), {"role", "points": [{"context_tokens", "prompt_tokens", "seconds" (the
    median), "rounds"}], "seconds"}; {"error": why} when a request failed."""
    started = time.monotonic()
    client = probe_client(endpoint)
    lengths = prefill_lengths(longest_context)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    spent: dict[int, list[float]] = {n: [] for n in lengths}
    prompts: dict[int, int] = {}
    try:
        while due := _due(rounds, spent):
            for n in due:
                sent = time.monotonic()
                record = client.send(context_request(n, f"{run_id}/{n}/{len(times[n])}", endpoint.tokenizer, 1,
                                                     "preflight-prefill"))
                spent[n].append(time.monotonic() - sent)
                if not record.ok or record.ttft_s is None:
                    return {"role": endpoint.role, "error": f"the prefill probe's {n}-token request failed: "
                                                            f"{no_first_token(record)}"}
                times[n].append(record.ttft_s)
                prompts[n] = record.prompt_tokens or n
    finally:
        client.close()
    points = [{"context_tokens": n, "prompt_tokens": prompts[n], "seconds": statistics.median(times[n]),
               "rounds": times[n]} for n in lengths]
    return {"role": endpoint.role, "points": points, "seconds": time.monotonic() - started}


def hit_probe(endpoint, longest_context: int, run_id: str = "run", rounds: RoundsConfig = PREFILL_ROUNDS,
              admin_token: Optional[str] = None) -> dict:
    """The tiered server's first-token time for a prefix cached in its host tier and on its disk alone (pages
    dropped), at the prefill probe's lengths of a block or more: each prompt sent once (a miss: computed, stored,
    written behind to disk), then per round placed by the admin routes and asked for again (the module's order).
    {"role", "points": [{"mode" ("host-hit" or "disk-cold"), "context_tokens", "prompt_tokens", "cached_tokens",
    "seconds" (the median), "rounds", "tiers" (the blocks each tier served over the rounds, by the server's
    counters), "from_placed_tier" (every round's hit came from the placed tier alone)}], "seconds"}; {"error":
    why} when a request or a placement failed."""
    started = time.monotonic()
    admin = AdminClient(endpoint.server_root, timeout_s=PREFILL_TIMEOUT_S,
                        **({"token": admin_token} if admin_token else {}))     # else $KVGATE_ADMIN_TOKEN's
    client = probe_client(endpoint)
    lengths = [n for n in prefill_lengths(longest_context) if n > BLOCK_TOKENS]
    requests = {n: context_request(n, f"{run_id}/{n}", endpoint.tokenizer, 1, "preflight-hits") for n in lengths}
    seen: dict[tuple[str, int], list] = {(mode, n): [] for n in lengths for mode in HIT_PLACEMENTS}
    served: dict[tuple[str, int], Counter] = {key: Counter() for key in seen}
    try:
        for n in lengths:
            record = client.send(requests[n])
            if not record.ok:
                return {"role": endpoint.role, "error": f"the hit probe's {n}-token miss failed: "
                                                        f"{no_first_token(record)}"}
        admin.flush()          # every prefix written behind to disk
        spent: dict[int, list[float]] = {n: [] for n in lengths}     # a length's round: both its hits, in order
        while due := _due(rounds, spent):
            for n in due:
                placed = time.monotonic()
                for mode, tiers in HIT_PLACEMENTS.items():
                    admin.evict(tiers)
                    if mode == "disk-cold":
                        admin.drop_page_cache()
                    before = per_tier(admin.metrics(), HITS_METRIC)
                    record = client.send(requests[n])
                    if not record.ok or record.ttft_s is None:
                        return {"role": endpoint.role, "error": f"the hit probe's {mode} at {n} tokens failed: "
                                                                f"{no_first_token(record)}"}
                    after = per_tier(admin.metrics(), HITS_METRIC)
                    seen[(mode, n)].append(record)
                    served[(mode, n)].update({tier: blocks - before.get(tier, 0.0) for tier, blocks in after.items()
                                              if blocks > before.get(tier, 0.0)})
                spent[n].append(time.monotonic() - placed)
    except AdminError as error:
        return {"role": endpoint.role, "error": f"the hit probe could not place a prefix: {error}"}
    finally:
        client.close()
    points = [{"mode": mode, "context_tokens": n, "prompt_tokens": records[-1].prompt_tokens or n,
               "cached_tokens": min((r.cached_tokens or 0) for r in records),
               "seconds": statistics.median(r.ttft_s for r in records), "rounds": [r.ttft_s for r in records],
              "tiers": dict(served[(mode, n)]), "from_placed_tier": set(served[(mode, n)]) == {PLACED_TIER[mode]}}
              for (mode, n), records in seen.items()]
    return {"role": endpoint.role, "points": points, "seconds": time.monotonic() - started}


def decode_probe(endpoint, context_tokens: int, max_running: int, run_id: str = "run",
                 block_tokens: int = BLOCK_TOKENS) -> dict:
    """The server's decode step as its streams show it: the median gap between tokens with one sequence decoding
    and with `max_running` (all sent at once, each prompt `context_tokens` long and new), timed only while every
    sequence of the batch is past its prompt and none has finished (steps that compute no prompt).
    {"role", "context_tokens", "batch_1_s", "batch_max_s", "max_batch", "step_s", "per_sequence_s", "gaps",
    "seconds"}: decode(b) = step_s + per_sequence_s·b through the two; {"error": why} when either failed."""
    started = time.monotonic()
    tokens = DECODE_WINDOW_TOKENS + max_running * -(-context_tokens // block_tokens)
    gaps: dict[int, list[float]] = {}
    for batch in sorted({1, max_running}):
        found = _batch_gaps(endpoint, context_tokens, batch, tokens, f"{run_id}/decode-{batch}")
        if isinstance(found, str):
            return {"role": endpoint.role, "error": found}
        gaps[batch] = found
    one, many = (statistics.median(gaps[b]) for b in (1, max_running))
    per_sequence = max(0.0, (many - one) / (max_running - 1)) if max_running > 1 else 0.0
    return {"role": endpoint.role, "context_tokens": context_tokens, "batch_1_s": one, "batch_max_s": many,
            "max_batch": max_running, "step_s": max(0.0, one - per_sequence), "per_sequence_s": per_sequence,
            "gaps": {str(b): len(g) for b, g in gaps.items()}, "seconds": time.monotonic() - started}


def _batch_gaps(endpoint, context_tokens: int, batch: int, max_tokens: int, run_id: str) -> list[float] | str:
    """The gaps between tokens (s) inside the window where all `batch` sequences decode; why not, as a str."""
    requests = [context_request(context_tokens, f"{run_id}/{i}", endpoint.tokenizer, max_tokens, "preflight-decode")
                for i in range(batch)]
    records: list = [None] * batch
    start = threading.Barrier(batch, timeout=PREFILL_TIMEOUT_S)    # sent together; a stuck peer breaks it

    def one(i: int) -> None:
        client = probe_client(endpoint, extra_body={"ignore_eos": True})   # every sequence to its max_tokens
        try:
            start.wait()
            records[i] = client.send(requests[i], keep_token_times=True)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PREFILL_TIMEOUT_S + 10)
    if None in records:
        return f"the decode probe's batch of {batch} failed: no answer within {PREFILL_TIMEOUT_S:.0f} s"
    failed = next((r for r in records if not r.ok or r.ttft_s is None), None)
    if failed is not None:
        return f"the decode probe's batch of {batch} failed: {no_first_token(failed)}"
    gaps = window_gaps([token_times(r) for r in records])
    if len(gaps) < DECODE_MIN_GAPS:
        return (f"the decode probe's batch of {batch} had {len(gaps)} gaps with every sequence decoding "
                f"(under {DECODE_MIN_GAPS}: the server stopped its sequences early)")
    return gaps


def no_first_token(record) -> str:
    """Why a probe's request gave no first-token time: its failure, or an answer that streamed no token."""
    if not record.ok:
        return describe_error(record.error_type, record.error_message)
    return f"the answer streamed no token (finish_reason {record.finish_reason}, {record.completion_tokens} tokens)"


def token_times(record) -> list[float]:
    """Each streamed token's arrival (wall-clock s): its chunk's, text or not, when the record kept them (a server
    that streams a token whose bytes do not decode yet as empty text sends its chunk at its step all the same),
    else from the send time, TTFT and gaps between text chunks."""
    if record.token_times_s:
        return [record.sent_at + t for t in record.token_times_s]
    return list(itertools.accumulate(record.itl_s, initial=record.sent_at + record.ttft_s))


def window_gaps(streams: list[list[float]]) -> list[float]:
    """The gaps of every stream that lie wholly after the last stream's first token and before the first
    stream's last: the steps where every stream was decoding."""
    opens, closes = max(s[0] for s in streams), min(s[-1] for s in streams)
    return [b - a for s in streams for a, b in zip(s, s[1:]) if a >= opens and b <= closes]
