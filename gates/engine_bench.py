"""`kvgate engine-bench`: single-request TTFT of the embedded engine, recompute vs cache hits.

For each context length: TTFT with nothing cached (a `recompute`-mode engine),
with the prefix in the host tier, and with it only on disk with its pages
dropped (a cold read). Each round runs the three back to back; figures are
medians over rounds, speed-ups the median of per-round ratios.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cache_impl.engine import Engine, EngineConfig
from cache_impl.tokenizer import ByteTokenizer

TARGETS_AT_LONGEST = {"host_speedup": 20.0, "disk_speedup": 15.0}


@dataclass
class EngineBenchSettings:
    directory: Path
    contexts: tuple[int, ...] = (1024, 4096, 8192)
    rounds: int = 3
    preset: str = "small"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return ByteTokenizer().encode("".join(chr(rng.randrange(32, 127)) for _ in range(length - 1)))


def _ttft(engine: Engine, prompt: list[int], expect_cached: int) -> float:
    result = engine.generate(prompt, max_tokens=1)
    if result.finish.cached_tokens != expect_cached:
        raise RuntimeError(f"engine-bench: expected {expect_cached} cached tokens, got {result.finish.cached_tokens}")
    return result.ttft_s


def _measure_context(recompute: Engine, tiered: Engine, length: int, rounds: int) -> dict:
    prompt = _prompt(length, seed=length)
    cached = length // tiered.block_size * tiered.block_size  # every full block, the last one too
    cache = tiered.cache
    tiered.generate(prompt, max_tokens=1)  # computes and stores the prefix
    cache.flush()
    times: dict[str, list[float]] = {"recompute": [], "host": [], "disk_cold": []}
    for _ in range(rounds):
        times["recompute"].append(_ttft(recompute, prompt, 0))
        cache.evict("device")
        times["host"].append(_ttft(tiered, prompt, cached))
        cache.evict("device")
        cache.evict("host")
        cache.drop_page_cache()
        times["disk_cold"].append(_ttft(tiered, prompt, cached))
        cache.flush()
    ratio = lambda name: statistics.median(r / t for r, t in zip(times["recompute"], times[name]))  # noqa: E731
    return {
        "context_tokens": length, "cached_tokens": cached,
        **{f"{name}_ttft_ms": statistics.median(values) * 1e3 for name, values in times.items()},
        "host_speedup": ratio("host"), "disk_speedup": ratio("disk_cold"),
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
            f"{c['context_tokens']:>8} {c['cached_tokens']:>7} {c['recompute_ttft_ms']:>10.1f} {c['host_ttft_ms']:>9.1f} "
            f"{c['disk_cold_ttft_ms']:>10.1f} {c['host_speedup']:>6.1f}x {c['disk_speedup']:>6.1f}x"
        )
    targets = figures["targets_at_longest"]
    for name, label in (("host_speedup", "host hit"), ("disk_speedup", "cold disk hit")):
        value = figures[f"{name}_at_longest"]
        verdict = "meets target" if value >= targets[name] else "BELOW TARGET"
        lines.append(f"{label} at the longest context: {value:.1f}x faster than recompute "
                     f"(target >= {targets[name]:.0f}x: {verdict})")
    return "\n".join(lines)
