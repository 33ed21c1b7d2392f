"""Prometheus view of the engine and its cache, read from their snapshots at scrape time."""

from __future__ import annotations

import asyncio
from typing import Callable, Iterator

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cache_impl.engine.engine import Engine

_TIER_COUNTERS = {
    "hits": "blocks served by the tier",
    "misses": "blocks looked for and not found in the tier",
    "bytes_read": "bytes loaded from the tier",
    "bytes_written": "bytes stored in the tier",
    "evictions": "blocks evicted from the tier",
    "evictions_for_space": "blocks evicted because the filesystem beneath the tier was full",
    "demotions": "evicted blocks moved to a lower tier",
    "read_errors": "block reads that failed with an I/O error",
    "write_errors": "block stores that failed (nothing was published)",
    "stores_refused": "blocks the tier did not store for want of room it could make (nothing left to evict; on "
                      "disk: the filesystem's free room below min_free_bytes)",
}


class EngineCollector:
    """A custom collector: one consistent snapshot per scrape, no global metric objects."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot()
        counters = snap["counters"]
        yield _gauge("kvgate_requests_waiting", "requests queued, not yet admitted", snap["waiting"])
        yield _gauge("kvgate_requests_running", "requests admitted (prefilling or decoding)", snap["running"])
        yield _gauge("kvgate_engine_kv_buffer_bytes", "bytes of the request KV buffers the engine holds: the "
                     "running requests', the one being started and the finished ones kept for reuse",
                     snap["kv_buffer_bytes"])
        yield _gauge(
            "kvgate_engine_kv_buffer_resident_bytes",
            "of those buffers, the bytes of their pages in the "
            "server's memory now (a buffer's pages are resident once touched)",
            snap["kv_buffer_resident_bytes"],
        )
        yield _gauge("kvgate_engine_kv_buffer_limit_bytes", "the most the request KV buffers may hold by design: "
                     "max_running running and as many kept, each at the model's context", snap["kv_buffer_limit_bytes"])
        yield _counter("kvgate_prompt_tokens_computed", "prompt tokens run through the model",
                       counters.get("prompt_tokens_computed", 0))
        yield _counter("kvgate_prompt_tokens_reused", "prompt tokens whose KV came from the cache",
                       counters.get("prompt_tokens_reused", 0))
        yield _counter("kvgate_generation_tokens", "tokens generated", counters.get("generation_tokens", 0))
        finished = CounterMetricFamily("kvgate_requests_finished", "requests finished, by reason", labels=["reason"])
        for key, value in sorted(counters.items()):
            if key.startswith("requests_"):
                finished.add_metric([key.removeprefix("requests_")], value)
        yield finished
        if snap["cache"] is not None:
            yield from _cache_metrics(snap["cache"])


class CacheCollector:
    """A cache's own counters without an engine (kvgate's connector inside vLLM), plus the owner's counters
    (`counters()`: {name: (help, {label tuple: value}, label names)}), one snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], dict], counters: Callable[[], dict]) -> None:
        self.snapshot, self.counters = snapshot, counters

    def collect(self) -> Iterator[Metric]:
        yield from _cache_metrics(self.snapshot())
        for name, (help_text, values, labels) in sorted(self.counters().items()):
            family = CounterMetricFamily(name, help_text, labels=list(labels))
            for label_values, value in sorted(values.items()):
                family.add_metric(list(label_values), value)
            yield family


class RuntimeCollector:
    """What a leak of the server's runtime would show (G4 trends them over a soak; `process_open_fds` is
    prometheus_client's ProcessCollector's): the process's OS threads (Python's and the native libraries'),
    and the tasks of the event loop serving the scrape."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def collect(self) -> Iterator[Metric]:
        yield _gauge("kvgate_process_threads", "OS threads of the server's process", self._process.num_threads())
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # scraped off the event loop (a test's registry): no loop to count
            return
        yield _gauge("kvgate_asyncio_tasks", "tasks of the server's event loop, this scrape's included",
                     len(asyncio.all_tasks(loop)))


def _cache_metrics(cache: dict) -> Iterator[Metric]:
    tiers = cache["tiers"]
    for name, help_text in _TIER_COUNTERS.items():
        family = CounterMetricFamily(f"kvgate_cache_{name}", help_text, labels=["tier"])
        for tier, figures in tiers.items():
            family.add_metric([tier], figures[name])
        yield family
    corrupt = CounterMetricFamily("kvgate_cache_corrupt_blocks", "stored blocks refused by verification",
                                  labels=["tier", "reason"])
    for tier, figures in tiers.items():
        for reason, count in sorted(figures["corrupt_by_reason"].items()):
            corrupt.add_metric([tier, reason], count)
    yield corrupt
    for name, help_text in (("used_bytes", "bytes held by the tier"),
                            ("capacity_bytes", "the tier's capacity (disk: what its filesystem leaves it, at most "
                                               "the configured capacity)"),
                            ("blocks", "blocks held by the tier")):
        gauge = GaugeMetricFamily(f"kvgate_cache_{name}", help_text, labels=["tier"])
        for tier, figures in tiers.items():
            gauge.add_metric([tier], figures[name])
        yield gauge
    resident = GaugeMetricFamily("kvgate_cache_resident_bytes", "bytes of the server's memory the tier's pool "
                                 "holds (pages touched so far, kept through evictions; 0 on disk or a GPU)",
                                 labels=["tier"])
    for tier, figures in tiers.items():
        resident.add_metric([tier], figures["state"].get("resident_bytes", 0))
    yield resident
    latency = HistogramMetricFamily("kvgate_cache_load_latency_seconds", "time to load a batch of blocks",
                                    labels=["tier"])
    for tier, figures in tiers.items():
        hist = figures["load_latency_seconds"]
        latency.add_metric([tier], list(hist["buckets"].items()), hist["sum"])
    yield latency
    pending = GaugeMetricFamily("kvgate_cache_pending_writes", "block writes queued for the tier", labels=["tier"])
    for tier, figures in tiers.items():
        pending.add_metric([tier], figures["pending_writes"])
    yield pending
    yield _gauge("kvgate_cache_pending_disk_writes", "disk writes queued",
                 tiers["disk"]["pending_writes"] if "disk" in tiers else 0)
    if "disk" in tiers:
        yield _gauge("kvgate_cache_temp_files", "temp files in the disk tier's directory (writes in flight)",
                     tiers["disk"]["state"]["temp_files"])
    yield _counter("kvgate_cache_reindex_removed", "stored blocks refused and removed when re-indexing at start",
                   cache["reindex_removed"])
    if "remote" in tiers:
        remote = tiers["remote"]["state"]
        yield _gauge("kvgate_cache_remote_available", "1 while the shared pool answers, 0 while it is unavailable",
                     int(remote["available"]))
        yield _counter("kvgate_cache_remote_unavailable_calls", "calls to the shared pool that got no answer",
                       remote["unavailable_calls"])
    if "disk" in tiers:  # faults are injected into the disk tier
        injected = CounterMetricFamily("kvgate_faults_injected", "times an armed I/O fault acted (admin)",
                                       labels=["kind"])
        for kind, count in sorted(cache["faults"]["fired"].items()):
            injected.add_metric([kind], count)
        yield injected


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)
