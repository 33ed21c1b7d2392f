"""Checkpoint directories as models ship them: sharded safetensors files and their index.

How it works: docs/methods/storage-best.md (cache_impl/weights/safetensors_dir.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import xxhash

from kvcore.files import fsync_directory

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CHECKSUMS_NAME = "kvgate-checksums.json"
CHECKSUM_ALGORITHM = "xxh3-64"
MAX_HEADER_BYTES = 100_000_000      # the safetensors library refuses larger headers
DATA_ALIGN = 4096                   # each shard's data section starts on a page boundary
_SHARD_NAME = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")
_TEMP_SHARD = re.compile(r"\.shard-\d+\.safetensors\.tmp-\d+")

# safetensors dtype codes and their sizes; the writer also takes torch's names ("bfloat16").
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
               "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}

Progress = Callable[[int, int], None]
TensorSource = tuple[str, str, Sequence[int], Union[bytes, bytearray, memoryview]]


class CheckpointFormatError(ValueError):
    """A checkpoint file is missing, truncated or inconsistent; the message names the file (and tensor),
    what was expected and what was found."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes lie (`offset` from the start of its file)."""

    name: str
    file: Path
    dtype: str                 # safetensors code: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsDir:
    """A parsed, checked checkpoint directory. `tensor_bytes` is the sum of the tensors' bytes (what a
    loader moves); `file_bytes` that of the files (headers included)."""

    path: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorEntry]
    tensor_bytes: int
    file_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)      # the shards' `__metadata__`, merged
    checksums: Optional[dict[str, str]] = None                  # tensor -> xxh3-64 hex, from the sidecar
    notes: tuple[str, ...] = ()                                 # oddities that do not stop a load

    def tensors_in(self, file: Path) -> list[TensorEntry]:
        """The file's tensors in the order of their bytes."""
        return sorted((t for t in self.tensors.values() if t.file == file), key=lambda t: t.offset)


def dtype_code(dtype: str) -> str:
    """The safetensors code of a dtype given as a code ("BF16") or a torch name ("bfloat16", "torch.bfloat16")."""
    name = dtype.removeprefix("torch.")
    if name in DTYPE_BYTES:
        return name
    if name in DTYPE_CODES:
        return DTYPE_CODES[name]
    raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CODES)}, found {dtype!r}")


def tensor_checksum(data) -> str:
    """xxh3-64 hex of a tensor's bytes (anything with the buffer protocol)."""
    return xxhash.xxh3_64_hexdigest(memoryview(data).cast("B") if not isinstance(data, bytes) else data)


# --------------------------------------------------------------------------- reading


def read_safetensors_dir(path: Path) -> SafetensorsDir:
    """Parse and check a checkpoint directory; raises CheckpointFormatError naming the file at fault.

    Checks: the files the index names exist; each header is sane JSON of known dtypes whose sizes
    match their shapes; the tensors tile the data section exactly (no gap, no overlap) and the file
    holds all of it; no tensor is in two files; the index's weight map agrees with the headers.
    Only headers are read; nothing is written.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointFormatError(f"{directory}: expected a checkpoint directory, found "
                                    f"{'a file' if directory.exists() else 'nothing'}")
    weight_map, index_total = _read_index(directory)
    notes: list[str] = []
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
    elif (directory / SINGLE_NAME).is_file():
        names = [SINGLE_NAME]
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
        _check_shard_set(directory, names)
    if not names:
        raise CheckpointFormatError(f"{directory}: expected {INDEX_NAME}, {SINGLE_NAME} or *.safetensors files, "
                                    f"found none")
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    said_in: dict[str, str] = {}          # each metadata key's first file
    files: list[Path] = []
    file_bytes = 0
    for name in names:
        file = directory / name
        entries, file_metadata, size = read_safetensors_header(file)
        for entry in entries:
            if entry.name in tensors:
                raise CheckpointFormatError(f"{file}: tensor {entry.name}: expected it in one file, found it also "
                                            f"in {tensors[entry.name].file.name}")
            tensors[entry.name] = entry
        for key, value in file_metadata.items():
            if key in metadata and metadata[key] != value:     # one model's shards say one thing of it
                raise CheckpointFormatError(f"{file}: metadata {key}: expected {metadata[key]!r} as in {said_in[key]} "
                                            f"(the shards of one checkpoint agree), found {value!r}")
            metadata[key] = value
            said_in.setdefault(key, file.name)
        files.append(file)
        file_bytes += size
    if weight_map is not None:
        _check_weight_map(directory, weight_map, tensors)
    tensor_bytes = sum(t.nbytes for t in tensors.values())
    if index_total is not None and index_total != tensor_bytes:
        notes.append(f"{INDEX_NAME}: metadata.total_size is {index_total}, the tensors hold {tensor_bytes} bytes")
    checksums = _read_checksums(directory, tensors)
    return SafetensorsDir(directory, tuple(files), tensors, tensor_bytes, file_bytes, metadata, checksums,
                          tuple(notes))


def read_safetensors_header(file: Path) -> tuple[list[TensorEntry], dict[str, str], int]:
    """One file's tensors (absolute offsets), its `__metadata__` and its size, checked against the size."""
    try:
        kind = os.stat(file).st_mode
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file}: expected a safetensors file, found none") from None
    if not stat.S_ISREG(kind) and not stat.S_ISDIR(kind):      # a FIFO would block the open: refused before it
        raise CheckpointFormatError(f"{file}: expected a safetensors file, found a special file (a FIFO or a device)")
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(f"{file}: truncated: expected an 8-byte header length, the file holds "
                                            f"{size} bytes")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointFormatError(f"{file}: header: expected at most {MAX_HEADER_BYTES} bytes, found a "
                                            f"length of {header_len} (not a safetensors file?)")
            if 8 + header_len > size:
                raise CheckpointFormatError(f"{file}: truncated: its header length is {header_len} bytes, the file "
                                            f"holds {size - 8} after the length")
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file}: expected a safetensors file, found none") from None
    except IsADirectoryError:
        raise CheckpointFormatError(f"{file}: expected a safetensors file, found a directory") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointFormatError(f"{file}: header: expected JSON, found bytes that do not parse ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{file}: header: expected a JSON object, found {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{file}: header: __metadata__: expected a mapping of strings, found {metadata!r}")
    data_start = 8 + header_len
    entries = [_entry(file, name, spec, data_start) for name, spec in header.items()]
    _check_tiling(file, entries, size - data_start, data_start)
    return entries, metadata, size


def _entry(file: Path, name: str, spec: object, data_start: int) -> TensorEntry:
    where = f"{file}: tensor {name}"
    if not isinstance(spec, dict):
        raise CheckpointFormatError(f"{where}: expected a mapping of dtype, shape, data_offsets, found {spec!r}")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointFormatError(f"{where}: dtype: expected one of {', '.join(DTYPE_BYTES)}, found {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointFormatError(f"{where}: shape: expected a list of integers >= 0, found {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointFormatError(f"{where}: data_offsets: expected [begin, end] with 0 <= begin <= end, "
                                    f"found {offsets!r}")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointFormatError(f"{where}: expected {nbytes} bytes for {dtype} {shape}, its data_offsets "
                                    f"span {offsets[1] - offsets[0]}")
    return TensorEntry(name, file, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _check_tiling(file: Path, entries: list[TensorEntry], data_bytes: int, data_start: int) -> None:
    """The tensors cover the data section exactly, as the safetensors library requires."""
    position = data_start
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if entry.offset != position:
            found = "a gap" if entry.offset > position else "an overlap"
            raise CheckpointFormatError(f"{file}: tensor {entry.name}: expected its data to start at byte "
                                        f"{position - data_start} of the data section, found {found} (it starts at "
                                        f"{entry.offset - data_start})")
        position += entry.nbytes
    named = position - data_start
    if named > data_bytes:
        raise CheckpointFormatError(f"{file}: truncated: its header names {named} data bytes, the file holds "
                                    f"{data_bytes}")
    if named < data_bytes:
        raise CheckpointFormatError(f"{file}: expected {named} data bytes (as its header names), the file holds "
                                    f"{data_bytes}")


def _check_shard_set(directory: Path, names: list[str]) -> None:
    """Without an index, shards named `model-i-of-N` must all be there (a writer that died leaves fewer)."""
    counts = {int(m.group(2)) for m in map(_SHARD_NAME.fullmatch, names) if m}
    for count in counts:
        present = sum(1 for name in names if (m := _SHARD_NAME.fullmatch(name)) and int(m.group(2)) == count)
        if present != count:
            raise CheckpointFormatError(f"{directory}: expected {count} shards model-*-of-{count:05d}.safetensors "
                                        f"(no {INDEX_NAME} here), found {present}")


def _read_index(directory: Path) -> tuple[Optional[dict[str, str]], Optional[int]]:
    """The index's weight map (None without an index) and its metadata.total_size if any."""
    index = directory / INDEX_NAME
    if not index.is_file():
        return None, None
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointFormatError(f"{index}: expected JSON, found text that does not parse ({error})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointFormatError(f"{index}: weight_map: expected a non-empty mapping of tensor names to file "
                                    f"names, found {type(weight_map).__name__}")
    for file_name in set(weight_map.values()):
        if Path(file_name).name != file_name or file_name in ("", ".", ".."):
            raise CheckpointFormatError(f"{index}: weight_map: expected file names inside the directory, found "
                                        f"{file_name!r}")
    metadata = data.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    return weight_map, total if isinstance(total, int) else None


def _check_weight_map(directory: Path, weight_map: dict[str, str], tensors: dict[str, TensorEntry]) -> None:
    index = directory / INDEX_NAME
    for name, file_name in sorted(weight_map.items()):
        entry = tensors.get(name)
        if entry is None:
            raise CheckpointFormatError(f"{directory / file_name}: tensor {name}: expected it (the index maps it "
                                        f"here), found no such tensor in the file")
        if entry.file.name != file_name:
            raise CheckpointFormatError(f"{index}: tensor {name}: expected in {file_name} (the weight map), found "
                                        f"in {entry.file.name}")
    unmapped = sorted(set(tensors) - set(weight_map))
    if unmapped:
        raise CheckpointFormatError(f"{tensors[unmapped[0]].file}: tensor {unmapped[0]}: expected in the index's "
                                    f"weight_map, found it missing ({len(unmapped)} tensors unmapped)")


def _read_checksums(directory: Path, tensors: dict[str, TensorEntry]) -> Optional[dict[str, str]]:
    sidecar = directory / CHECKSUMS_NAME
    if not sidecar.is_file():
        return None
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointFormatError(f"{sidecar}: expected JSON, found text that does not parse ({error})") from None
    if not isinstance(data, dict) or data.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CheckpointFormatError(f"{sidecar}: algorithm: expected {CHECKSUM_ALGORITHM!r}, found "
                                    f"{data.get('algorithm') if isinstance(data, dict) else data!r}")
    checksums = data.get("tensors")
    if not isinstance(checksums, dict) or set(checksums) != set(tensors):
        missing = sorted(set(tensors) - set(checksums or {})) + sorted(set(checksums or {}) - set(tensors))
        raise CheckpointFormatError(f"{sidecar}: tensors: expected a checksum for each of the {len(tensors)} "
                                    f"tensors, found {missing[:1] or 'something else'} differing")
    return {str(k): str(v) for k, v in checksums.items()}


def file_checksums(checkpoint: SafetensorsDir) -> dict[str, str]:
    """Each tensor's xxh3-64, read from the files with plain reads (a reference independent of any loader)."""
    checksums = {}
    for file in checkpoint.files:
        with open(file, "rb") as handle:
            for entry in checkpoint.tensors_in(file):
                handle.seek(entry.offset)
                checksums[entry.name] = tensor_checksum(handle.read(entry.nbytes))
    return checksums


# --------------------------------------------------------------------------- writing


def write_safetensors_dir(path: Path, tensors: Iterable[TensorSource], shard_bytes: int,
                          progress: Optional[Progress] = None, metadata: Optional[dict[str, str]] = None,
                          total_bytes: int = 0, overwrite: bool = False,
                          also: tuple[str, ...] = ()) -> SafetensorsDir:
    """Stream (name, dtype, shape, bytes) into shards `model-0000i-of-0000N.safetensors` of about
    `shard_bytes` each, then the checksum sidecar and the index; returns the directory as read back.

    Each tensor's bytes go to their final place in a temp shard file as they come (one tensor in
    memory at a time); the header is written into room left before the data once the shard is
    full (a shard closes early when that room is). Every file is fsync'd under a temp name and
    renamed, the index last, so a directory whose writer died never looks complete.
    `progress(done, total_bytes)` follows the tensor bytes written. A directory holding a
    checkpoint (or one of the files named in `also`: another format's) is refused unless `overwrite` (its index goes
    first, then its files).
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    clear_checkpoint(directory, overwrite, also)
    header_room = _header_room(shard_bytes)
    file_metadata = {"format": "pt", **(metadata or {})}
    shards: list[_ShardWriter] = []
    checksums: dict[str, str] = {}
    done = 0
    try:
        for name, dtype, shape, data in tensors:
            if name in checksums:
                raise ValueError(f"tensors: expected unique names, found {name!r} twice")
            code, view = dtype_code(dtype), memoryview(data).cast("B")
            expected = math.prod(shape) * DTYPE_BYTES[code]
            if view.nbytes != expected:
                raise ValueError(f"tensor {name}: expected {expected} bytes for {code} {list(shape)}, found "
                                 f"{view.nbytes}")
            shard = shards[-1] if shards else None
            if shard is None or not shard.fits(name, code, shape, view.nbytes, shard_bytes):
                if shard is not None:
                    shard.finish(file_metadata)
                shards.append(_ShardWriter(directory, len(shards), header_room))
            shards[-1].add(name, code, shape, view)
            checksums[name] = tensor_checksum(view)
            done += view.nbytes
            if progress is not None:
                progress(done, max(total_bytes, done))
        if not shards:
            raise ValueError("tensors: expected at least one tensor, found none")
        shards[-1].finish(file_metadata)
        final_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for shard, final in zip(shards, final_names):
            os.replace(shard.temp, directory / final)
        weight_map = {n: final for shard, final in zip(shards, final_names) for n in shard.names}
        _write_json_durably(directory / CHECKSUMS_NAME, {"algorithm": CHECKSUM_ALGORITHM, "tensors": checksums})
        _write_json_durably(directory / INDEX_NAME, {"metadata": {"total_size": done, **(metadata or {})},
                                                     "weight_map": weight_map})
        fsync_directory(directory)
    finally:
        for shard in shards:
            shard.discard()
    return read_safetensors_dir(directory)


class _ShardWriter:
    """One shard being written: data from `room` on, the header pwritten at the start when finished."""

    def __init__(self, directory: Path, number: int, room: int) -> None:
        self.temp = directory / f".shard-{number + 1:05d}.safetensors.tmp-{os.getpid()}"
        self.room = room
        self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.header: dict[str, dict] = {}
        self.header_estimate = 64
        self.data_bytes = 0

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def fits(self, name: str, dtype: str, shape: Sequence[int], nbytes: int, shard_bytes: int) -> bool:
        if not self.header:
            return True
        grows = len(json.dumps({name: self._spec(dtype, shape, nbytes)})) + 32
        return self.data_bytes + nbytes <= shard_bytes and self.header_estimate + grows <= self.room - 8

    def add(self, name: str, dtype: str, shape: Sequence[int], view: memoryview) -> None:
        spec = self._spec(dtype, shape, view.nbytes)
        self.header[name] = spec
        self.header_estimate += len(json.dumps({name: spec})) + 32
        written, position = 0, self.room + self.data_bytes
        while written < view.nbytes:
            written += os.pwrite(self.fd, view[written:], position + written)
        self.data_bytes += view.nbytes

    def _spec(self, dtype: str, shape: Sequence[int], nbytes: int) -> dict:
        return {"dtype": dtype, "shape": [int(d) for d in shape],
                "data_offsets": [self.data_bytes, self.data_bytes + nbytes]}

    def finish(self, metadata: dict[str, str]) -> None:
        """The header, padded with spaces to the room (the format allows trailing whitespace); fsync; close."""
        header = json.dumps({"__metadata__": metadata, **self.header}, separators=(",", ":")).encode()
        if len(header) > self.room - 8:
            raise ValueError(f"{self.temp}: header of {len(header)} bytes outgrew its room of {self.room - 8}")
        header += b" " * (self.room - 8 - len(header))
        os.pwrite(self.fd, struct.pack("<Q", len(header)) + header, 0)
        os.ftruncate(self.fd, self.room + self.data_bytes)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def discard(self) -> None:
        """Close and remove the temp file if it was never renamed (a failed write leaves nothing behind)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.temp.unlink(missing_ok=True)


def _header_room(shard_bytes: int) -> int:
    """Room for a shard's header: 1/1024 of the shard, 64 KiB to 4 MiB, whole pages (so data is aligned)."""
    room = min(max(shard_bytes // 1024, 64 << 10), 4 << 20)
    return -(-room // DATA_ALIGN) * DATA_ALIGN


def clear_checkpoint(directory: Path, overwrite: bool, also: tuple[str, ...] = ()) -> None:
    """Refuse a directory holding a checkpoint, ours or one of the files named in `also` (another format's:
    a Hugging Face export's), unless `overwrite`: then remove them all, the index first, so that one format is
    left; remove the temp shards a writer that died left behind."""
    for stale in directory.iterdir():
        if _TEMP_SHARD.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
    existing = sorted(p.name for p in directory.iterdir()
                      if p.name in (INDEX_NAME, CHECKSUMS_NAME, *also) or p.name.endswith(".safetensors"))
    if not existing:
        return
    if not overwrite:
        raise FileExistsError(f"{directory}: expected a directory without a checkpoint, found "
                              f"{INDEX_NAME if INDEX_NAME in existing else existing[0]} and {len(existing) - 1} more")
    (directory / INDEX_NAME).unlink(missing_ok=True)      # first: from here on it does not look complete
    fsync_directory(directory)
    for name in existing:
        (directory / name).unlink(missing_ok=True)


def _write_json_durably(path: Path, data: dict) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


# --------------------------------------------------------------------------- random checkpoints


def llm_tensor_specs(total_bytes: int, tensor_bytes: int, dtype: str = "bfloat16") -> Iterator[tuple[str, list[int]]]:
    """Names and shapes of a Llama-style decoder whose largest tensor (an MLP projection) is about
    `tensor_bytes`, layer after layer until `total_bytes` is reached (the total passes it by less than
    one tensor): embed_tokens, then per layer q/k/v/o (grouped-query: k and v a quarter of q), the gated
    MLP and two norms, then model.norm and lm_head if they still fit."""
    item = DTYPE_BYTES[dtype_code(dtype)]
    hidden = max(128, int(math.sqrt(tensor_bytes / item / 3.5)) // 128 * 128)
    ffn, kv, vocab = int(hidden * 3.5) // 128 * 128, hidden // 4, hidden * 3
    emitted = 0

    def take(name: str, shape: list[int]) -> Optional[tuple[str, list[int]]]:
        nonlocal emitted
        if emitted >= total_bytes:
            return None
        emitted += math.prod(shape) * item
        return name, shape

    first = take("model.embed_tokens.weight", [vocab, hidden])
    if first:
        yield first
    layer = 0
    while emitted < total_bytes:
        prefix = f"model.layers.{layer}"
        for name, shape in ((f"{prefix}.input_layernorm.weight", [hidden]),
                            (f"{prefix}.self_attn.q_proj.weight", [hidden, hidden]),
                            (f"{prefix}.self_attn.k_proj.weight", [kv, hidden]),
                            (f"{prefix}.self_attn.v_proj.weight", [kv, hidden]),
                            (f"{prefix}.self_attn.o_proj.weight", [hidden, hidden]),
                            (f"{prefix}.post_attention_layernorm.weight", [hidden]),
                            (f"{prefix}.mlp.gate_proj.weight", [ffn, hidden]),
                            (f"{prefix}.mlp.up_proj.weight", [ffn, hidden]),
                            (f"{prefix}.mlp.down_proj.weight", [hidden, ffn])):
            spec = take(name, shape)
            if spec is None:
                return
            yield spec
        layer += 1


def write_random_checkpoint(path: Path, total_bytes: int, shard_bytes: int = 512 << 20,
                            tensor_bytes: int = 64 << 20, dtype: str = "bfloat16", seed: int = 0,
                            progress: Optional[Progress] = None, overwrite: bool = False) -> SafetensorsDir:
    """An LLM-shaped checkpoint of random weights (`llm_tensor_specs`) in shards of about `shard_bytes`.

    The bytes are random bits from numpy's SFC64 generator (gigabytes per second on one core), each
    tensor distinct, so storage that compresses or deduplicates cannot shortcut the reads.
    """
    if total_bytes < 1:
        raise ValueError(f"total_bytes: expected a size >= 1, found {total_bytes}")
    bits = np.random.SFC64(seed)
    specs = list(llm_tensor_specs(total_bytes, tensor_bytes, dtype))
    planned = sum(math.prod(shape) for _, shape in specs) * DTYPE_BYTES[dtype_code(dtype)]

    def tensors() -> Iterator[TensorSource]:
        item = DTYPE_BYTES[dtype_code(dtype)]
        for name, shape in specs:
            nbytes = math.prod(shape) * item
            words = bits.random_raw(-(-nbytes // 8))
            yield name, dtype, shape, words.view(np.uint8)[:nbytes].data  # .data: the slice's memoryview

    metadata = {"kvgate.random_seed": str(seed)}
    return write_safetensors_dir(path, tensors(), shard_bytes, progress, metadata, planned, overwrite)
