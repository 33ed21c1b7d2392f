"""G2's model-load rounds with the real loaders on a real random checkpoint (tens of MiB): each loader
alternates with fio reading the same files, every load is checked, and the speedup pairs two storages."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from cache_impl.weights.loaders import LoaderReads
from cache_impl.weights.safetensors_dir import CheckpointFormatError
from gates.g2_baseline.model_load import (
    RANDOM_DIR,
    WARMUP_ROUNDS,
    measure_loaders,
    measure_speedup,
    median_phases,
    prepare_checkpoints,
)
from gates.side_by_side import MIN_PAIRS, FioShape, Pairing
from gates.storage_best import StorageBest
from kvcore.rules import Threshold
from kvcore.stats import ratio_ci

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


def _settings(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"path": None, "size": "24MiB", "shard_size": "8MiB", "baseline_path": None, **fields})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("g2-model-load")
    said = []
    prepared = prepare_checkpoints(_settings(baseline_path=root / "baseline"), root / "storage", said.append)
    yield prepared, root, said
    prepared.close()


RULE = Threshold("model_load_vs_storage_best", ">=", 0.8)


@needs_fio
def test_each_loader_alternates_with_the_best_job_on_the_same_files_and_every_load_is_checked(checkpoints):
    prepared, _, said = checkpoints
    assert any("writing the random checkpoint" in line for line in said)      # progress while it was written
    rounds = []
    direct = FioShape(direct=True, ioengine="libaio", iodepth=4, numjobs=2, bs="4M")    # each mode's best job
    buffered = FioShape(direct=False, ioengine="psync", iodepth=1, numjobs=2, bs="4M")
    best = StorageBest(direct, direct, 1.0, 1.0, "a test", reads={"direct": (direct, 1.0), "buffered": (buffered, 0.9)})
    figures, yardstick = measure_loaders(prepared.under_test, ["kvgate", "safetensors", "runai_streamer"], "kvgate",
                                         Pairing(MIN_PAIRS, MIN_PAIRS, 600), [RULE], LoaderReads(4), best, said.append,
                                         rounds.append)
    # both modes' best jobs ran after every load, and the faster one is the pair's yardstick
    assert len(yardstick.runs) == len(rounds)
    for r, (index, readings) in zip(rounds, yardstick.runs):
        assert index == r.pair.round and set(readings) == {"direct", "buffered"}
        assert r.pair.fio.gbps == max(reading.gbps for reading in readings.values())
    wins = yardstick.describe_wins([r.pair for r in figures["safetensors"].rounds])
    assert wins.startswith("the faster: direct in ") and wins.endswith(" runs")
    counts = [int(word) for word in wins.replace(",", "").split() if word.isdigit()]
    assert sum(counts) == 3 * MIN_PAIRS       # every loader's judged rounds: each had its own best-of run
    # one warm-up round (recorded, checked, not judged), then MIN_PAIRS judged ones
    assert [(r.loader, r.pair.round, r.warmup) for r in rounds] == [
        (loader, i, i < WARMUP_ROUNDS) for i in range(WARMUP_ROUNDS + MIN_PAIRS)
        for loader in ("kvgate", "safetensors", "runai_streamer")]
    assert all(len(f.rounds) == MIN_PAIRS and len(f.every_load) == WARMUP_ROUNDS + MIN_PAIRS
               for f in figures.values())
    for r in rounds:
        assert r.identical and r.summary["nbytes"] == prepared.under_test.tensor_bytes
        assert r.pair.fio.nbytes > 0.9 * prepared.under_test.tensor_bytes      # fio read the same files, once
        assert r.pair.fio.nbytes <= prepared.under_test.tensor_bytes + 2**20
        assert r.summary["cold"], r.summary          # pages dropped before each load: the device was read
        assert set(r.context()["phases"]) == {"open", "read", "deserialize", "copy"}
    judged = {loader: f.judged for loader, f in figures.items()}
    assert all(j.valid and j.value > 0 and j.interval[0] <= j.value <= j.interval[1] for j in judged.values())
    assert all(j.stopping is not None and j.stopping.pairs == MIN_PAIRS for j in judged.values())
    assert median_phases(figures["safetensors"])["copy"] > 0
    # a warm load apart: safetensors (mmap) is served by the page cache; kvgate's loader and the Run:ai streamer
    # read with O_DIRECT, so they have no warm case and get none
    assert not figures["safetensors"].warm["cold"]
    assert figures["runai_streamer"].warm is None and figures["kvgate"].warm is None
    # kvgate's loader moved every byte inside its read phase (reads and copies overlap), and read O_DIRECT
    assert median_phases(figures["kvgate"])["read"] > 0 and figures["kvgate"].cold == MIN_PAIRS


def test_a_corrupted_shard_is_a_mismatch_of_that_round_not_a_crash(checkpoints, tmp_path):
    prepared, _, _ = checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(prepared.under_test.path, copy)
    from cache_impl.weights.safetensors_dir import read_safetensors_dir

    damaged = read_safetensors_dir(copy)
    entry = next(iter(damaged.tensors.values()))
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    from gates.g2_baseline.model_load import cold_load

    summary, mismatch = cold_load(damaged, "safetensors", LoaderReads(4))
    assert summary["nbytes"] == damaged.tensor_bytes
    assert entry.file.name in mismatch and entry.name in mismatch


def test_the_speedup_pairs_a_cold_load_on_each_storage(checkpoints):
    prepared, root, _ = checkpoints
    assert prepared.baseline is not None and prepared.baseline.path == root / "baseline" / RANDOM_DIR
    seen = []
    speedup = measure_speedup(prepared, "runai_streamer", MIN_PAIRS, LoaderReads(4), lambda text: None,
                              lambda storage, index, summary: seen.append((storage, index, summary["cold"])))
    assert [(s, i) for s, i, _ in seen] == [(s, i) for i in range(MIN_PAIRS) for s in ("under test", "baseline")]
    assert all(cold for _, _, cold in seen)          # every load of the pair was a cold one
    # the figure is the paired ratio of the baseline's seconds over the tested storage's, its interval holding it
    assert len(speedup.under_test_s) == len(speedup.baseline_s) == MIN_PAIRS
    assert speedup.value == pytest.approx(ratio_ci(speedup.baseline_s, speedup.under_test_s, paired=True)[0])
    assert speedup.interval[0] <= speedup.value <= speedup.interval[1]


def test_an_existing_model_is_read_never_written_and_a_missing_one_is_a_clear_error(checkpoints, tmp_path):
    prepared, _, _ = checkpoints
    model = prepared.under_test.path
    before = sorted((p.name, p.stat().st_mtime_ns) for p in model.iterdir())
    read = prepare_checkpoints(_settings(path=model), tmp_path / "storage", lambda text: None)
    assert read.written == [] and read.under_test.files == prepared.under_test.files
    read.close()                                    # nothing of an existing model is removed
    assert sorted((p.name, p.stat().st_mtime_ns) for p in model.iterdir()) == before
    with pytest.raises(CheckpointFormatError):
        prepare_checkpoints(_settings(path=tmp_path / "no-model"), tmp_path / "storage", lambda text: None)


def test_a_random_checkpoint_that_does_not_fit_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"expected room for a .* GB random checkpoint"):
        prepare_checkpoints(_settings(size="1000TB"), tmp_path / "storage", lambda text: None)
    assert not (tmp_path / "storage" / RANDOM_DIR).exists()
