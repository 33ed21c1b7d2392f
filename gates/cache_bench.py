"""`kvgate cache-bench`: the cache's tiers against fio and memcpy, side by side in one run.

(a) disk tier: cold load of a >= 256 MiB prefix vs fio 1 MiB sequential reads
    on the same directory, in both I/O modes (O_DIRECT vs fio direct=1;
    buffered after dropping the pages vs fio buffered with invalidate=1);
(b) host tier: load of the same prefix from DRAM vs one plain torch copy of
    the same number of bytes;
(c) longest-prefix lookup for a 128k-token prompt with 1M blocks indexed,
    computing the prompt's keys included, and the index's memory per block.

Timings on shared machines are noisy, so each pair is measured back to back
over several rounds; a ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache
from cache_impl.buffers import aligned_empty
from cache_impl.index import BlockIndex
from cache_impl.keys import block_keys
from kvcore.settings import ConfigError
from workloads.fio import FioJob, run_fio

MiB = 2**20
# Per layer: 4 KV heads x head_dim 64 in bfloat16 over a 256-token block, 256 KiB; `--block-mib` picks the layers
# (2 MiB: 8 layers; 1 MiB: 4, the small preset's block size; 64 MiB: 256, near a 70B model's 80 MiB block).
_LAYER_BYTES = 256 * 1024
TARGETS = {"disk_vs_fio": 0.9, "disk_buffered_cold_vs_fio": 0.9, "host_vs_memcpy": 0.8}
LOOKUP_MS_TARGET = 5.0


def bench_layout(block_mib: int) -> KVLayout:
    """The bench's KV layout whose 256-token block is `block_mib` MiB."""
    return KVLayout(num_layers=block_mib * MiB // _LAYER_BYTES, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                    block_size=256)


@dataclass
class BenchSettings:
    directory: Path
    prefix_mib: int = 256
    rounds: int = 5
    read_workers: int = 4
    block_mib: int = 2
    lookup_prompt_tokens: int = 128 * 1024
    indexed_blocks: int = 1_000_000


    @property
    def layout(self) -> KVLayout:
        return bench_layout(self.block_mib)

    def check(self) -> None:
        """ConfigError when the prefix cannot hold one block of the layout."""
        if self.prefix_mib < self.block_mib:
            raise ConfigError(f"cache-bench: --prefix-mib: expected at least --block-mib ({self.block_mib}), "
                              f"found {self.prefix_mib}")


def _round_ratios(ours: list[float], reference: list[float]) -> list[float]:
    return [a / b for a, b in zip(ours, reference)]


def _paired_ratio(ours: list[float], reference: list[float]) -> float:
    """Median of per-round ratios: each pair ran back to back, so slow drift of the machine cancels."""
    return statistics.median(_round_ratios(ours, reference))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prefix(settings: BenchSettings) -> tuple[list[int], list[torch.Tensor]]:
    layout = settings.layout
    n_blocks = settings.prefix_mib * MiB // layout.block_nbytes
    tokens = list(range(n_blocks * layout.block_size))
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(layout.block_shape, generator=generator).to(torch.bfloat16) for _ in range(n_blocks)]
    return tokens, blocks


def _cache(settings: BenchSettings, cache_dir: Path, n_blocks: int, io_mode: str, host: bool) -> TieredKVCache:
    layout = settings.layout
    config = CacheConfig.from_dict({
        "block_size": layout.block_size,
        "device_capacity_blocks": n_blocks,
        "host_capacity_bytes": (n_blocks + 1) * layout.block_nbytes if host else 0,
        "disk": {
            "path": str(cache_dir), "capacity_bytes": 4 * n_blocks * (layout.block_nbytes + 8192),
            "read_workers": settings.read_workers, "io_mode": io_mode, "cold_reads": io_mode == "buffered",
            "verify_on_start": False,
        },
    })
    return TieredKVCache(config, Fingerprint("cache-bench", "cache-bench", layout))


def _destination(cache: TieredKVCache, tokens: list[int]) -> torch.Tensor:
    """Where loads go, as an engine's request KV would be: allocated once, its pages touched (not timed)."""
    dest = aligned_empty((len(tokens) // cache.block_size, *cache.layout.block_shape), cache.layout.torch_dtype,
                         cache.device)
    return dest.zero_()


def _load_seconds(cache: TieredKVCache, tokens: list[int], dest: torch.Tensor, expect_from: str,
                  before=lambda: None) -> float:
    """Time one load of the whole prefix into `dest`, starting with the device tier empty."""
    cache.evict("device")
    before()
    start = time.perf_counter()
    prefix = cache.load_into(tokens, dest.__getitem__)
    elapsed = time.perf_counter() - start
    if prefix.num_blocks * cache.block_size != len(tokens) or set(prefix.sources) != {expect_from}:
        raise RuntimeError(f"cache-bench: expected every block from {expect_from}, got {set(prefix.sources)}")
    return elapsed


def _same_layout_job(settings: BenchSettings, fio_dir: Path, mode: str, direct: bool, n_blocks: int) -> FioJob:
    """fio reading one whole file per block, files the size of the tier's block files."""
    file_bytes = settings.layout.block_nbytes + 8192  # header + payload, rounded up generously
    per_job = max(1, n_blocks // settings.read_workers)
    return FioJob(
        name=f"blockfiles-{mode}", directory=fio_dir, rw="read", bs=str(file_bytes), size=str(per_job * file_bytes),
        direct=direct, numjobs=settings.read_workers,
        extra=(f"--nrfiles={per_job}", f"--filesize={file_bytes}", "--file_service_type=sequential"),
    )


def bench_disk(settings: BenchSettings, tokens: list[int], blocks: list[torch.Tensor]) -> dict:
    nbytes = len(blocks) * settings.layout.block_nbytes
    cache_dir, fio_dir = settings.directory / "tier", settings.directory / "fio"
    writer = _cache(settings, cache_dir, len(blocks), "buffered", host=False)
    writer.store(tokens, blocks)
    writer.close()
    os.sync()
    per_file = f"{max(1, settings.prefix_mib // settings.read_workers)}M"
    results = {}
    for mode, direct in (("direct", True), ("buffered_cold", False)):
        cache = _cache(settings, cache_dir, len(blocks), "direct" if direct else "buffered", host=False)
        job = FioJob(name=f"seqread-{mode}", directory=fio_dir, rw="read", bs="1M", size=per_file,
                     direct=direct, numjobs=settings.read_workers)
        layout_job = _same_layout_job(settings, fio_dir, mode, direct, len(blocks))
        run_fio(job), run_fio(layout_job)  # lay out fio's files before anything is timed
        tier_s, fio_bw, layout_bw = [], [], []
        dest = _destination(cache, tokens)
        for _ in range(settings.rounds):
            tier_s.append(_load_seconds(cache, tokens, dest, "disk", before=cache.drop_page_cache))
            fio_bw.append(run_fio(job).read_bw_bytes)
            layout_bw.append(run_fio(layout_job).read_bw_bytes)
        cache.close()
        tier_bw = [nbytes / s for s in tier_s]
        results[mode] = {
            "tier_gbps": statistics.median(tier_bw) / 1e9,
            "fio_gbps": statistics.median(fio_bw) / 1e9,
            "ratio": _paired_ratio(tier_bw, fio_bw),
            "fio_same_layout_gbps": statistics.median(layout_bw) / 1e9,
            "ratio_same_layout": _paired_ratio(tier_bw, layout_bw),
            "ratio_rounds": _round_ratios(tier_bw, fio_bw),
            "tier_rounds_gbps": [b / 1e9 for b in tier_bw],
            "fio_rounds_gbps": [b / 1e9 for b in fio_bw],
            "fio_same_layout_rounds_gbps": [b / 1e9 for b in layout_bw],
            "fio_job": " ".join(job.argv()[3:11]),
            "fio_same_layout_job": " ".join(layout_job.argv()[3:11] + list(layout_job.extra)),
        }
    return {"prefix_bytes": nbytes, "block_bytes": settings.layout.block_nbytes,
            "read_workers": settings.read_workers, **results}


def bench_host(settings: BenchSettings, tokens: list[int], blocks: list[torch.Tensor]) -> dict:
    nbytes = len(blocks) * settings.layout.block_nbytes
    cache = _cache(settings, settings.directory / "host-tier", len(blocks), "buffered", host=True)
    cache.store(tokens, blocks)
    cache.flush()
    source = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)
    target.copy_(source)  # touch both once so page faults are not timed
    tier_s, copy_s = [], []
    dest = _destination(cache, tokens)
    for _ in range(settings.rounds):
        tier_s.append(_load_seconds(cache, tokens, dest, "host"))
        copy_s.append(_timed(lambda: target.copy_(source)))
    cache.close()
    tier_bw, copy_bw = [nbytes / s for s in tier_s], [nbytes / s for s in copy_s]
    return {
        "prefix_bytes": nbytes, "tier_gbps": statistics.median(tier_bw) / 1e9,
        "memcpy_gbps": statistics.median(copy_bw) / 1e9, "ratio": _paired_ratio(tier_bw, copy_bw),
        "ratio_rounds": _round_ratios(tier_bw, copy_bw),
        "tier_rounds_gbps": [b / 1e9 for b in tier_bw], "memcpy_rounds_gbps": [b / 1e9 for b in copy_bw],
    }


def bench_lookup(settings: BenchSettings) -> dict:
    layout = settings.layout
    fingerprint = Fingerprint("cache-bench", "cache-bench", layout)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 32000, settings.lookup_prompt_tokens)]
    gc.collect()
    tracemalloc.start()
    index = BlockIndex()
    random_keys = rng.bytes(16 * settings.indexed_blocks)
    for start in range(0, len(random_keys), 16):
        index.add(random_keys[start : start + 16], 2)
    del random_keys
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    for key in block_keys(prompt, fingerprint.digest, layout.block_size):
        index.add(key, 1)

    def lookup() -> int:
        return len(index.longest_prefix(block_keys(prompt, fingerprint.digest, layout.block_size)))

    if lookup() != settings.lookup_prompt_tokens // layout.block_size:
        raise RuntimeError("cache-bench: the prompt's blocks were not all found")
    times = [_timed(lookup) for _ in range(30)]
    return {
        "prompt_tokens": settings.lookup_prompt_tokens, "indexed_blocks": len(index),
        "lookup_ms_median": statistics.median(times) * 1e3, "lookup_ms_max": max(times) * 1e3,
        "index_bytes_per_block": index_bytes / settings.indexed_blocks,
    }


def run_cache_bench(settings: BenchSettings) -> dict:
    """Run (a), (b) and (c); returns the raw figures plus the headline figures."""
    settings.check()
    settings.directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-cache-bench-", dir=settings.directory))
    try:
        settings = BenchSettings(**{**settings.__dict__, "directory": work})
        tokens, blocks = _prefix(settings)
        disk = bench_disk(settings, tokens, blocks)
        host = bench_host(settings, tokens, blocks)
        del blocks
        lookup = bench_lookup(settings)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "disk_vs_fio": disk["direct"]["ratio"],
        "disk_buffered_cold_vs_fio": disk["buffered_cold"]["ratio"],
        "host_vs_memcpy": host["ratio"],
        "lookup_ms": lookup["lookup_ms_median"],
        "disk": disk, "host": host, "lookup": lookup,
        "targets": {**{name: f">= {target}" for name, target in TARGETS.items()},
                    "lookup_ms": f"<= {LOOKUP_MS_TARGET:g}"},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def _mark(ok: bool) -> str:
    return "meets target" if ok else "BELOW TARGET"


def _headline(figures: dict, name: str) -> str:
    value, target = figures[name], TARGETS[name]
    return f"{name} = {value:.2f}  (target >= {target}: {_mark(value >= target)})"


def _rounds(ratios: list[float]) -> str:
    return "per round " + " ".join(f"{r:.2f}" for r in ratios)


def format_report(figures: dict) -> str:
    disk, host, lookup = figures["disk"], figures["host"], figures["lookup"]
    lines = [
        f"kvgate cache-bench  (prefix {disk['prefix_bytes'] / MiB:.0f} MiB "
        f"in {disk['block_bytes'] / MiB:.0f} MiB blocks, "
        f"{disk['read_workers']} read workers, device {figures['device']})",
        "",
        "(a) disk tier, cold load vs fio sequential read, 1 MiB, same directory",
    ]
    for mode in ("direct", "buffered_cold"):
        d = disk[mode]
        lines += [
            f"    {mode:<14} tier {d['tier_gbps']:.2f} GB/s   fio {d['fio_gbps']:.2f} GB/s   ratio {d['ratio']:.2f}"
            f"   | fio on one file per block {d['fio_same_layout_gbps']:.2f} GB/s   ratio {d['ratio_same_layout']:.2f}",
            f"    {'':<14} {_rounds(d['ratio_rounds'])}",
        ]
    lines += [
        f"    {_headline(figures, 'disk_vs_fio')}",
        f"    {_headline(figures, 'disk_buffered_cold_vs_fio')}",
        "",
        "(b) host tier load vs plain torch copy of the same bytes",
        f"    tier {host['tier_gbps']:.2f} GB/s   memcpy {host['memcpy_gbps']:.2f} GB/s",
        f"    {_rounds(host['ratio_rounds'])}",
        f"    {_headline(figures, 'host_vs_memcpy')}",
        "",
        f"(c) longest-prefix lookup, {lookup['prompt_tokens'] // 1024}k-token prompt, "
        f"{lookup['indexed_blocks']:,} blocks indexed, keys computed",
        f"    lookup_ms = {figures['lookup_ms']:.2f} median, {lookup['lookup_ms_max']:.2f} max  "
        f"(target <= {LOOKUP_MS_TARGET:g}: {_mark(figures['lookup_ms'] <= LOOKUP_MS_TARGET)})",
        f"    index memory {lookup['index_bytes_per_block']:.0f} bytes per block",
        "",
        "Ratios: median of back-to-back pairs. On a virtual machine the host may cache the disk, so a",
        "guest-cold read can beat a direct-I/O fio figure; both modes are shown for that reason.",
    ]
    return "\n".join(lines)
