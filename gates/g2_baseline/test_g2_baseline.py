"""G2 single-node baseline: one request at a time, recompute vs a warm host hit vs a cold disk hit.

For each context length: TTFT of the recompute endpoint, and of the candidate
with the prefix placed in the host tier or only on disk with its pages dropped
(through the embedded server's /admin/cache routes). The cold disk hits'
effective KV read bandwidth comes from the server's own metrics (disk bytes
read over disk load time) and is compared with G1's fio sequential read.
"""

from __future__ import annotations

import json
import os
import statistics
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_impl.auth import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER
from cache_impl.integrity import file_nbytes
from gates.stats import ratio_ci
from cache_impl.model import PRESETS
from workloads.client import StreamingClient
from workloads.datasets import sizer_for
from workloads.fio import FioMatrix, FioPattern, run_matrix
from workloads.requests import WorkloadRequest

MODES = ("recompute", "host-hit", "disk-cold")


def _post(endpoint, path: str, body: dict | None = None) -> dict:
    # The admin token `kvgate run` made for its servers (until G2 uses workloads.faults.AdminClient).
    headers = {"Content-Type": "application/json", ADMIN_TOKEN_HEADER: os.environ.get(ADMIN_TOKEN_ENV, "")}
    request = urllib.request.Request(endpoint.server_root + path, data=json.dumps(body or {}).encode(),
                                     headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _disk_counters(endpoint) -> tuple[float, float]:
    """(disk bytes read, disk load seconds) from the server's Prometheus metrics."""
    with urllib.request.urlopen(endpoint.server_root + "/metrics", timeout=30) as response:
        text = response.read().decode()
    read = seconds = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("tier") != "disk":
                continue
            if sample.name == "kvgate_cache_bytes_read_total":
                read = sample.value
            elif sample.name == "kvgate_cache_load_latency_seconds_sum":
                seconds = sample.value
    return read, seconds


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


@pytest.fixture(scope="module")
def baseline_runs(gate_context, endpoints):
    """Every TTFT of every context and mode, measured once; per-round figures go to the run store."""
    candidate = endpoints.get("candidate")
    recompute = endpoints.get("recompute")
    if candidate is None or recompute is None:
        pytest.skip("G2 needs a recompute and a candidate endpoint")
    if not candidate.admin:
        pytest.skip("G2 needs to place prefixes in a tier (/admin/cache); the external candidate has no such route")
    run_id = gate_context.store.run_info().get("run_id", "run")
    clients = {role: StreamingClient(e.url, e.model, e.api, target=role) for role, e in
               (("recompute", recompute), ("candidate", candidate))}
    results = {"ttft": {}, "cached": {}, "disk_bytes": 0.0, "disk_seconds": 0.0}
    config = gate_context.config.g2
    try:
        for tokens in sorted(config.contexts):
            for round_ in range(config.rounds):
                request = _request(tokens, f"{run_id}/{tokens}/{round_}", candidate)
                results["ttft"].setdefault(("recompute", tokens), []).append(_ttft(clients["recompute"], request)[0])
                _ttft(clients["candidate"], request)                     # a miss: computes and stores the prefix
                _post(candidate, "/admin/cache/flush")
                _post(candidate, "/admin/cache/evict", {"tiers": ["device"]})
                ttft, cached = _ttft(clients["candidate"], request)
                results["ttft"].setdefault(("host-hit", tokens), []).append(ttft)
                results["cached"].setdefault(("host-hit", tokens), []).append(cached)
                _post(candidate, "/admin/cache/evict", {"tiers": ["device", "host"]})
                _post(candidate, "/admin/cache/drop-page-cache")
                before = _disk_counters(candidate)
                ttft, cached = _ttft(clients["candidate"], request)
                after = _disk_counters(candidate)
                results["ttft"].setdefault(("disk-cold", tokens), []).append(ttft)
                results["cached"].setdefault(("disk-cold", tokens), []).append(cached)
                if tokens == max(config.contexts):
                    results["disk_bytes"] += after[0] - before[0]
                    results["disk_seconds"] += after[1] - before[1]
    finally:
        for client in clients.values():
            client.close()
    return results


@pytest.fixture(scope="module")
def fio_seq_read_gbps(gate_context):
    """G1's fio sequential read on this storage; measured here the same way when G1 did not run."""
    found = gate_context.store.latest("g1", "seq_read_gbps")
    if found is not None:
        return found["value"], "G1"
    settings = gate_context.config.fio
    matrix = FioMatrix(patterns=(FioPattern("seq-read", "read", "1M"),), size=settings.size,
                       runtime_s=settings.runtime_s, iodepth=settings.iodepth, numjobs=settings.numjobs,
                       direct=settings.direct, ioengine=settings.ioengine)
    result = run_matrix(matrix, gate_context.config.storage.path.resolve() / "fio")[0]
    return result.read_bw_bytes / 1e9, "G2 (G1 not in this run)"


@pytest.fixture(scope="module")
def fio_like_the_tier_gbps(gate_context):
    """fio reading the way the disk tier does: one block file's size per request, buffered, pages dropped."""
    args = PRESETS[gate_context.config.targets.embedded.preset]
    block_file = file_nbytes(args.n_layers * 2 * args.n_kv_heads * args.head_dim * 4 * 256)  # float32 KV
    matrix = FioMatrix(patterns=(FioPattern("tier-like-read", "read", str(block_file)),), size="128M",
                       runtime_s=gate_context.config.fio.runtime_s, iodepth=1, numjobs=4, direct=False,
                       ioengine="psync")
    result = run_matrix(matrix, gate_context.config.storage.path.resolve() / "fio")[0]
    return result.read_bw_bytes / 1e9, " ".join(result.job.argv()[3:12])


def test_ttft_by_context_length_for_recompute_host_and_cold_disk_hits(gate_context, baseline_runs, record, verdict):
    for (mode, tokens), values in sorted(baseline_runs["ttft"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for i, value in enumerate(values):
            record("ttft_round_ms", value * 1e3, "ms", mode=mode, context_tokens=tokens, round=i)
        record("ttft_ms", statistics.median(values) * 1e3, "ms", mode=mode, context_tokens=tokens)
    # the embedded engine reuses whole 256-token blocks and computes at least the last prompt token
    hits = [(cached, (prompt - 1) // 256 * 256) for pairs in baseline_runs["cached"].values() for cached, prompt in pairs]
    fraction = min((c / e for c, e in hits if e), default=0.0)
    record("cached_fraction_min", fraction)
    verdict("G2 cache hits really served from the placed tier (least cached share of a hit)", "cached_fraction_min",
            fraction, rule={"metric": "cached_fraction_min", "op": ">=", "value": 0.99}, unit="%")


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
            "disk_hit_ttft_vs_recompute", ratio, unit="%", interval=interval)


def test_cold_disk_read_bandwidth_reaches_fio(gate_context, baseline_runs, fio_seq_read_gbps, fio_like_the_tier_gbps,
                                             record, verdict):
    """Judged against G1's sequential read; fio reading like the tier (its request size, buffered, cold)
    is reported beside it, so a gap between the two figures shows what the access pattern costs."""
    if baseline_runs["disk_seconds"] <= 0:
        pytest.fail("no disk load time was reported by the server for the cold hits", pytrace=False)
    bandwidth = baseline_runs["disk_bytes"] / baseline_runs["disk_seconds"] / 1e9
    fio, source = fio_seq_read_gbps
    like, like_job = fio_like_the_tier_gbps
    ratio = bandwidth / fio
    record("cold_read_gbps", bandwidth, "GB/s", bytes=baseline_runs["disk_bytes"], seconds=baseline_runs["disk_seconds"])
    record("fio_like_the_tier_gbps", like, "GB/s", fio=like_job)
    record("cold_read_vs_fio_like_the_tier", bandwidth / like)
    record("cold_read_vs_fio", ratio, fio_gbps=fio, fio_from=source)
    verdict(f"G2 cold-read KV bandwidth: {bandwidth:.2f} GB/s of fio {fio:.2f} GB/s ({source})", "cold_read_vs_fio",
            ratio, unit="%")
