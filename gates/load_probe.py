"""The load probe, just before G3, beside the decode probe: each target server's gaps between tokens and first tokens
while requests come and go as in G3's closed loop, for the sizing model's costs per target (sizing/machine.py's
`load_costs`).

The decode probe times steps that only decode; G3's also admit prompts, load and store their blocks and answer over
HTTP, on the same cores. So the probe sends each target what G3 sends it, in its own prompts of G3's median context,
at two levels, c users in a closed loop for `seconds`, each asking for G3's output tokens: to the candidate
`prompts` distinct prompts, each computed once, then taken in a cycle (every one a return, from the lowest tier when
the cycle outgrows the others), to the baseline a new prompt each time (computed whole, as G3's baseline computes
most of its prompts). Each record keeps its prompt, cached and output tokens, its first token's time and its gaps
between tokens (each token's own chunk: a server may stream a token as empty text).

How it works: docs/methods/sizing-model.md (gates/load_probe.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

from gates.machine_probe import PREFILL_TIMEOUT_S, no_first_token, probe_client, token_times
from workloads.traffic.datasets import context_request

LOAD_SECONDS = 3.0            # each level's closed loop
LOAD_MOST_REQUESTS = 400      # a level's bound on requests, whatever the server's speed


def load_levels(g3_levels: Sequence[float]) -> list[int]:
    """The probe's two levels: G3's lowest and highest concurrency (1 and the level when G3 has one)."""
    top = max(int(level) for level in g3_levels)
    low = min(int(level) for level in g3_levels)
    return sorted({1 if low == top else low, top})


def load_probe(endpoint, context_tokens: int, output_tokens: int, levels: Sequence[int], prompts: int,
               run_id: str = "run", seconds: float = LOAD_SECONDS, returns: bool = True) -> dict:
    """{"role", "context_tokens", "output_tokens", "prompts", "returns", "levels": {"c": [record, ...]}, "seconds"},
    each record {"prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "itl_s"}; {"role", "error": why}
    when a request failed. `returns`: the cycle of `prompts` prompts, each computed first (the candidate's); else a
    new prompt each request (the baseline's; `prompts` then says how many were sent)."""
    started = time.monotonic()

    def prompt(k: int):
        return context_request(context_tokens, f"{run_id}/load-{endpoint.role}-{k}", endpoint.tokenizer,
                               output_tokens, "preflight-load")

    pool = [prompt(i) for i in range(prompts)] if returns else []
    client = probe_client(endpoint, extra_body={"ignore_eos": True})   # every answer G3's length
    try:
        for request in pool:                                          # each prompt computed once: later sends return
            record = client.send(request)
            if not record.ok:
                return {"role": endpoint.role, "error": f"the load probe's prompt failed: {no_first_token(record)}"}
    finally:
        client.close()
    found: dict[str, list[dict]] = {}
    sent = itertools.count()
    for level in levels:
        records = _closed_loop(endpoint, (lambda k: pool[k % len(pool)]) if returns else (lambda k: prompt(next(sent))),
                               level, seconds)
        failed = next((r for r in records if not r.ok or r.ttft_s is None), None)
        if failed is not None:
            return {"role": endpoint.role, "error": f"the load probe at {level} users failed: {no_first_token(failed)}"}
        found[str(level)] = [{"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                              "completion_tokens": r.completion_tokens, "ttft_s": r.ttft_s, "itl_s": _gaps(r)}
                             for r in records]
    return {"role": endpoint.role, "context_tokens": context_tokens, "output_tokens": output_tokens,
            "prompts": prompts if returns else next(sent), "returns": returns, "levels": found,
            "seconds": time.monotonic() - started}


def _gaps(record) -> list[float]:
    """The gaps between a record's tokens: between its first `completion_tokens` chunks (a closing chunk that
    carries no token, sent just after the last one, is no step)."""
    times = token_times(record)[:record.completion_tokens or None]
    return [b - a for a, b in itertools.pairwise(times)]


def _closed_loop(endpoint, prompt: Callable[[int], Any], users: int, seconds: float) -> list:
    """`users` threads, each sending the next prompt (`prompt(k)`, the k-th sent at this level) as soon as its last
    answer is in, until `seconds` have passed (or LOAD_MOST_REQUESTS were sent); every record, in the order they were
    sent."""
    cycle, lock = itertools.count(), threading.Lock()
    records: list = []
    stop_at = time.monotonic() + seconds

    def user() -> None:
        client = probe_client(endpoint, extra_body={"ignore_eos": True})
        try:
            while time.monotonic() < stop_at:
                with lock:
                    k = next(cycle)
                    request = prompt(k) if k < LOAD_MOST_REQUESTS else None
                if request is None:
                    return
                record = client.send(request, keep_token_times=True)
                with lock:
                    records.append(record)
        finally:
            client.close()

    threads = [threading.Thread(target=user, daemon=True) for _ in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + PREFILL_TIMEOUT_S + 10)
    return records
