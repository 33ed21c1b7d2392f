"""gates.yaml's storage sections: the storage under test, the inventory it must have, fio's settings and G1's
sweep for the storage's best, and G2's model loading and checkpoint saving on it. Composed by gates/config.py."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence, Union, get_args

from pydantic import Field, PlainValidator, field_validator, model_validator

from cache_impl.weights.loaders import KVGATE_CHUNK_BYTES, KVGATE_READ_ALIGN, LoaderReads
from cache_impl.weights.safetensors_dir import CheckpointFormatError, read_safetensors_dir
from kvcore.loader_names import KVGATE_LOADER, LOADERS, LoaderName
from kvcore.sampling import PairsConfig
from kvcore.settings import (
    MAX_BYTES,
    MAX_COUNT,
    Count,
    Float,
    Int,
    Positive,
    StrictModel,
    absolute_path,
    each_once,
    parse_size,
    positive_size,
)
from workloads.storage.checkpoint import KVGATE_WRITER, STATE_PRESETS, CheckpointSpec, WriterName
from workloads.storage.checkpoint import WRITERS as CHECKPOINT_WRITERS
from workloads.storage.fio_sweep import SweepGrid

IOMode = Literal["direct", "buffered"]
IO_MODES: tuple[IOMode, ...] = get_args(IOMode)
IOEngine = Literal["libaio", "io_uring"]
IO_ENGINES: tuple[IOEngine, ...] = get_args(IOEngine)


class StorageConfig(StrictModel):
    path: Path = Field(default=Path("kvgate-storage"), description="the storage under test (fio, disk tier); "
                       "a relative path is taken from the directory kvgate runs in and stored absolute")

    # absolute now: the gate suites run in another directory and must measure the same storage
    _absolute = field_validator("path", mode="before")(lambda cls, v: absolute_path(v))


class InventoryConfig(StrictModel):
    min_cpu_cores: Optional[Count] = Field(default=None, ge=1, description="CPU cores at least")
    min_memory_gib: Optional[Float] = Field(default=None, gt=0, le=MAX_BYTES / 2**30, description="memory, GiB")
    min_free_gib: Optional[Float] = Field(default=None, gt=0, le=MAX_BYTES / 2**30, description="free space at "
                                          "storage.path")
    min_gpus: Optional[Count] = Field(default=None, ge=0, description="GPUs at least", examples=[8])
    min_nics: Optional[Count] = Field(default=None, ge=0, description="network interfaces at least", examples=[2])
    rdma_required: bool = Field(default=False, description="an RDMA device must be present")


class FioSweepConfig(StrictModel):
    """G1's storage sweep (workloads/storage/fio_sweep.py): the storage's best sequential read and fsync'd write,
    the yardstick G2's cold read, model loaders and checkpoint are judged against. Direct reads run every
    (read_bs, ioengine, iodepth, numjobs); buffered reads every (read_bs, numjobs), psync at depth 1;
    writes every (write_bs, write_numjobs, write_modes), fsync'd at the end."""

    read_bs: list[str] = Field(default_factory=lambda: ["1M", "4M", "16M"], min_length=1,
                               description="request sizes of the read points")
    iodepths: list[Positive] = Field(default_factory=lambda: [1, 4, 16, 32], min_length=1,
                                     description="queue depths of the direct read points")
    numjobs: list[Annotated[Int, Field(ge=1, le=64)]] = Field(default_factory=lambda: [1, 4], min_length=1,
                                                               description="parallel jobs of the read points")
    modes: list[IOMode] = Field(default_factory=lambda: list(IO_MODES), min_length=1,
                                description="direct; buffered with invalidate=1")
    ioengines: list[IOEngine] = Field(
        default_factory=lambda: list(IO_ENGINES), min_length=1,
        description="engines of the direct read points (one the host lacks is probed and left out)")
    write_bs: list[str] = Field(default_factory=lambda: ["1M", "4M", "16M"], min_length=1,
                                description="request sizes of the fsync'd sequential write points (end_fsync=1)")
    write_numjobs: list[Annotated[Int, Field(ge=1, le=64)]] = Field(default_factory=lambda: [1, 4], min_length=1,
                                                                     description="parallel jobs of the write points")
    write_modes: list[IOMode] = Field(default_factory=lambda: list(IO_MODES), min_length=1,
                                      description="direct; buffered (end_fsync=1)")
    size: str = Field(default="4G", description="bytes each point moves (its jobs a share each)")
    runtime_s: Float = Field(default=5.0, gt=0, description="the most seconds a point runs")

    _sizes = field_validator("size", mode="before")(lambda cls, v: positive_size(v))
    _lists = field_validator("read_bs", "iodepths", "numjobs", "modes", "ioengines", "write_bs", "write_numjobs",
                             "write_modes")(lambda cls, v: each_once(v))

    @field_validator("read_bs", "write_bs", mode="before")
    @classmethod
    def _block_sizes(cls, values: Any) -> Any:
        if isinstance(values, list):
            return [positive_size(v) if isinstance(v, str) else v for v in values]
        return values

    @model_validator(mode="after")
    def _blocks_fit_the_size(self) -> "FioSweepConfig":
        largest = max(parse_size(bs) for bs in self.read_bs + self.write_bs)
        if largest > parse_size(self.size):
            raise ValueError(f"size: expected at least the largest request size ({largest} bytes), found {self.size!r}")
        return self

    def grid(self):
        """The sweep as workloads.storage.fio_sweep runs it."""
        return SweepGrid(read_bs=tuple(self.read_bs), iodepths=tuple(self.iodepths), numjobs=tuple(self.numjobs),
                         modes=tuple(self.modes), ioengines=tuple(self.ioengines), write_bs=tuple(self.write_bs),
                         write_numjobs=tuple(self.write_numjobs), write_modes=tuple(self.write_modes),
                         size=self.size, runtime_s=self.runtime_s)


class FioConfig(StrictModel):
    size: str = Field(default="256M", description="bytes each job moves")
    runtime_s: Float = Field(default=5.0, gt=0, description="the most seconds a job runs")
    iodepth: Count = Field(default=16, ge=1, description="queue depth")
    numjobs: Count = Field(default=1, ge=1, description="parallel jobs")
    direct: bool = Field(default=True, description="O_DIRECT (no page cache)")
    ioengine: str = Field(default="libaio", pattern=r"^[a-z][a-z0-9_]*$", description="an fio ioengine name")
    verify: bool = Field(default=True, description="a crc32c write and verify pass")
    verify_size: str = Field(default="64M", description="bytes the verify pass writes and checks")
    sweep: FioSweepConfig = Field(default_factory=FioSweepConfig, description=(
        "G1's sweep for the storage's best sequential read and fsync'd write (G2's yardstick)"))

    _sizes = field_validator("size", "verify_size", mode="before")(lambda cls, v: positive_size(v))


LOADER_NAMES = LOADERS


# workloads/storage/checkpoint.py's presets as a model size is written: 8B, 32B, 70B, 405B, 1T, adapter
STATE_PRESET_NAMES = tuple(name.upper() if name[0].isdigit() else name for name in STATE_PRESETS)


def _command(value: Any) -> Any:
    """A start command as argv: a list of strings, or one string split as a shell would (no shell runs it)."""
    if isinstance(value, str):
        value = shlex.split(value)
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"expected a command (a string or a list of non-empty strings), found {value!r}")
    return value


def _judged_among(judged: str, measured: Sequence[str], noun: str) -> None:
    """The judged path (a loader, a checkpoint writer) is one of those measured."""
    if judged not in measured:
        raise ValueError(f"judged: expected one of the {noun}s measured ({', '.join(measured)}), found {judged!r} "
                         f"(add it to {noun}s, or name the {noun} to judge)")


class ModelLoadConfig(StrictModel):
    """G2's model service loading: a safetensors checkpoint read cold by each loader, beside fio reading
    the same files, and (embedded or `launch`) a server's start to its first token."""

    enabled: bool = Field(default=True, description="run it")
    path: Optional[Path] = Field(
        examples=["/models/DeepSeek-R1-Distill-Llama-70B"], default=None, description=(
            "an existing model directory (safetensors shards, read only, never written); null: a random checkpoint "
            "of `size` is written under storage.path"))
    size: str = Field(default="1GiB", description="the random checkpoint's size (without `path`)")
    shard_size: str = Field(default="256MiB", description="the random checkpoint's shard size")
    loaders: list[LoaderName] = Field(default_factory=lambda: list(LOADER_NAMES), min_length=1,
        description="the loaders measured, each beside the storage's best read job; those not judged are shown as "
                    "how much of the storage they use")
    judged: LoaderName = Field(default=KVGATE_LOADER, description=(
        "the loader whose ratio is judged: kvgate (its own path, at the storage's best: the storage is judged), "
        "or a field loader (a joint test of one serving stack's loader)"))
    parallel: Int = Field(default=16, ge=1, le=256, description="reads in flight of kvgate's loader and read "
                          "threads of the streaming loaders")
    read_size: str = Field(default=f"{KVGATE_CHUNK_BYTES >> 20}MiB", examples=["128KiB"], description=(
        "bytes per read of kvgate's loader (a multiple of 4 KiB, as O_DIRECT takes): with `parallel`, what it "
        "keeps in flight"))
    rounds: PairsConfig = Field(default_factory=PairsConfig, description=(
        "cold rounds, every loader once per round, each load beside the storage's best read job reading the same "
        "files; taken until the judged loader's interval decides"))
    baseline_path: Optional[Path] = Field(examples=["/mnt/nfs/kvgate"], default=None, description=(
        "a directory on the baseline storage (e.g. the NFS mount the vendor compares with): with `path`, the same "
        "model there; without, the random checkpoint is written there too. Unset: the speedup is not run"))
    service: bool = Field(default=True, description="embedded: time `kvgate serve --weights` per loader, start to "
                          "first token")
    launch: Optional[list[str]] = Field(
        examples=["vllm serve /models/x --load-format runai_streamer"], default=None, description=(
            "external: the engine's own start command, timed start → health_url ready → first token"))
    health_url: Optional[str] = Field(default=None, pattern=r"^https?://", description=(
        "with launch: the URL that answers when the engine is ready"), examples=["http://127.0.0.1:8000/health"])

    _sizes = field_validator("size", "shard_size", mode="before")(lambda cls, v: positive_size(v))

    @property
    def reads(self) -> LoaderReads:
        """How the loaders read (`parallel`, `read_size`)."""
        return LoaderReads(self.parallel, parse_size(self.read_size))

    @field_validator("read_size", mode="before")
    @classmethod
    def _whole_pages(cls, value: Any) -> Any:
        if parse_size(positive_size(value)) % KVGATE_READ_ALIGN:
            raise ValueError(f"expected a multiple of {KVGATE_READ_ALIGN} bytes (O_DIRECT's alignment), "
                             f"found {value!r}")
        return value
    _paths = field_validator("path", "baseline_path", mode="before")(lambda cls, v: absolute_path(v))
    _argv = field_validator("launch", mode="before")(lambda cls, v: None if v is None else _command(v))

    @field_validator("path")
    @classmethod
    def _a_checkpoint(cls, path: Optional[Path]) -> Optional[Path]:
        """An existing safetensors checkpoint, its headers read now (cache_impl.weights.safetensors_dir), not at G2."""
        if path is not None:
            try:
                read_safetensors_dir(path)
            except CheckpointFormatError as error:
                raise ValueError(str(error)) from None
        return path

    _loaders_once = field_validator("loaders")(lambda cls, v: each_once(v, "loader"))

    @model_validator(mode="after")
    def _judged_is_measured(self) -> "ModelLoadConfig":
        _judged_among(self.judged, self.loaders, "loader")
        return self

    @model_validator(mode="after")
    def _launch_with_health(self) -> "ModelLoadConfig":
        if (self.launch is None) != (self.health_url is None):
            raise ValueError(
                "launch and health_url: expected both (the start command and the URL that answers "
                f"when it is ready) or neither, found launch={self.launch!r} health_url={self.health_url!r}"
            )
        return self


def _parameters(value: Any) -> Any:
    """A checkpoint's parameters as given: a count in 1..MAX_COUNT, or a model size's name (STATE_PRESET_NAMES)."""
    if value in STATE_PRESET_NAMES or (type(value) is int and 1 <= value <= MAX_COUNT):
        return value
    raise ValueError(f"expected a parameter count (an integer in 1..{MAX_COUNT}) or a model size "
                     f"({', '.join(STATE_PRESET_NAMES)}), found {value!r}")


Parameters = Annotated[Union[str, int], PlainValidator(_parameters)]


class CheckpointConfig(StrictModel):
    """G2's checkpoint saving: torch.distributed.checkpoint with `ranks` gloo processes saving model +
    optimizer state, beside fio writing as many bytes; then restored cold."""

    enabled: bool = Field(default=True, description="run it")
    ranks: Int = Field(default=2, ge=1, le=64, description="training ranks, one process each (gloo)")
    parameters: Parameters = Field(default=20_000_000,
        description="parameters of the saved state: a count, or a model size of MLPerf Storage's checkpoint "
                    "workload (8B, 70B, 405B, 1T), 32B (the vendor's 8-rank job) or adapter (a LoRA adapter)")
    bytes_per_parameter: Float = Field(default=14.0, ge=2, le=64, description=(
        "bytes of state per parameter: 14 is bf16 weights + fp32 master weights + Adam's two moments"))
    thread_count: Int = Field(default=1, ge=1, le=64, description="each rank's write threads (files written at once)")
    writers: list[WriterName] = Field(
        default_factory=lambda: list(CHECKPOINT_WRITERS), min_length=1, description=(
            "the writers measured, each save beside the storage's best fsync'd write job: kvgate (its own: DCP's "
            "planner and metadata, aligned O_DIRECT writes from huge pages, parallel) and dcp (DCP's "
            "FileSystemWriter); those not judged are shown as how much of the storage they use"))
    judged: WriterName = Field(default=KVGATE_WRITER, description=(
        "the writer whose ratio is judged: kvgate (the storage is judged), or dcp (a joint test of DCP's own "
        "writer); its checkpoint is restored by each reader"))
    rounds: PairsConfig = Field(default_factory=PairsConfig, description=(
        "saves (after two warm-up saves of each writer), each beside the storage's best fsync'd write job writing "
        "as many bytes; taken until the judged writer's interval decides"))
    restores: Count = Field(default=3, ge=1, description="cold restores of the last save, each checked bit for bit")
    baseline_path: Optional[Path] = Field(examples=["/mnt/nfs/kvgate-ckpt"], default=None, description=(
        "a directory on the baseline storage: the speedup of the storage under test over it. Unset: not run"))

    _paths = field_validator("baseline_path", mode="before")(lambda cls, v: absolute_path(v))

    _writers_once = field_validator("writers")(lambda cls, v: each_once(v, "writer"))

    @model_validator(mode="after")
    def _judged_is_measured(self) -> "CheckpointConfig":
        _judged_among(self.judged, self.writers, "writer")
        return self

    def spec(self) -> CheckpointSpec:
        """The state the ranks save: `parameters` (a count, or a preset's) at `bytes_per_parameter`."""
        if isinstance(self.parameters, str):
            return CheckpointSpec.from_preset(self.parameters.lower(), bytes_per_parameter=self.bytes_per_parameter,
                                              ranks=self.ranks)
        return CheckpointSpec(parameters=self.parameters, bytes_per_parameter=self.bytes_per_parameter,
                              ranks=self.ranks)
