"""`io_mode: auto`: the disk tier times its own cold reads both ways on its storage and keeps the faster.

How it works: docs/methods/storage-best.md (cache_impl/cache/tiers/disk_probe.py).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Literal, Protocol

import torch

from cache_impl.cache.keys import Key
from cache_impl.cache.tiers.base import Tier, write_block
from cache_impl.platform.buffers import aligned_empty

PROBE_BYTES = 64 * 2**20
PROBE_ROUNDS = 3
IoMode = Literal["buffered", "direct"]  # how the disk tier reads ("auto" in its config: the probe chooses)
MODES: tuple[IoMode, ...] = ("buffered", "direct")


class ProbedDisk(Tier, Protocol):
    """What the probe uses of a disk tier (cache_impl.cache.tiers.disk.DiskTier), beyond any tier's interface."""

    payload_nbytes: int
    io_mode: IoMode

    def drop_block_pages(self, key: Key) -> None: ...


@dataclass(frozen=True)
class IoProbe:
    """What the start-up probe measured (GB/s per round and mode) and the mode it chose."""

    chosen: IoMode
    blocks: int
    nbytes: int
    gbps: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def median(self, mode: str) -> float:
        return statistics.median(self.gbps[mode]) if self.gbps.get(mode) else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "median_gbps": {mode: self.median(mode) for mode in self.gbps}}


def probe_blocks(payload_nbytes: int) -> int:
    """Blocks the probe writes: at least PROBE_BYTES' worth, and at least 2."""
    return max(2, math.ceil(PROBE_BYTES / payload_nbytes))


def probe_io_mode(tier: ProbedDisk, rounds: int = PROBE_ROUNDS) -> IoProbe:
    """Time `tier`'s cold reads of fresh probe blocks in both modes; the faster by median (ties: buffered)."""
    started = time.perf_counter()
    n = probe_blocks(tier.payload_nbytes)
    keys = [os.urandom(16) for _ in range(n)]
    gbps: dict[str, list[float]] = {mode: [] for mode in MODES}
    outs = aligned_empty((n, tier.payload_nbytes), torch.uint8, "cpu")
    try:
        generator = torch.Generator().manual_seed(int.from_bytes(keys[0][:4], "little"))
        for key in keys:
            write_block(tier, key, torch.randint(0, 256, (tier.payload_nbytes,), dtype=torch.uint8,
                                                 generator=generator))
        outs.zero_()  # touched before timing: page faults are not the storage's
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                gbps[mode].append(_cold_read_gbps(tier, mode, keys, outs))
    except OSError as error:
        return IoProbe("buffered", n, n * tier.payload_nbytes, gbps, time.perf_counter() - started,
                       f"probe failed, reads stay buffered: {error}")
    finally:
        tier.io_mode = "buffered"
        for key in keys:
            tier.delete(key)
    measured = IoProbe("buffered", n, n * tier.payload_nbytes, gbps, time.perf_counter() - started)
    return replace(measured, chosen="direct" if measured.median("direct") > measured.median("buffered") else "buffered")


def _cold_read_gbps(tier: ProbedDisk, mode: IoMode, keys: list[bytes], outs: torch.Tensor) -> float:
    """Drop the probe blocks' pages, then time one read of them all in `mode`; OSError when one is refused."""
    for key in keys:
        tier.drop_block_pages(key)
    tier.io_mode = mode
    start = time.perf_counter()
    reasons = tier.read_into(keys, list(outs))
    elapsed = time.perf_counter() - start
    refused = [reason for reason in reasons if reason is not None]
    if refused:
        raise OSError(f"{len(refused)} of {len(keys)} probe blocks refused on a {mode} read ({refused[0]})")
    return len(keys) * tier.payload_nbytes / elapsed / 1e9
