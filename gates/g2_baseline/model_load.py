"""G2's model service loading: a real safetensors checkpoint on the storage under test, read cold by
each loader, each load beside the storage's best read job (G1's sweep) reading the very same files
(gates/side_by_side.py).

How it works: docs/methods/side-by-side.md (gates/g2_baseline/model_load.py).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cache_impl.weights.loaders import LoaderReads, allocate_destinations, load_checkpoint, verify_loaded
from cache_impl.weights.safetensors_dir import (
    CheckpointFormatError,
    SafetensorsDir,
    read_safetensors_dir,
    write_random_checkpoint,
)
from gates.side_by_side import FasterOf, FioFilesRead, Pair, PairedRatio, Pairing, Reading, measure_pairs, paired_ratio
from gates.storage_best import StorageBest
from kvcore.files import drop_cached_pages
from kvcore.loader_names import READS_WITH_O_DIRECT
from kvcore.sequential import Looks, Stopping, sample_until_decided
from kvcore.settings import parse_size
from kvcore.stats import ratio_ci

Progress = Callable[[str], None]
RANDOM_DIR = "model-load"        # under storage.path (and baseline_path): the random checkpoint, removed at the end
# the first round meets files just written and a read path not yet used (threads, buffers): recorded, not judged
# (here its fio side read at 0.79 GB/s where the later ones read at 1.1-1.3)
WARMUP_ROUNDS = 1


@dataclass(frozen=True)
class LoaderRound:
    """One cold load by one loader and fio's read of the same files right after it."""

    loader: str
    pair: Pair
    summary: dict  # cache_impl.weights.loaders.LoadResult.summary(): phases, folded, seconds, bytes, cold, ...
    identical: bool          # every tensor's checksum matched
    mismatch: str = ""       # what did not match, when not identical
    warmup: bool = False     # one of the WARMUP_ROUNDS: recorded and checked, not judged

    def context(self) -> dict:
        s = self.summary
        return {"loader": self.loader, "round": self.pair.round, "seconds": s["seconds"], "bytes": s["nbytes"],
                "fio_gbps": self.pair.fio.gbps, "ratio": self.pair.ratio, "cold": s["cold"],
                "device_read_bytes": s["device_read_bytes"], "identical": self.identical,
                "phases": s["phases"], "folded": s["folded"], "storage": "under test",
                **({"mismatch": self.mismatch} if self.mismatch else {}), **({"warmup": True} if self.warmup else {})}


@dataclass
class LoaderFigures:
    """Every round of one loader, and its side-by-side ratio (over the judged rounds; the warm-up ones apart)."""

    loader: str
    rounds: list[LoaderRound] = field(default_factory=list)
    warmup_rounds: list[LoaderRound] = field(default_factory=list)
    warm: Optional[dict] = None      # one load with the files in the page cache: LoadResult.summary()
    stopping: Optional[Stopping] = None
    looks: Optional[Looks] = None    # the rounds' schedule (`Pairing.looks()`), fixed before the first

    @property
    def judged(self) -> PairedRatio:
        return paired_ratio([r.pair for r in self.rounds], self.stopping, self.looks)

    @property
    def every_load(self) -> list[LoaderRound]:
        """The warm-up rounds and the judged ones: every load, each checked tensor by tensor."""
        return self.warmup_rounds + self.rounds

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.rounds)

    @property
    def cold(self) -> int:
        return sum(bool(r.summary["cold"]) for r in self.rounds)


def device() -> str:
    """Where the loaded tensors go: the GPU when there is one (the copy-to-device phase), else the CPU."""
    import torch  # deferred: torch (seconds); the config reads this module's settings

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Checkpoints:
    """The checkpoint each storage is read from; the random ones are written here and removed by `close`."""

    under_test: SafetensorsDir
    baseline: Optional[SafetensorsDir]
    written: list[Path] = field(default_factory=list)

    def close(self) -> None:
        for path in self.written:
            shutil.rmtree(path, ignore_errors=True)


def _writer(label: str, progress: Progress) -> Callable[[int, int], None]:
    return lambda done, total: progress(f"model load: writing the random checkpoint {label}: "
                                        f"{done / 1e9:.2f} / {total / 1e9:.2f} GB")


def _random_checkpoint(directory: Path, size: int, shard: int, label: str, progress: Progress) -> SafetensorsDir:
    free = shutil.disk_usage(directory.parent if not directory.exists() else directory).free
    if free < size * 1.05:
        raise CheckpointFormatError(f"{directory}: expected room for a {size / 1e9:.2f} GB random checkpoint "
                                    f"(g2.model_load.size), found {free / 1e9:.2f} GB free")
    return write_random_checkpoint(directory, size, shard_bytes=shard, progress=_writer(label, progress),
                                   overwrite=True)


def prepare_checkpoints(config, storage: Path, progress: Progress) -> Checkpoints:
    """`config` is g2.model_load. An existing model (`path`) is only read; else a random checkpoint of
    `size` is written under `storage` (and under `baseline_path` when set)."""
    if config.path is not None:
        baseline = read_safetensors_dir(config.baseline_path) if config.baseline_path is not None else None
        return Checkpoints(read_safetensors_dir(config.path), baseline)
    size, shard = parse_size(config.size), parse_size(config.shard_size)
    written = []
    storage.mkdir(parents=True, exist_ok=True)
    under_test = _random_checkpoint(storage / RANDOM_DIR, size, shard, "on the storage under test", progress)
    written.append(under_test.path)
    baseline = None
    if config.baseline_path is not None:
        config.baseline_path.mkdir(parents=True, exist_ok=True)
        baseline = _random_checkpoint(config.baseline_path / RANDOM_DIR, size, shard, "on the baseline", progress)
        written.append(baseline.path)
    return Checkpoints(under_test, baseline, written)


def cold_load(checkpoint: SafetensorsDir, loader: str, reads: LoaderReads, destinations: Optional[dict] = None):
    """One cold load: the files' pages dropped, loaded into `destinations` (an engine's parameters, allocated
    once before its loads; fresh ones when None) on the device, every tensor checked."""
    drop_cached_pages(checkpoint.files)
    result = _load(checkpoint, loader, reads, destinations)
    try:
        verify_loaded(result, checkpoint)
        mismatch = ""
    except CheckpointFormatError as error:
        mismatch = str(error)
    return result.summary(), mismatch


def measure_loaders(checkpoint: SafetensorsDir, loaders: list[str], judged: str, pairing: Pairing, rules: list,
                    reads: LoaderReads, best: StorageBest, progress: Progress, on_round: Callable[[LoaderRound], None],
                    ) -> tuple[dict[str, LoaderFigures], FasterOf]:
    """WARMUP_ROUNDS rounds, then rounds until the `judged` loader's interval decides `rules` (or `pairing`'s
    max or budget); in each, a loader's cold load and then the storage's best read jobs (`best`, each mode's
    winner, the faster counted) reading the same files: every loader in the warm-up and the first
    `pairing.min` rounds, the judged one alone after them. Returns the figures and the yardstick's runs."""
    fio = best.best_of("read", lambda mode, shape: FioFilesRead(checkpoint.files, shape, f"g2-files-read-{mode}"))
    figures = {loader: LoaderFigures(loader, looks=pairing.looks()) for loader in loaders}
    destinations = allocate_destinations(checkpoint, device())    # the model's parameters, placed once

    def one_round(index: int, warmup: bool = False) -> None:
        # the field's loaders are diagnostics: measured in the warm-up and the first `min` rounds (an interval
        # each), then the rounds go to the judged loader until it decides
        diagnostic = warmup or index - WARMUP_ROUNDS < pairing.min
        for loader in (loaders if diagnostic else [judged]):
            which = (
                "warm-up round, not judged" if warmup else f"round {index - WARMUP_ROUNDS + 1} (at most {pairing.max})"
            )
            progress(f"model load: {which}, {loader} "
                     f"({checkpoint.tensor_bytes / 1e9:.2f} GB cold, then the storage's best jobs on the same files)")
            for tensor in destinations.values():
                tensor.zero_()       # what the last load left must not pass this one's check
            summary, mismatch = cold_load(checkpoint, loader, reads, destinations)
            loaded = Reading(summary["nbytes"], summary["seconds"])
            round_ = LoaderRound(loader, Pair(index, loaded, fio(index, loaded.nbytes)), summary, not mismatch,
                                 mismatch, warmup)
            (figures[loader].warmup_rounds if warmup else figures[loader].rounds).append(round_)
            on_round(round_)

    for index in range(WARMUP_ROUNDS):
        one_round(index, warmup=True)
    stopping = sample_until_decided(lambda i: one_round(WARMUP_ROUNDS + i),
                                    lambda: figures[judged].judged.interval, rules, pairing.min,
                                    pairing.max, pairing.budget_s)
    for f in figures.values():
        f.stopping = stopping

    for loader in loaders:       # warm: straight after a load, pages left in place; reported apart, not judged
        if loader in READS_WITH_O_DIRECT:
            continue             # it reads the device whatever the page cache holds: a warm load is a cold one
        progress(f"model load: one warm load by {loader}")
        figures[loader].warm = warm_load(checkpoint, loader, reads, destinations)
    return figures, fio


def measure_aa_reads(checkpoint: SafetensorsDir, pairing: Pairing, rules: list, best: StorageBest,
                     progress: Progress) -> PairedRatio:
    """A/A: the storage's best read jobs (`best`, the faster of each round) on both sides of every pair, reading
    the checkpoint's files cold, with the loaders' warm-up and sampling; nothing differs, so the interval must
    hold 1."""
    first, second = (best.best_of("read", lambda mode, shape: FioFilesRead(checkpoint.files, shape, f"{name}-{mode}"))
                     for name in ("g2-aa-first", "g2-files-read"))

    def said(pair: Pair) -> None:
        progress(f"model load A/A: pair {pair.round} (at most {pairing.max}), the best job against itself: "
                 f"{pair.ratio:.2f}")

    pairs, stopping = measure_pairs(lambda index: first(index, 0.0), second, pairing, rules, warmup=WARMUP_ROUNDS,
                                    on_pair=said)
    return paired_ratio(pairs, stopping, pairing.looks())


def warm_load(checkpoint: SafetensorsDir, loader: str, reads: LoaderReads, destinations: dict) -> dict:
    """Two loads back to back, the second timed: what the loader gives when the page cache holds the files."""
    _load(checkpoint, loader, reads, destinations)
    return _load(checkpoint, loader, reads, destinations).summary()


def _load(checkpoint: SafetensorsDir, loader: str, reads: LoaderReads, destinations: Optional[dict]):
    return load_checkpoint(checkpoint, loader, device(), destinations=destinations, concurrency=reads.parallel,
                           read_bytes=reads.read_bytes)


@dataclass(frozen=True)
class Speedup:
    """Load seconds on the baseline over the storage under test's, paired round by round."""

    value: float
    interval: tuple[float, float]
    under_test_s: list[float]
    baseline_s: list[float]


def measure_speedup(checkpoints: Checkpoints, loader: str, rounds: int, reads: LoaderReads, progress: Progress,
                    on_round: Callable[[str, int, dict], None]) -> Speedup:
    """`rounds` pairs: the loader's cold load on the storage under test, then on the baseline."""
    if checkpoints.baseline is None:
        raise ValueError("model load speedup: expected a checkpoint on the baseline storage (g2.model_load."
                         "baseline_path), found none")
    under_test: list[float] = []
    baseline: list[float] = []
    for index in range(rounds):
        for storage, checkpoint, seconds in (("under test", checkpoints.under_test, under_test),
                                             ("baseline", checkpoints.baseline, baseline)):
            progress(f"model load: speedup round {index + 1} / {rounds}, {loader} on the {storage} storage")
            summary, _ = cold_load(checkpoint, loader, reads)
            seconds.append(summary["seconds"])
            on_round(storage, index, summary)
    value, interval = ratio_ci(baseline, under_test, paired=True)
    return Speedup(value, interval, under_test, baseline)


def median_phases(figures: LoaderFigures) -> dict[str, float]:
    """The median of each phase over a loader's rounds."""
    phases: dict[str, list[float]] = {}
    for r in figures.rounds:
        for name, seconds in r.summary["phases"].items():
            phases.setdefault(name, []).append(seconds)
    return {name: statistics.median(values) for name, values in phases.items()}
