"""`kvgate serve --weights DIR`: the embedded model's weights from a safetensors directory, as real servers.

`kvgate export-weights` writes the seeded tiny model in several shards; a server loading them with
each available loader must answer exactly as the seeded server does and carry the same cache
fingerprint, report its start-up in order on /health, and refuse a damaged directory with exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache_impl.engine.model import build_model
from cache_impl.engine.weights import export_weights
from cache_impl.weights.safetensors_dir import CHECKSUMS_NAME, INDEX_NAME, read_safetensors_dir, write_safetensors_dir
from tests.loader_params import EACH_LOADER
from tests.servers import REPO, ServerProcess, ask, distinct_prompt, free_port, http_client

PROMPT = distinct_prompt("weights from a directory", 600)


def export(directory: Path, seed: int = 0) -> None:
    result = subprocess.run([sys.executable, "-m", "gates.cli", "export-weights", str(directory), "--preset", "tiny",
                             "--seed", str(seed), "--shard-mib", "0.1"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {directory}: preset tiny, seed {seed}"), result.stdout


@contextlib.contextmanager
def serving(workdir: Path, weights: Path, *options: str, preset=None):
    """A healthy server on `weights`, stopped (and required to exit cleanly) afterwards."""
    server = ServerProcess(workdir, preset=preset, extra_args=("--weights", str(weights), *options))
    try:
        server.wait_healthy()
        yield server
    finally:
        code = server.stop()
    assert code == 0, server.log()


def health(server) -> dict:
    with http_client(server.port) as client:
        return client.get("/health").json()


def serve_exit(*args: str) -> subprocess.CompletedProcess:
    """`kvgate serve` expected to stop before it listens."""
    return subprocess.run([sys.executable, "-m", "gates.cli", "serve", "--mode", "recompute", "--port",
                           str(free_port()), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("weights") / "tiny-seed-0"
    export(directory)
    return directory


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> dict:
    """The seeded server's answer to PROMPT and its fingerprint."""
    server = ServerProcess(tmp_path_factory.mktemp("seeded"))
    try:
        server.wait_healthy()
        answer = {"text": ask(server, PROMPT)["text"], "fingerprint": health(server)["fingerprint"]}
        startup = health(server)["startup"]
    finally:
        assert server.stop() == 0, server.log()
    assert startup["weights"]["source"] == "seed 0" and startup["weights"]["loader"] is None
    return answer


def test_export_writes_the_models_tensors_in_shards_with_an_index_naming_the_preset(weights):
    written = read_safetensors_dir(weights)
    model = build_model("tiny", 0, torch.device("cpu"))
    assert len(written.files) >= 3 and (weights / INDEX_NAME).is_file() and written.checksums is not None
    assert (
        written.metadata["kvgate.preset"] == "tiny" and json.loads(written.metadata["kvgate.model_args"])["dim"] == 64
    )
    assert {name: list(t.shape) for name, t in model.state_dict().items()} == {
        name: list(entry.shape) for name, entry in written.tensors.items()}
    assert all(entry.dtype == "F32" for entry in written.tensors.values())


def test_loading_weights_builds_the_model_without_torchs_compiler_stack(weights):
    """The model is built uninitialised on its device, then loaded: nothing imports what torch's meta-device
    reference kernels pull in (sympy, dynamo: seconds of every start with weights); the initialisers it
    skipped are torch's again afterwards, and the model answers as the seeded one."""
    script = ("import sys, torch; from pathlib import Path; from cache_impl.engine.weights import load_weights; "
              "from cache_impl.engine.model import build_model; "
              "initialisers = dict(vars(torch.nn.init)); "
              f"model, load = load_weights(Path({str(weights)!r}), 'tiny', 'kvgate', torch.device('cpu')); "
              "seeded = build_model('tiny', 0, torch.device('cpu')); "
              "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules), "
              "dict(vars(torch.nn.init)) == initialisers, load.nbytes > 0, "
              "all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), seeded.state_dict().values())))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True", "True", "True"], result.stdout


@pytest.mark.parametrize("loader", EACH_LOADER)
def test_served_weights_answer_as_the_seeded_model_with_its_fingerprint(weights, seeded, loader, tmp_path):
    with serving(tmp_path, weights, "--load-format", loader) as server:
        body = health(server)
        assert ask(server, PROMPT)["text"] == seeded["text"]
        log = server.log()
    assert body["model"] == "kvgate-tiny" and body["fingerprint"] == seeded["fingerprint"]
    startup = body["startup"]
    assert startup["process_start"] <= startup["imports_done"] <= startup["weights_loaded"] <= startup["ready"]
    loaded = startup["weights"]
    assert loaded["source"] == str(weights) and loaded["loader"] == loader and loaded["preset"] == "tiny"
    assert loaded["nbytes"] == read_safetensors_dir(weights).tensor_bytes and loaded["seconds"] > 0
    assert set(loaded["phases"]) == {"open", "read", "deserialize", "copy"}
    assert loaded["verified_against"] == "the checksum sidecar"
    assert f"kvgate serve: kvgate-tiny, weights from {weights} via {loader} (" in log, log


def test_other_weights_give_another_fingerprint(weights, seeded, tmp_path):
    other = tmp_path / "tiny-seed-1"
    export_weights(other, "tiny", seed=1, shard_bytes=100 << 10)
    with serving(tmp_path, other, preset="tiny") as server:
        fingerprint = health(server)["fingerprint"]
    assert fingerprint != seeded["fingerprint"]


def _flip_data_byte(directory: Path) -> Path:
    checkpoint = read_safetensors_dir(directory)
    entry = checkpoint.tensors_in(checkpoint.files[1])[0]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.offset + entry.nbytes // 2)
        byte = handle.read(1)[0]
        handle.seek(entry.offset + entry.nbytes // 2)
        handle.write(bytes([byte ^ 0x01]))
    return entry.file


def _truncate(directory: Path) -> Path:
    shard = read_safetensors_dir(directory).files[1]
    os.truncate(shard, shard.stat().st_size - 100)
    return shard


@pytest.mark.parametrize("damage", [_truncate, _flip_data_byte], ids=["truncated", "flipped-byte"])
def test_a_damaged_shard_exits_2_naming_the_file(weights, tmp_path, damage):
    copy = tmp_path / "damaged"
    shutil.copytree(weights, copy)
    shard = damage(copy)
    result = serve_exit("--weights", str(copy))
    assert result.returncode == 2, result.stderr
    assert f"kvgate serve: {shard}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "kvgate serve:" not in result.stdout


def test_a_checkpoint_of_another_shape_exits_2_naming_the_tensor(tmp_path):
    tensors = dict(build_model("tiny", 0, torch.device("cpu")).state_dict())
    tensors["layers.1.wo.weight"] = tensors["layers.1.wo.weight"][:, :32].contiguous()
    write_safetensors_dir(
        tmp_path / "odd",
        (
            (name, str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
            for name, t in sorted(tensors.items())
        ),
        shard_bytes=1 << 20,
    )
    result = serve_exit("--preset", "tiny", "--weights", str(tmp_path / "odd"))
    assert result.returncode == 2, result.stderr
    assert ("tensor layers.1.wo.weight: expected float32 [64, 64] (the preset tiny), found float32 [64, 32]"
            in result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_a_preset_that_disagrees_with_the_weights_exits_2(weights):
    result = serve_exit("--preset", "small", "--weights", str(weights))
    assert result.returncode == 2, result.stderr
    assert f"{weights}: expected weights of the preset small (as asked), found the preset tiny" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_arguments_in_the_metadata_that_are_not_json_exit_2_naming_the_checkpoint(tmp_path):
    tensors = dict(build_model("tiny", 0, torch.device("cpu")).state_dict())
    write_safetensors_dir(
        tmp_path / "odd",
        ((name, str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
         for name, t in sorted(tensors.items())),
        shard_bytes=1 << 20, metadata={"kvgate.preset": "tiny", "kvgate.model_args": "{not json"},
    )
    result = serve_exit("--weights", str(tmp_path / "odd"))
    assert result.returncode == 2, result.stderr
    assert "metadata kvgate.model_args: expected the model's arguments as JSON, found '{not json'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_shard_that_is_a_fifo_exits_2_at_once_and_shards_that_disagree_name_both(tmp_path):
    tensors = sorted(build_model("tiny", 0, torch.device("cpu")).state_dict().items())

    def sources(part):
        return ((name, str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy()) for name, t in part)

    half = len(tensors) // 2
    write_safetensors_dir(tmp_path / "a", sources(tensors[:half]), 1 << 30, metadata={"kvgate.preset": "tiny"})
    write_safetensors_dir(tmp_path / "b", sources(tensors[half:]), 1 << 30, metadata={"kvgate.preset": "small"})
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "a" / "model-00001-of-00001.safetensors", mixed / "model-00001-of-00002.safetensors")
    shutil.copy(tmp_path / "b" / "model-00001-of-00001.safetensors", mixed / "model-00002-of-00002.safetensors")
    result = serve_exit("--weights", str(mixed))
    assert result.returncode == 2, result.stderr
    assert ("model-00002-of-00002.safetensors: metadata kvgate.preset: expected 'tiny' as in "
            "model-00001-of-00002.safetensors (the shards of one checkpoint agree), found 'small'") in result.stderr
    fifo = tmp_path / "fifo"
    export(fifo)
    shard = next(fifo.glob("model-*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)                                          # the index names it: its open would block the start
    result = serve_exit("--weights", str(fifo))
    assert result.returncode == 2, result.stderr
    assert f"{shard.name}: expected a safetensors file, found a special file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("export_format", ["kvgate", "hf"])
def test_export_weights_to_a_path_that_is_a_file_says_a_directory_was_expected(tmp_path, export_format):
    """Before: `--force` on a file said `[Errno 17] File exists ... (--force replaces it)`, which it does not."""
    target = tmp_path / "weights.bin"
    target.write_bytes(b"not a checkpoint")
    result = subprocess.run([sys.executable, "-m", "gates.cli", "export-weights", str(target), "--preset", "tiny",
                             "--format", export_format, "--force"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"kvgate export-weights: dir: expected a directory, found a file: {target}"
    assert target.read_bytes() == b"not a checkpoint"


def _without(weights: Path, tmp_path: Path, *names: str) -> Path:
    copy = tmp_path / "without-{}".format("-".join(names))
    shutil.copytree(weights, copy)
    for name in names:
        (copy / name).unlink()
    return copy


@pytest.mark.parametrize("missing", [[CHECKSUMS_NAME], [INDEX_NAME], [INDEX_NAME, CHECKSUMS_NAME]],
                         ids=["no-sidecar", "no-index", "neither"])
def test_weights_without_their_checksums_or_index_are_served_with_a_warning_on_the_start_line(weights, tmp_path,
                                                                                              missing):
    """Before: the server started with `verified_against: null` and said nothing."""
    copy = _without(weights, tmp_path, *missing)
    with serving(tmp_path, copy) as server:
        loaded = health(server)["startup"]["weights"]
        log = server.log()
    assert loaded["missing"] == sorted(missing)
    start_line = next(line for line in log.splitlines() if line.startswith("kvgate serve: kvgate-tiny, "))
    assert f"not fully verified: {copy} has no {' and no '.join(sorted(missing))} (--require-checksums refuses " \
           f"it)" in start_line, start_line


def test_require_checksums_exits_2_naming_what_is_missing(weights, tmp_path):
    copy = _without(weights, tmp_path, CHECKSUMS_NAME)
    result = serve_exit("--weights", str(copy), "--require-checksums")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"kvgate serve: --require-checksums: expected {copy} to hold "
                                     f"{CHECKSUMS_NAME} and {INDEX_NAME}, found no {CHECKSUMS_NAME}")


def test_require_checksums_serves_a_complete_checkpoint_verified(weights, tmp_path):
    with serving(tmp_path, weights, "--require-checksums") as server:
        loaded = health(server)["startup"]["weights"]
    assert loaded["verified_against"] == "the checksum sidecar" and loaded["missing"] == []
