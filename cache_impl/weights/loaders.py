"""Model loaders from the field, measured the same way: phases, bytes, and whether the load was cold.

How it works: docs/methods/storage-best.md (cache_impl/weights/loaders.py).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from cache_impl.weights.safetensors_dir import (
    CheckpointFormatError,
    SafetensorsDir,
    file_checksums,
    read_safetensors_dir,
    tensor_checksum,
    write_safetensors_dir,
)
from kvcore.files import process_read_bytes
from kvcore.loader_names import LOADERS

if TYPE_CHECKING:
    import torch

PHASES = ("open", "read", "deserialize", "copy")
PACKAGES = {"kvgate": "kvgate", "safetensors": "safetensors", "runai_streamer": "runai-model-streamer",
            "fastsafetensors": "fastsafetensors"}
COLD_FRACTION = 0.9        # a load whose device reads cover this share of its bytes read the device
DEFAULT_CONCURRENCY = 16   # vLLM's default for the Run:ai streamer
# kvgate's loader: bytes per read, one huge page; with `concurrency` (16) of them in flight it reads as fio's best
# job here (1 MiB requests at queue depth 32); 16 MiB reads by 16 threads reached 0.6-0.7 of it
KVGATE_CHUNK_BYTES = 2 << 20
KVGATE_READ_ALIGN = 4096   # its reads are O_DIRECT where the filesystem takes it: sizes in whole pages


@dataclass(frozen=True)
class LoaderReads:
    """How the loaders read: `parallel` reads in flight (the streaming loaders' read threads); kvgate's loader
    reads `read_bytes` at a time (the field's loaders choose their own sizes)."""

    parallel: int = DEFAULT_CONCURRENCY
    read_bytes: int = KVGATE_CHUNK_BYTES


TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
                "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass
class LoadResult:
    """One load: seconds per phase (`folded`: phase -> the phase holding its time), the tensors' bytes,
    what the process read from storage meanwhile, and the loaded tensors."""

    loader: str
    phases: dict[str, float]
    folded: dict[str, str]
    seconds: float
    nbytes: int
    device_read_bytes: int
    concurrency: Optional[int]
    tensors: dict[str, "torch.Tensor"] = field(repr=False)

    @property
    def cold(self) -> bool:
        """The bytes came from the device (not the page cache)."""
        return self.device_read_bytes >= COLD_FRACTION * self.nbytes

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def summary(self) -> dict:
        """Everything but the tensors, for run data and /health."""
        return {"loader": self.loader, "seconds": self.seconds, "nbytes": self.nbytes, "gbps": self.gbps,
                "phases": dict(self.phases), "folded": dict(self.folded), "device_read_bytes": self.device_read_bytes,
                "cold": self.cold, "concurrency": self.concurrency}


def torch_dtype(code: str) -> "torch.dtype":
    import torch  # deferred: torch (seconds); this module is read by configs too

    return getattr(torch, TORCH_DTYPES[code])


def allocate_destinations(checkpoint: SafetensorsDir, device: Union[str, "torch.device"]) -> dict[str, "torch.Tensor"]:
    """One tensor per checkpoint tensor on `device`, written once so its memory exists before a timed load
    (an engine's parameters are allocated and placed before it loads them)."""
    import torch  # deferred: torch (seconds); this module is read by configs too

    return {name: torch.zeros(entry.shape, dtype=torch_dtype(entry.dtype), device=device)
            for name, entry in checkpoint.tensors.items()}


def check_destinations(checkpoint: SafetensorsDir, destinations: dict[str, "torch.Tensor"], expected_by: str) -> None:
    """Every destination has a tensor of its name, shape and dtype in the checkpoint, and nothing is left
    over; else a CheckpointFormatError naming the file and tensor (`expected_by`: whose shapes, e.g. the preset)."""
    for name, target in destinations.items():
        entry = checkpoint.tensors.get(name)
        found_dtype = TORCH_DTYPES.get(entry.dtype) if entry else None
        wanted_dtype = str(target.dtype).removeprefix("torch.")
        if entry is None:
            raise CheckpointFormatError(f"{checkpoint.path}: tensor {name}: expected it ({expected_by}), found no "
                                        f"such tensor in the checkpoint")
        if list(entry.shape) != list(target.shape) or found_dtype != wanted_dtype:
            raise CheckpointFormatError(f"{entry.file}: tensor {name}: expected {wanted_dtype} {list(target.shape)} "
                                        f"({expected_by}), found {found_dtype} {list(entry.shape)}")
    extra = sorted(set(checkpoint.tensors) - set(destinations))
    if extra:
        entry = checkpoint.tensors[extra[0]]
        raise CheckpointFormatError(f"{entry.file}: tensor {entry.name}: expected only the tensors {expected_by} "
                                    f"has, found this one too ({len(extra)} extra)")


def load_checkpoint(checkpoint: SafetensorsDir, loader: str, device: Union[str, "torch.device"] = "cpu",
                    destinations: Optional[dict[str, "torch.Tensor"]] = None,
                    concurrency: int = DEFAULT_CONCURRENCY, read_bytes: int = KVGATE_CHUNK_BYTES) -> LoadResult:
    """Load every tensor of `checkpoint` with `loader` into `destinations` (default: fresh tensors on
    `device`, allocated before the clock starts) and time it by phase. The caller drops pages first
    for a cold load. `read_bytes`: kvgate's loader's bytes per read (the field's loaders choose their own)."""
    if loader not in LOADERS:
        raise ValueError(f"loader: expected one of {', '.join(LOADERS)}, found {loader!r}")
    if destinations is None:
        destinations = allocate_destinations(checkpoint, device)
    else:
        check_destinations(checkpoint, destinations, "the destination tensors")
    runs: dict[str, Callable[[SafetensorsDir, dict, _PhaseClock, int], dict[str, str]]] = {
        "kvgate": functools.partial(_load_kvgate, read_bytes=read_bytes), "safetensors": _load_safetensors,
        "runai_streamer": _load_runai_streamer, "fastsafetensors": _load_fastsafetensors}
    run = runs[loader]
    clock = _PhaseClock()
    read_before = process_read_bytes()
    start = time.perf_counter()
    try:
        folded = run(checkpoint, destinations, clock, concurrency)
    except (ImportError, CheckpointFormatError):
        raise
    except Exception as error:  # the files passed our checks; a loader that still fails says so in one line
        raise CheckpointFormatError(
            f"{checkpoint.path}: expected {loader} to load it, it failed: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    _synchronize(destinations)
    seconds = time.perf_counter() - start
    read = process_read_bytes() - read_before
    return LoadResult(loader, clock.phases(), folded, seconds, checkpoint.tensor_bytes, read,
                      concurrency if loader != "safetensors" else None, destinations)


class _PhaseClock:
    """Seconds accumulated per phase: `with clock("read"): ...`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def phases(self) -> dict[str, float]:
        return dict(self.seconds)


def _synchronize(tensors: dict[str, "torch.Tensor"]) -> None:
    """Copies to a GPU are asynchronous: the load is done when they are."""
    import torch  # deferred: torch (seconds); this module is read by configs too

    first = next(iter(tensors.values()), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.synchronize(first.device)


def _load_kvgate(checkpoint: SafetensorsDir, destinations: dict, clock: _PhaseClock,
                 concurrency: int, read_bytes: int = KVGATE_CHUNK_BYTES) -> dict[str, str]:
    import torch  # deferred: torch (seconds); this module is read by configs too

    # deferred: torch (seconds), which direct_io's buffers need
    from cache_impl.weights.direct_io import Span, copy_bytes, read_spans

    with clock("open"):
        on_gpu = next(iter(destinations.values())).device.type == "cuda"
        layout = {file: _ByteLayout(checkpoint.tensors_in(file), destinations) for file in checkpoint.files}
        spans = [layout[file].span(file) for file in checkpoint.files if layout[file].entries]

    def scatter(span: Span, data: memoryview) -> None:
        for offset, target, source_start, nbytes in layout[span.path].pieces(span.offset, span.nbytes):
            if on_gpu:   # from the pinned buffer the thread read into, a DMA; the thread waits, the GIL is free
                target[offset : offset + nbytes].copy_(torch.frombuffer(data[source_start : source_start + nbytes],
                                                                        dtype=torch.uint8))
            else:
                copy_bytes(target.data_ptr() + offset, data[source_start : source_start + nbytes], nbytes)

    buffer = _pinned_buffer if on_gpu else None
    with clock("read"):
        read_spans(spans, scatter, workers=concurrency, chunk_bytes=read_bytes,
                   **({"buffer": buffer} if buffer else {}))
    return {"deserialize": "read", "copy": "read"}


def _pinned_buffer(nbytes: int) -> "torch.Tensor":
    import torch  # deferred: torch (seconds); this module is read by configs too

    from cache_impl.platform.buffers import aligned_empty  # deferred: torch (seconds)
    return aligned_empty((nbytes,), torch.uint8, "cpu", pin_memory=True)


class _ByteLayout:
    """One shard's tensors by where their bytes lie, and each destination as flat bytes."""

    def __init__(self, entries: list, destinations: dict) -> None:
        self.entries = entries
        self.starts = [entry.offset for entry in entries]
        self.targets = [_flat_bytes(destinations[entry.name]) for entry in entries]

    def span(self, file: Path):
        from cache_impl.weights.direct_io import Span  # deferred: torch (seconds), which direct_io's buffers need

        start = self.entries[0].offset
        return Span(file, start, self.entries[-1].offset + self.entries[-1].nbytes - start)

    def pieces(self, offset: int, nbytes: int):
        """(offset in the destination, destination bytes, offset in the chunk, length) of each tensor's part
        in the file's bytes [offset, offset + nbytes)."""
        end = offset + nbytes
        index = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        while index < len(self.entries) and self.entries[index].offset < end:
            entry = self.entries[index]
            lo, hi = max(offset, entry.offset), min(end, entry.offset + entry.nbytes)
            if hi > lo:
                yield lo - entry.offset, self.targets[index], lo - offset, hi - lo
            index += 1


def _flat_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    import torch  # deferred: torch (seconds); this module is read by configs too

    if not tensor.is_contiguous():
        raise CheckpointFormatError("kvgate loader: expected contiguous destination tensors")
    return tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)


def _load_safetensors(checkpoint: SafetensorsDir, destinations: dict, clock: _PhaseClock, _: int) -> dict[str, str]:
    # deferred: each loader's package only when it loads (loader_unavailable says which are missing)
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        with clock("open"):
            handles = [(file, stack.enter_context(safe_open(str(file), framework="pt"))) for file in checkpoint.files]
        for file, handle in handles:
            for entry in checkpoint.tensors_in(file):
                with clock("deserialize"):
                    tensor = handle.get_tensor(entry.name)      # a view over the mmap'd file: nothing read yet
                with clock("copy"):
                    destinations[entry.name].copy_(tensor)      # the page faults read the bytes
    return {"read": "copy"}


def _load_runai_streamer(checkpoint: SafetensorsDir, destinations: dict, clock: _PhaseClock,
                         concurrency: int) -> dict[str, str]:
    # deferred: each loader's package only when it loads (loader_unavailable says which are missing)
    from runai_model_streamer import SafetensorsStreamer

    with _environment(RUNAI_STREAMER_CONCURRENCY=str(concurrency)):
        with SafetensorsStreamer() as streamer:
            with clock("open"):
                streamer.stream_files([str(file) for file in checkpoint.files])
            tensors = iter(streamer.get_tensors())
            while True:
                with clock("read"):                             # waiting for the next tensor's bytes
                    item = next(tensors, None)
                if item is None:
                    break
                name, tensor = item
                with clock("copy"):
                    destinations[name].copy_(tensor)            # the streamer reuses its buffer: copy now
    return {"deserialize": "read"}


def _load_fastsafetensors(checkpoint: SafetensorsDir, destinations: dict, clock: _PhaseClock,
                          concurrency: int) -> dict[str, str]:
    # deferred: each loader's package only when it loads (loader_unavailable says which are missing)
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    device = next(iter(destinations.values())).device
    with clock("open"):
        loader = SafeTensorsFileLoader(SingleGroup(), str(device), nogds=True, max_threads=concurrency)
        loader.add_filenames({0: [str(file) for file in checkpoint.files]})
    try:
        with clock("read"):
            buffer = loader.copy_files_to_device()
        try:
            for name, target in destinations.items():
                with clock("deserialize"):
                    tensor = buffer.get_tensor(name)
                with clock("copy"):
                    target.copy_(tensor)
        finally:
            buffer.close()
    finally:
        loader.close()
    return {}


@contextlib.contextmanager
def _environment(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- checks


def loaded_checksums(result: LoadResult) -> dict[str, str]:
    """xxh3-64 of each loaded tensor's bytes (copied to the CPU when on a GPU)."""
    return {name: tensor_checksum(_tensor_bytes(tensor)) for name, tensor in result.tensors.items()}


def _tensor_bytes(tensor: "torch.Tensor") -> memoryview:
    import torch  # deferred: torch (seconds); this module is read by configs too

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data  # .data: numpy's stubs give ndarray __buffer__ from Python 3.12 only


def verify_loaded(result: LoadResult, checkpoint: SafetensorsDir, reference: Optional[dict[str, str]] = None) -> str:
    """Each loaded tensor's xxh3-64 against the checkpoint's sidecar, else `reference` (another load's
    `loaded_checksums`), else the files read plainly. A mismatch raises CheckpointFormatError naming the file
    and tensor. Returns what it compared against."""
    if checkpoint.checksums is not None:
        expected, source = checkpoint.checksums, "the checksum sidecar"
    elif reference is not None:
        expected, source = reference, "the reference load"
    else:
        expected, source = file_checksums(checkpoint), "the files read plainly"
    for name, entry in checkpoint.tensors.items():
        tensor = result.tensors.get(name)
        if tensor is None:
            raise CheckpointFormatError(f"{entry.file}: tensor {name}: expected it loaded by {result.loader}, found "
                                        f"it missing")
        found = tensor_checksum(_tensor_bytes(tensor))
        if found != expected.get(name):
            raise CheckpointFormatError(f"{entry.file}: tensor {name}: expected xxh3-64 {expected.get(name)} "
                                        f"({source}), the bytes {result.loader} loaded hash to {found}")
    return source


@functools.cache
def loader_unavailable(loader: str) -> Optional[str]:
    """None when `loader` imports and loads a small checkpoint on the CPU here; else why not."""
    if loader not in LOADERS:
        return f"unknown loader {loader!r} (known: {', '.join(LOADERS)})"
    try:
        _trial_load(loader)
    except ImportError as error:
        return f"{PACKAGES[loader]} does not import here ({error}); install it with python3 -m pip install " \
               f"'torch==2.13.0' {PACKAGES[loader]}"
    except Exception as error:  # a loader that imports but cannot run here: say so, do not crash the gate
        return f"{PACKAGES[loader]} imports but failed a trial load on the CPU here ({type(error).__name__}: {error})"
    return None


def _trial_load(loader: str) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-loader-trial-") as directory:
        values = bytes(range(256)) * 16
        checkpoint = write_safetensors_dir(Path(directory), [("trial.weight", "float32", [32, 32], values)], 1 << 20)
        result = load_checkpoint(checkpoint, loader, "cpu", concurrency=2)
        verify_loaded(result, read_safetensors_dir(Path(directory)))
