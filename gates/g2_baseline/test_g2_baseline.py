"""G2 single-node baseline: one request at a time, recompute vs a warm host hit vs a cold disk hit.

For each context length: TTFT of the recompute endpoint, and of the candidate
with the prefix placed in the host tier or only on disk with its pages dropped
(through the embedded server's /admin/cache routes). The disk tier's cold-read
bandwidth is judged against fio on the same storage in alternating rounds
(gates/g2_baseline/cold_read.py); G1's fio figure is shown beside it, never divides it.
"""

from __future__ import annotations

import statistics

import pytest

from gates.g2_baseline.cold_read import (WARMUP_PAIRS, ColdReadError, FioRegions, TierColdLoad, measure_pairs,
                                         paired_ratio)
from gates.stats import ratio_ci
from workloads.client import StreamingClient
from workloads.datasets import sizer_for
from workloads.faults import AdminClient
from workloads.requests import WorkloadRequest

MODES = ("recompute", "host-hit", "disk-cold")


def _request(tokens: int, tag: str, endpoint) -> WorkloadRequest:
    sizer = sizer_for("kvgate-byte-v1" if endpoint.admin else None)
    text = sizer.text(tokens - 8, f"g2/{tag}")  # room for the chat template's few tokens
    return WorkloadRequest(tag, tag, 0, ({"role": "user", "content": text},), 1, tokens)


def _ttft(client: StreamingClient, request: WorkloadRequest) -> tuple[float, tuple[int, int]]:
    """TTFT, and (cached tokens, prompt tokens) as the server reported them."""
    record = client.send(request)
    if not record.ok:
        pytest.fail(f"G2 request failed: {record.error_type}: {record.error_message}", pytrace=False)
    return record.ttft_s, (record.cached_tokens or 0, record.prompt_tokens or 0)


def _embedded_candidate(endpoints):
    """The candidate and the recompute endpoint; G2 skips unless the candidate has the admin routes."""
    candidate, recompute = endpoints.get("candidate"), endpoints.get("recompute")
    if candidate is None or recompute is None:
        pytest.skip("G2 needs a recompute and a candidate endpoint")
    if not candidate.admin:
        pytest.skip("G2 needs to place prefixes in a tier (/admin/cache); the external candidate has no such route")
    return candidate, recompute


@pytest.fixture(scope="module")
def baseline_runs(gate_context, endpoints):
    """Every TTFT of every context and mode, measured once; per-round figures go to the run store."""
    candidate, recompute = _embedded_candidate(endpoints)
    run_id = gate_context.store.run_info().get("run_id", "run")
    admin = AdminClient(candidate.server_root)
    clients = {role: StreamingClient(e.url, e.model, e.api, target=role) for role, e in
               (("recompute", recompute), ("candidate", candidate))}
    results = {"ttft": {}, "cached": {}}
    config = gate_context.config.g2
    contexts = sorted(config.contexts)
    try:
        for number, tokens in enumerate(contexts, 1):
            for round_ in range(config.rounds):
                gate_context.store.set_progress("g2", f"TTFT by context: {tokens} tokens ({number} / {len(contexts)}), "
                                                      f"round {round_ + 1} / {config.rounds}: recompute, host hit, "
                                                      "cold disk hit")
                request = _request(tokens, f"{run_id}/{tokens}/{round_}", candidate)
                results["ttft"].setdefault(("recompute", tokens), []).append(_ttft(clients["recompute"], request)[0])
                _ttft(clients["candidate"], request)                     # a miss: computes and stores the prefix
                admin.flush()
                admin.evict(("device",))
                ttft, cached = _ttft(clients["candidate"], request)
                results["ttft"].setdefault(("host-hit", tokens), []).append(ttft)
                results["cached"].setdefault(("host-hit", tokens), []).append(cached)
                admin.evict(("device", "host"))
                admin.drop_page_cache()
                ttft, cached = _ttft(clients["candidate"], request)
                results["ttft"].setdefault(("disk-cold", tokens), []).append(ttft)
                results["cached"].setdefault(("disk-cold", tokens), []).append(cached)
    finally:
        for client in clients.values():
            client.close()
    return results


@pytest.fixture(scope="module")
def cold_read_pairs(gate_context, endpoints):
    """Alternating rounds at the longest context: the tier's cold load of a fresh prefix, then fio
    reading as many bytes of a fresh region on the same storage, in the tier's I/O mode and parallelism."""
    candidate, _ = _embedded_candidate(endpoints)
    config, embedded = gate_context.config, gate_context.config.targets.embedded
    run_id = gate_context.store.run_info().get("run_id", "run")
    longest = max(config.g2.contexts)
    client = StreamingClient(candidate.url, candidate.model, candidate.api, target="candidate")
    tier = TierColdLoad(AdminClient(candidate.server_root), client,
                        lambda i: _request(longest, f"{run_id}/cold-read/{i}", candidate),
                        prefixes=config.g2.cold_read_prefixes)
    fio = FioRegions(config.storage.path.resolve() / "fio", rounds=WARMUP_PAIRS + config.g2.cold_read_pairs,
                     direct=embedded.disk_io_mode == "direct", parallel=embedded.disk_read_workers,
                     ioengine=config.fio.ioengine)
    try:
        with fio:
            pairs = measure_pairs(tier, fio, config.g2.cold_read_pairs, warmup=WARMUP_PAIRS)
    except ColdReadError as error:
        pytest.fail(f"G2 cold read: {error}", pytrace=False)
    finally:
        client.close()
    return pairs, " ".join(fio.read_job(0).argv()[3:11])


def test_ttft_by_context_length_for_recompute_host_and_cold_disk_hits(gate_context, baseline_runs, record, verdict):
    for (mode, tokens), values in sorted(baseline_runs["ttft"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for i, value in enumerate(values):
            record("ttft_round_ms", value * 1e3, "ms", mode=mode, context_tokens=tokens, round=i)
        record("ttft_ms", statistics.median(values) * 1e3, "ms", mode=mode, context_tokens=tokens)
    # the embedded engine reuses every whole 256-token block of the prompt
    hits = [(cached, prompt // 256 * 256) for pairs in baseline_runs["cached"].values() for cached, prompt in pairs]
    fraction = min((c / e for c, e in hits if e), default=0.0)
    record("cached_fraction_min", fraction)
    verdict("G2 cache hits really served from the placed tier (least cached share of a hit)", "cached_fraction_min",
            fraction, unit="%")


def test_disk_hit_ttft_is_a_fraction_of_recompute_at_the_longest_context(gate_context, baseline_runs, record,
                                                                           verdict):
    longest = max(gate_context.config.g2.contexts)
    disk_rounds = baseline_runs["ttft"][("disk-cold", longest)]
    recompute_rounds = baseline_runs["ttft"][("recompute", longest)]
    disk, recompute = statistics.median(disk_rounds), statistics.median(recompute_rounds)
    ratio, interval = ratio_ci(disk_rounds, recompute_rounds)
    record("disk_hit_ttft_vs_recompute", ratio, context_tokens=longest, disk_ms=disk * 1e3, recompute_ms=recompute * 1e3,
           interval=list(interval))
    verdict(f"G2 cold disk hit TTFT / recompute TTFT at {longest} tokens ({disk * 1e3:.0f} / {recompute * 1e3:.0f} ms)",
            "disk_hit_ttft_vs_recompute", ratio, unit="%", interval=interval, context={"context_tokens": longest})


def test_cold_disk_read_bandwidth_reaches_fio(gate_context, cold_read_pairs, record, verdict):
    """The tier's cold-read GB/s over fio's on the same storage, in alternating rounds: the ratio of
    their medians with a paired bootstrap interval. G1's fio figure (another minute) is shown beside."""
    pairs, fio_job = cold_read_pairs
    for pair in pairs:
        record("cold_read_pair", pair.ratio, **pair.context("tier"))
    judged = paired_ratio(pairs)
    g1 = gate_context.store.latest("g1", "seq_read_gbps")
    beside = f"; G1's fio {g1['value']:.2f} GB/s, not used" if g1 is not None else ""
    record("cold_read_vs_fio", judged.value, pairs=judged.pairs, tier_gbps=judged.subject_gbps,
           fio_gbps=judged.fio_gbps, interval=list(judged.interval or ()), fio_job=fio_job,
           g1_seq_read_gbps=None if g1 is None else g1["value"])
    verdict(f"G2 cold-read KV bandwidth / fio's, side by side ({judged.describe()}{beside})", "cold_read_vs_fio",
            judged.value, **judged.verdict_options())
