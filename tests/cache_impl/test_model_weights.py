"""Checkpoint directories and model loaders: what is written loads back equal, with every loader, from the device.

The checkpoints are tens of MiB of random bf16 weights in a few shards; cold loads drop the
files' pages first and must show the bytes in /proc/self/io's read_bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cache_impl.weights.loaders import (
    LOADERS,
    check_destinations,
    load_checkpoint,
    loaded_checksums,
    loader_unavailable,
    verify_loaded,
)
from cache_impl.weights.safetensors_dir import (
    CHECKSUMS_NAME,
    INDEX_NAME,
    CheckpointFormatError,
    file_checksums,
    read_safetensors_dir,
    write_random_checkpoint,
    write_safetensors_dir,
)
from kvcore.files import drop_cached_pages, process_read_bytes
from kvcore.loader_names import READS_WITH_O_DIRECT
from tests.loader_params import EACH_LOADER

TOTAL = 24 << 20
SHARD = 8 << 20
TENSOR = 2 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", TOTAL, shard_bytes=SHARD,
                                   tensor_bytes=TENSOR, seed=7)


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    """A copy of the module's checkpoint to damage."""
    target = tmp_path / "copy"
    shutil.copytree(checkpoint.path, target)
    return target


def _snapshot(directory: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in sorted(directory.iterdir())}


def _flip_byte(file: Path, offset: int) -> None:
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


# -- the writer -----------------------------------------------------------------------------


def test_the_shards_load_with_the_safetensors_library_and_equal_the_sidecar(checkpoint):
    from safetensors import safe_open

    assert len(checkpoint.files) >= 3 and checkpoint.tensor_bytes >= TOTAL
    seen = {}
    for file in checkpoint.files:
        with safe_open(str(file), framework="pt") as handle:
            assert handle.metadata()["format"] == "pt"
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16 and list(tensor.shape) == list(checkpoint.tensors[name].shape)
                seen[name] = loaded_checksums_of(tensor)
    assert seen == checkpoint.checksums == file_checksums(checkpoint)


def loaded_checksums_of(tensor: torch.Tensor) -> str:
    from cache_impl.weights.safetensors_dir import tensor_checksum

    return tensor_checksum(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_the_index_maps_each_tensor_to_its_shard_and_totals_the_bytes(checkpoint):
    index = json.loads((checkpoint.path / INDEX_NAME).read_text())
    count = len(checkpoint.files)
    assert [f.name for f in checkpoint.files] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    assert (
        index["metadata"]["total_size"] == checkpoint.tensor_bytes == sum(t.nbytes for t in checkpoint.tensors.values())
    )
    assert index["weight_map"] == {name: entry.file.name for name, entry in checkpoint.tensors.items()}
    assert all(f.stat().st_size <= SHARD + (1 << 20) for f in checkpoint.files[:-1])  # about shard_bytes each
    assert (
        "model.layers.0.mlp.up_proj.weight" in checkpoint.tensors and "model.embed_tokens.weight" in checkpoint.tensors
    )
    assert checkpoint.notes == ()


def test_progress_follows_the_bytes_written_up_to_the_total(tmp_path):
    calls = []
    written = write_random_checkpoint(tmp_path / "ckpt", 3 << 20, shard_bytes=1 << 20, tensor_bytes=256 << 10,
                                      progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (written.tensor_bytes, written.tensor_bytes)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls) and len(calls) == len(written.tensors)


def test_a_directory_holding_a_checkpoint_is_refused_unless_overwritten(checkpoint, copy_of):
    with pytest.raises(FileExistsError, match=INDEX_NAME.replace(".", r"\.")):
        write_random_checkpoint(copy_of, 1 << 20)
    replaced = write_random_checkpoint(copy_of, 1 << 20, shard_bytes=1 << 20, seed=3, overwrite=True)
    assert len(replaced.files) == 1 and sorted(p.name for p in copy_of.iterdir()) == sorted(
        [replaced.files[0].name, INDEX_NAME, CHECKSUMS_NAME])


def test_a_writer_that_fails_midway_leaves_nothing_that_looks_complete(tmp_path):
    def tensors():
        for i in range(6):
            yield f"t{i}", "float32", [1024], bytes(4096)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_safetensors_dir(tmp_path / "ckpt", tensors(), shard_bytes=8192)
    assert list((tmp_path / "ckpt").iterdir()) == []


# -- reading: malformed directories are named ---------------------------------------------------


def test_a_truncated_shard_is_an_error_naming_the_file(copy_of):
    shard = sorted(copy_of.glob("model-00002-*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 1000)
    with pytest.raises(CheckpointFormatError, match=rf"{shard.name}: truncated: its header names \d+ data bytes, "
                                                    rf"the file holds \d+") as caught:
        read_safetensors_dir(copy_of)
    assert "\n" not in str(caught.value)


def test_a_corrupted_header_is_an_error_naming_the_file(copy_of):
    shard = sorted(copy_of.glob("model-00001-*.safetensors"))[0]
    _flip_byte(shard, 8)          # the header's opening brace
    with pytest.raises(CheckpointFormatError, match=rf"{shard.name}: header: expected JSON"):
        read_safetensors_dir(copy_of)


@pytest.mark.parametrize("damage, message", [
    ("missing_shard", r"model-00002-of-\d+\.safetensors: expected a safetensors file, found none"),
    ("index_names_a_tensor_elsewhere", r"tensor model\.embed_tokens\.weight: expected in model-00002"),
    ("trailing_bytes", r"model-00001-of-\d+\.safetensors: expected \d+ data bytes \(as its header names\)"),
    ("sidecar_short_of_a_tensor", r"kvgate-checksums\.json: tensors: expected a checksum for each"),
])
def test_inconsistent_directories_are_errors_naming_the_file(copy_of, damage, message):
    index = json.loads((copy_of / INDEX_NAME).read_text())
    if damage == "missing_shard":
        next(copy_of.glob("model-00002-*.safetensors")).unlink()
    elif damage == "index_names_a_tensor_elsewhere":
        index["weight_map"]["model.embed_tokens.weight"] = next(copy_of.glob("model-00002-*")).name
        (copy_of / INDEX_NAME).write_text(json.dumps(index))
    elif damage == "trailing_bytes":
        with open(next(copy_of.glob("model-00001-*.safetensors")), "ab") as handle:
            handle.write(b"\0" * 16)
    else:
        sidecar = json.loads((copy_of / CHECKSUMS_NAME).read_text())
        sidecar["tensors"].pop("model.embed_tokens.weight")
        (copy_of / CHECKSUMS_NAME).write_text(json.dumps(sidecar))
    with pytest.raises(CheckpointFormatError, match=message):
        read_safetensors_dir(copy_of)


def test_a_missing_directory_is_an_error_naming_it(tmp_path):
    with pytest.raises(CheckpointFormatError, match=rf"{tmp_path / 'absent'}: expected a checkpoint directory, "
                                                    rf"found nothing"):
        read_safetensors_dir(tmp_path / "absent")
    with pytest.raises(CheckpointFormatError, match=r"expected model\.safetensors\.index\.json, model\.safetensors "
                                                    r"or \*\.safetensors files, found none"):
        read_safetensors_dir(tmp_path)


def test_shards_without_their_index_must_all_be_there(copy_of):
    (copy_of / INDEX_NAME).unlink()
    assert len(read_safetensors_dir(copy_of).files) >= 3     # a complete set reads without the index
    next(copy_of.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointFormatError, match=r"expected \d+ shards model-\*-of-\d+\.safetensors"):
        read_safetensors_dir(copy_of)


def test_destinations_of_another_shape_are_an_error_naming_file_and_tensor(checkpoint):
    name = "model.layers.0.self_attn.q_proj.weight"
    entry = checkpoint.tensors[name]
    destinations = {n: torch.empty(e.shape, dtype=torch.bfloat16) for n, e in checkpoint.tensors.items()}
    destinations[name] = torch.empty((entry.shape[0], entry.shape[1] + 1), dtype=torch.bfloat16)
    with pytest.raises(CheckpointFormatError, match=rf"{entry.file.name}: tensor {name}: expected bfloat16 "
                                                    rf"\[{entry.shape[0]}, {entry.shape[1] + 1}\] \(the preset\), "
                                                    rf"found bfloat16 \[{entry.shape[0]}, {entry.shape[1]}\]"):
        check_destinations(checkpoint, destinations, "the preset")


# -- loaders -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", EACH_LOADER)
def test_each_loader_loads_what_was_written(checkpoint, loader):
    result = load_checkpoint(checkpoint, loader, "cpu", concurrency=4)
    assert verify_loaded(result, checkpoint) == "the checksum sidecar"
    assert loaded_checksums(result) == file_checksums(checkpoint)
    assert result.nbytes == checkpoint.tensor_bytes and result.seconds > 0
    assert set(result.phases) == {"open", "read", "deserialize", "copy"}
    assert all(result.phases[folded] == 0 and into in result.phases for folded, into in result.folded.items())


def _cold_reads_work_here(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(os.urandom(4 << 20))
    drop_cached_pages([probe])
    before = process_read_bytes()
    probe.read_bytes()
    return process_read_bytes() - before >= 4 << 20


@pytest.mark.parametrize("loader", EACH_LOADER)
def test_a_cold_load_reads_the_device_and_a_second_one_only_when_it_bypasses_the_page_cache(checkpoint, loader):
    if not _cold_reads_work_here(checkpoint.path.parent):
        pytest.skip(f"{checkpoint.path.parent}: dropped pages are read without device reads (tmpfs?)")
    drop_cached_pages(checkpoint.files)
    cold = load_checkpoint(checkpoint, loader, "cpu", concurrency=4)
    assert cold.device_read_bytes >= checkpoint.tensor_bytes and cold.cold
    again = load_checkpoint(checkpoint, loader, "cpu", concurrency=4)
    if loader in READS_WITH_O_DIRECT:       # the page cache never serves them: every load is cold
        assert again.device_read_bytes >= checkpoint.tensor_bytes and again.cold
    else:                                   # mmap'd: the pages the first load read serve the second
        assert again.device_read_bytes < 0.1 * checkpoint.tensor_bytes and not again.cold
    verify_loaded(cold, checkpoint)
    verify_loaded(again, checkpoint)


@pytest.mark.parametrize("loader", EACH_LOADER)
def test_a_corrupted_tensor_fails_verification_naming_file_and_tensor(copy_of, loader):
    damaged = read_safetensors_dir(copy_of)
    entry = damaged.tensors_in(damaged.files[1])[1]
    _flip_byte(entry.file, entry.offset + entry.nbytes // 2)
    result = load_checkpoint(read_safetensors_dir(copy_of), loader, "cpu", concurrency=2)
    with pytest.raises(CheckpointFormatError, match=rf"{entry.file.name}: tensor {entry.name}: expected xxh3-64 "
                                                    rf"[0-9a-f]+ \(the checksum sidecar\), the bytes {loader} loaded"):
        verify_loaded(result, damaged)


def test_without_a_sidecar_a_load_is_checked_against_the_files_or_another_load(copy_of):
    (copy_of / CHECKSUMS_NAME).unlink()
    plain = read_safetensors_dir(copy_of)
    assert plain.checksums is None
    first = load_checkpoint(plain, "safetensors")
    assert verify_loaded(first, plain) == "the files read plainly"
    assert verify_loaded(load_checkpoint(plain, "safetensors"), plain, loaded_checksums(first)) == "the reference load"


def test_an_existing_directory_is_never_written_to(checkpoint):
    before = _snapshot(checkpoint.path)
    checked = read_safetensors_dir(checkpoint.path)
    for loader in LOADERS:
        if loader_unavailable(loader) is None:
            drop_cached_pages(checked.files)
            verify_loaded(load_checkpoint(checked, loader, "cpu", concurrency=2), checked)
    assert _snapshot(checkpoint.path) == before
