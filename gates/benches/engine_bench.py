"""`kvgate engine-bench`: single-request TTFT of the embedded engine, recompute vs cache hits.

For each context length: TTFT with nothing cached (a `recompute`-mode engine),
with the prefix in the host tier, and with it only on disk with its pages
dropped (a cold read). Each round runs the three back to back; figures are
medians over rounds, speed-ups the median of per-round ratios. Each request
generates OUTPUT_TOKENS greedily, and a hit's tokens must be exactly those of
the recompute of the same prompt (else the bench stops with an error): a hit
that were fast but wrong would not count.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cache_impl.cache.manager import TieredKVCache
from cache_impl.engine.engine import Engine, EngineConfig
from cache_impl.engine.tokenizer import ByteTokenizer

TARGETS_AT_LONGEST = {"host_speedup": 20.0, "disk_speedup": 15.0}
OUTPUT_TOKENS = 4


@dataclass
class EngineBenchSettings:
    directory: Path
    contexts: tuple[int, ...] = (1024, 4096, 8192)
    rounds: int = 3
    preset: str = "small"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return ByteTokenizer().encode("".join(chr(rng.randrange(32, 127)) for _ in range(length - 1)))


def _ttft(engine: Engine, prompt: list[int], expect_cached: int, expect_tokens: list[int] | None = None,
          what: str = "") -> tuple[float, list[int]]:
    """TTFT of one greedy request and its tokens; RuntimeError unless it reused `expect_cached` tokens and,
    when given, generated exactly `expect_tokens`."""
    result = engine.generate(prompt, max_tokens=OUTPUT_TOKENS)
    ttft_s, finish = result.finished()
    if finish.cached_tokens != expect_cached:
        raise RuntimeError(f"engine-bench: expected {expect_cached} cached tokens, got {finish.cached_tokens}")
    if expect_tokens is not None and result.token_ids != expect_tokens:
        raise RuntimeError(f"engine-bench: a {what} generated {result.token_ids}, the recompute {expect_tokens}")
    return ttft_s, result.token_ids


def _cache(engine: Engine) -> TieredKVCache:
    """A tiered engine's KV cache; RuntimeError for an engine without one (a recompute engine)."""
    if engine.cache is None:
        raise RuntimeError(f"expected an engine with a KV cache, found {engine.model_name} without one")
    return engine.cache


def _measure_context(recompute: Engine, tiered: Engine, length: int, rounds: int) -> dict:
    prompt = _prompt(length, seed=length)
    cached = length // tiered.block_size * tiered.block_size  # every full block, the last one too
    cache = _cache(tiered)
    tiered.generate(prompt, max_tokens=1)  # computes and stores the prefix
    cache.flush()
    times: dict[str, list[float]] = {"recompute": [], "host": [], "disk_cold": []}
    compared = 0
    for _ in range(rounds):
        ttft, reference = _ttft(recompute, prompt, 0)
        times["recompute"].append(ttft)
        cache.evict("device")
        times["host"].append(_ttft(tiered, prompt, cached, reference, "host hit")[0])
        cache.evict("device")
        cache.evict("host")
        cache.drop_page_cache()
        times["disk_cold"].append(_ttft(tiered, prompt, cached, reference, "cold disk hit")[0])
        cache.flush()
        compared += 2
    ratio = lambda name: statistics.median(r / t for r, t in zip(times["recompute"], times[name]))  # noqa: E731
    return {
        "context_tokens": length, "cached_tokens": cached,
        **{f"{name}_ttft_ms": statistics.median(values) * 1e3 for name, values in times.items()},
        "host_speedup": ratio("host"), "disk_speedup": ratio("disk_cold"),
        "hits_identical_to_recompute": compared, "output_tokens": OUTPUT_TOKENS,
        "rounds_ms": {name: [v * 1e3 for v in values] for name, values in times.items()},
    }


def run_engine_bench(settings: EngineBenchSettings) -> dict:
    settings.directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-engine-bench-", dir=settings.directory))
    recompute = tiered = None
    try:
        recompute = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": settings.preset})).start()
        tiered = Engine(EngineConfig.from_dict({
            "mode": "tiered", "preset": settings.preset,
            "cache": {"device_capacity_blocks": max(settings.contexts) // 256 + 8, "disk": {"path": str(work)}},
        })).start()
        contexts = [_measure_context(recompute, tiered, n, settings.rounds) for n in settings.contexts]
        model = tiered.model_name
    finally:
        for engine in (recompute, tiered):
            if engine is not None:
                engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    longest = contexts[-1]
    return {
        "model": model, "contexts": contexts,
        "host_speedup_at_longest": longest["host_speedup"], "disk_speedup_at_longest": longest["disk_speedup"],
        "targets_at_longest": TARGETS_AT_LONGEST,
    }


def format_engine_report(figures: dict) -> str:
    lines = [
        f"kvgate engine-bench  ({figures['model']}, one request at a time, TTFT in ms, medians)",
        "",
        f"{'context':>8} {'cached':>7} {'recompute':>10} {'host hit':>9} {'cold disk':>10} {'host x':>7} {'disk x':>7}",
    ]
    for c in figures["contexts"]:
        lines.append(
            f"{c['context_tokens']:>8} {c['cached_tokens']:>7} {c['recompute_ttft_ms']:>10.1f} "
            f"{c['host_ttft_ms']:>9.1f} "
            f"{c['disk_cold_ttft_ms']:>10.1f} {c['host_speedup']:>6.1f}x {c['disk_speedup']:>6.1f}x"
        )
    targets = figures["targets_at_longest"]
    for name, label in (("host_speedup", "host hit"), ("disk_speedup", "cold disk hit")):
        value = figures[f"{name}_at_longest"]
        verdict = "meets target" if value >= targets[name] else "BELOW TARGET"
        lines.append(f"{label} at the longest context: {value:.1f}x faster than recompute "
                     f"(target >= {targets[name]:.0f}x: {verdict})")
    checked = sum(c["hits_identical_to_recompute"] for c in figures["contexts"])
    lines.append(f"outputs: all {checked} hits generated exactly the recompute's {OUTPUT_TOKENS} tokens")
    return "\n".join(lines)
