"""`kvgate pool-bench`: the shared pool on each backend, measured on loopback.

(1) Remote-tier load bandwidth: a cold prefix of `prefix_mib` in the pool,
    loaded by the remote tier (parallel gets, header and checksum verified,
    copied into KV blocks) against a plain client get of the same values with
    the same parallelism and nothing else; rounds alternate, medians compared.
(2) Cross-node TTFT: node A computes a prompt and puts its KV in the pool;
    node B, whose own tiers are empty, answers the same prompt from the pool.
    B's TTFT against a recompute engine's, a new prompt each round.

Each backend's store is started here on 127.0.0.1 (or given with --redis /
--mooncake), and stopped afterwards.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from cache_impl.cache.config import CacheConfig, RemoteTierConfig
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.tiers.base import write_block
from cache_impl.cache.tiers.remote import RemoteTier, open_store
from cache_impl.engine.engine import Engine, EngineConfig, kv_layout
from cache_impl.engine.presets import PRESETS
from workloads.servers.stores import MooncakePool, RedisServer

from .engine_bench import _cache, _prompt


@dataclass
class PoolBenchSettings:
    directory: Path
    backends: tuple[str, ...] = ("redis", "mooncake")
    prefix_mib: int = 64
    rounds: int = 5
    context: int = 8192
    preset: str = "small"
    urls: Optional[dict] = None          # backend -> URL of a running pool (else one is started here)


def _layout(preset: str) -> KVLayout:
    """The preset's KV layout as the embedded engine keeps it (small: 1 MiB a 256-token block)."""
    return kv_layout(CacheConfig(), PRESETS[preset])


def bench_bandwidth(config: RemoteTierConfig, settings: PoolBenchSettings) -> dict:
    layout = _layout(settings.preset)
    fingerprint = Fingerprint(weights_digest=f"pool-bench-{time.time_ns()}", tokenizer_id="bench", layout=layout)
    tier = RemoteTier(config, fingerprint)
    if not tier.wait_connected(30):
        raise RuntimeError(f"pool-bench: could not connect to the {config.backend} pool: {tier.last_error}")
    store = open_store(config)
    n_blocks = max(1, settings.prefix_mib * 2**20 // layout.block_nbytes)
    keys = [i.to_bytes(16, "little") for i in range(n_blocks)]
    outs = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in keys]
    try:
        for key, out in zip(keys, outs):
            write_block(tier, key, out.normal_())
        names = [tier.name_for(k) for k in keys]
        plain_pool = ThreadPoolExecutor(config.read_workers)
        tier_s, plain_s = [], []
        for _ in range(settings.rounds):
            start = time.perf_counter()
            reasons = tier.read_into(keys, outs)
            tier_s.append(time.perf_counter() - start)
            if any(reasons):
                raise RuntimeError(f"pool-bench: the remote tier refused blocks: {set(reasons)}")
            start = time.perf_counter()
            got = list(plain_pool.map(store.get, names))
            plain_s.append(time.perf_counter() - start)
            if any(value is None for value in got):
                raise RuntimeError("pool-bench: a plain get missed a value")
        plain_pool.shutdown()
        nbytes = n_blocks * layout.block_nbytes
        return {"prefix_bytes": nbytes, "blocks": n_blocks, "read_workers": config.read_workers,
                "tier_gbps": nbytes / statistics.median(tier_s) / 1e9,
                "plain_get_gbps": nbytes / statistics.median(plain_s) / 1e9,
                "tier_vs_plain": statistics.median(p / t for t, p in zip(tier_s, plain_s)),
                "tier_rounds_s": tier_s, "plain_rounds_s": plain_s}
    finally:
        for key in keys:
            tier.delete(key)
        tier.close()
        store.close()


def bench_cross_node(config: RemoteTierConfig, settings: PoolBenchSettings, work: Path) -> dict:
    remote = config.model_dump()
    base: dict[str, Any] = {"mode": "tiered", "preset": settings.preset,
                            "cache": {"device_capacity_blocks": settings.context // 256 + 8, "remote": remote}}
    engines = {}
    try:
        engines["recompute"] = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": settings.preset})).start()
        for node in ("a", "b"):
            cache = {**base["cache"], "disk": {"path": str(work / f"node-{node}")}}
            engines[node] = Engine(EngineConfig.from_dict({**base, "cache": cache})).start()
        times: dict[str, list[float]] = {"recompute": [], "node_a": [], "node_b": []}
        cached = settings.context // 256 * 256  # every full block of the prompt
        for round_ in range(settings.rounds):
            prompt = _prompt(settings.context, seed=10_000 + round_ + time.time_ns() % 10_000)
            times["recompute"].append(engines["recompute"].generate(prompt, max_tokens=1).finished()[0])
            computed, _ = engines["a"].generate(prompt, max_tokens=1).finished()
            _cache(engines["a"]).flush()
            times["node_a"].append(computed)
            hit, finish = engines["b"].generate(prompt, max_tokens=1).finished()
            if finish.cached_tokens != cached:
                raise RuntimeError(f"pool-bench: node B reused {finish.cached_tokens} tokens, expected {cached}")
            times["node_b"].append(hit)
        return {"context_tokens": settings.context, "cached_tokens": cached,
                **{f"{name}_ttft_ms": statistics.median(v) * 1e3 for name, v in times.items()},
                "node_b_speedup": statistics.median(r / b for r, b in zip(times["recompute"], times["node_b"])),
                "rounds_ms": {name: [v * 1e3 for v in values] for name, values in times.items()}}
    finally:
        for engine in engines.values():
            engine.stop()


def _started(backend: str, work: Path):
    return RedisServer(work / "redis") if backend == "redis" else MooncakePool(work / "mooncake", segment="1GB")


def run_pool_bench(settings: PoolBenchSettings) -> dict:
    settings.directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-pool-bench-", dir=settings.directory))
    results = {}
    try:
        for backend in settings.backends:
            url = (settings.urls or {}).get(backend)
            pool = None
            if not url:
                pool = _started(backend, work).start()
                url = pool.url
            try:
                config = RemoteTierConfig.from_url(url)
                results[backend] = {"bandwidth": bench_bandwidth(config, settings),
                                    "cross_node": bench_cross_node(config, settings, work / backend)}
            finally:
                if pool is not None:
                    pool.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"preset": settings.preset, "backends": results}


def format_pool_report(figures: dict) -> str:
    lines = [f"kvgate pool-bench  (loopback, preset {figures['preset']}, medians)", "",
             f"{'backend':<9} {'tier GB/s':>9} {'plain get':>9} {'ratio':>6}   "
             f"{'recompute':>9} {'node A':>8} {'node B':>8} {'B x':>6}   (TTFT ms)"]
    for backend, result in figures["backends"].items():
        bw, cross = result["bandwidth"], result["cross_node"]
        lines.append(f"{backend:<9} {bw['tier_gbps']:>9.2f} {bw['plain_get_gbps']:>9.2f} {bw['tier_vs_plain']:>6.2f}   "
                     f"{cross['recompute_ttft_ms']:>9.1f} {cross['node_a_ttft_ms']:>8.1f} "
                     f"{cross['node_b_ttft_ms']:>8.1f} {cross['node_b_speedup']:>5.1f}x")
    first = next(iter(figures["backends"].values()), None)
    if first:
        lines += ["", f"bandwidth: a cold {first['bandwidth']['prefix_bytes'] / 2**20:.0f} MiB prefix, "
                      f"{first['bandwidth']['read_workers']} parallel gets; cross-node: "
                      f"{first['cross_node']['context_tokens']}-token prompt, node B hits "
                      f"{first['cross_node']['cached_tokens']} tokens from the pool"]
    return "\n".join(lines)
