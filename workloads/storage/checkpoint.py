"""Checkpoint save and restore the way training does it: `torch.distributed.checkpoint` from N ranks.

How it works: docs/methods/storage-best.md (workloads/storage/checkpoint.py).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence, get_args

from kvcore.files import drop_cached_pages, fsync_directory
from kvcore.settings import ConfigError
from workloads.storage.rank_group import RankFailure, RankGroup

METADATA_NAME = ".metadata"
METADATA_TEMP_NAME = ".metadata.tmp"
WEIGHT_BYTES = 2             # bf16 weights
OPTIMIZER_FIELDS = ("master", "exp_avg", "exp_avg_sq")   # fp32, 4 B each at 14 B per parameter
MLPERF_BYTES_PER_PARAMETER = 14.0
AGREEMENT_TOLERANCE = 0.05   # MLPerf Storage: repeated runs agree within 5%
# The paths a save and a restore take: kvgate's own (workloads/storage/checkpoint_kvgate.py: DCP's planner and
# metadata, aligned O_DIRECT I/O in huge pages, parallel) and DCP's FileSystemWriter / FileSystemReader.
WriterName = Literal["kvgate", "dcp"]
KVGATE_WRITER: WriterName = "kvgate"
WRITERS: tuple[WriterName, ...] = get_args(WriterName)
READERS = WRITERS
READER_OF = {"kvgate": "kvgate", "dcp": "dcp"}        # the reader of a writer's own kind
WRITER_NAMES = {"kvgate": "kvgate's writer", "dcp": "DCP's FileSystemWriter"}

# Parameter counts. MLPerf Storage v2.0's checkpoint workload (DLIO's llama_*.yaml) models Llama 3
# 8B/70B/405B and a 1T model; the counts are those architectures' (untied embeddings, GQA):
#   8B: 32 layers, hidden 4096, ffn 14336, 8 KV heads, vocab 128256 -> 8,030,261,248
#   70B: 80 layers, hidden 8192, ffn 28672                            -> 70,553,706,496
#   405B: 126 layers, hidden 16384, ffn 53248                         -> 405,853,388,800
#   1T: DLIO's llama_1t.yaml (128 layers, hidden 25872, ffn 98304, 32 KV heads = full MHA) -> 1.326e12
# "adapter": LoRA rank 16 on every linear layer (q, k, v, o, gate, up, down) of a 32B model of
# Qwen2.5-32B's shape (the base of DeepSeek-R1-Distill-Qwen-32B: 64 layers, hidden 5120, ffn
# 27648, 8 KV heads of 128): 64 x 16 x (2x10240 + 2x6144 + 3x32768) = 134,217,728 trainable
# parameters (0.41% of 32.8B), what PEFT prints for that configuration; with Adam state, 1.9 GB.
STATE_PRESETS: dict[str, int] = {
    "8b": 8_030_261_248,
    # "32b": the vendor's 8-GPU 32B job, a model of Qwen2.5-32B's shape (64 layers, hidden 5120, ffn 27648,
    # 8 KV heads of 128, qkv biases, vocab 152064 untied) -> 32,763,876,352
    "32b": 32_763_876_352,
    "70b": 70_553_706_496,
    "405b": 405_853_388_800,
    "1t": 1_325_990_941_968,
    "adapter": 134_217_728,
}
DEFAULT_TENSOR_BYTES = 64 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint round could not be run (a bad directory, ranks that are gone)."""


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a rank's state: where it sits in the state dict, its dtype and element count."""

    path: tuple[str, ...]   # ("model", "rank0_block3", "weight"), ("optimizer", "rank0_block3", "exp_avg")
    dtype: str              # "bfloat16" | "float32"
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * (2 if self.dtype == "bfloat16" else 4)

    @property
    def fqn(self) -> str:
        return ".".join(self.path)


@dataclass(frozen=True)
class CheckpointSpec:
    """The training state to checkpoint: `parameters` in all, `ranks` data-parallel shards of it.

    Each parameter is a bf16 weight (2 B) plus optimizer state held as three fp32 tensors (master
    weights, exp_avg, exp_avg_sq) of `bytes_per_parameter - 2` bytes per parameter in all: 12 B at
    the default 14 (one fp32 value each); another figure scales the three tensors' lengths alike
    (e.g. 8 gives each of them half as many elements as the weights; 2 is weights only). Each rank
    holds parameters / ranks (the first `parameters % ranks` one more) in blocks whose largest
    tensor has at most `tensor_bytes`, under keys of its own (`rank1_block0`), so each rank writes
    its own shard, as FSDP's ranks do. `seed` fixes every value.
    """

    parameters: int
    bytes_per_parameter: float = MLPERF_BYTES_PER_PARAMETER
    ranks: int = 2
    seed: int = 0
    tensor_bytes: int = DEFAULT_TENSOR_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"checkpoint.ranks: expected an integer >= 1, found {self.ranks!r}")
        if isinstance(self.parameters, bool) or not isinstance(self.parameters, int) or self.parameters < self.ranks:
            raise ConfigError(f"checkpoint.parameters: expected an integer >= ranks ({self.ranks}), "
                              f"found {self.parameters!r}")
        bpp = self.bytes_per_parameter
        if isinstance(bpp, bool) or not isinstance(bpp, (int, float)) or not math.isfinite(bpp) or bpp < WEIGHT_BYTES:
            raise ConfigError(f"checkpoint.bytes_per_parameter: expected a number >= {WEIGHT_BYTES} "
                              f"(bf16 weights), found {bpp!r}")
        if isinstance(self.tensor_bytes, bool) or not isinstance(self.tensor_bytes, int) or self.tensor_bytes < 4:
            raise ConfigError(f"checkpoint.tensor_bytes: expected an integer >= 4, found {self.tensor_bytes!r}")

    @classmethod
    def from_preset(cls, name: str, **fields) -> "CheckpointSpec":
        """A spec of one of STATE_PRESETS' parameter counts ('8b', '32b', '70b', '405b', '1t', 'adapter')."""
        if name not in STATE_PRESETS:
            raise ConfigError(f"checkpoint.preset: expected one of {', '.join(map(repr, STATE_PRESETS))}, "
                              f"found {name!r}")
        return cls(parameters=STATE_PRESETS[name], **fields)

    @classmethod
    def for_state_bytes(cls, nbytes: int, bytes_per_parameter: float = MLPERF_BYTES_PER_PARAMETER,
                        **fields) -> "CheckpointSpec":
        """A spec of about `nbytes` of state in all (the quick profile's ~0.5 GiB)."""
        if isinstance(bytes_per_parameter, (int, float)) and bytes_per_parameter >= WEIGHT_BYTES:
            parameters = int(nbytes // bytes_per_parameter)
        else:
            parameters = 0   # __post_init__ names the bad field
        return cls(parameters=max(parameters, 1), bytes_per_parameter=bytes_per_parameter, **fields)

    @property
    def optimizer_fraction(self) -> float:
        """Elements of each fp32 optimizer tensor per weight element (1.0 at 14 B per parameter)."""
        return (self.bytes_per_parameter - WEIGHT_BYTES) / (4 * len(OPTIMIZER_FIELDS))

    def rank_parameters(self, rank: int) -> int:
        base, extra = divmod(self.parameters, self.ranks)
        return base + (1 if rank < extra else 0)

    def block_parameters(self) -> int:
        """Parameters per block: as many as keep the block's widest tensor within tensor_bytes."""
        widest = max(WEIGHT_BYTES, 4 * self.optimizer_fraction)
        return max(1, int(self.tensor_bytes // widest))

    def rank_tensors(self, rank: int) -> list[TensorPlan]:
        """The tensors rank `rank` holds, in state-dict order."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank: expected 0..{self.ranks - 1}, found {rank}")
        tensors: list[TensorPlan] = []
        left, per_block, block = self.rank_parameters(rank), self.block_parameters(), 0
        while left > 0:
            count = min(left, per_block)
            name = f"rank{rank}_block{block}"
            tensors.append(TensorPlan(("model", name, "weight"), "bfloat16", count))
            optimizer_numel = round(count * self.optimizer_fraction)
            if optimizer_numel:
                tensors += [TensorPlan(("optimizer", name, f), "float32", optimizer_numel) for f in OPTIMIZER_FIELDS]
            left, block = left - count, block + 1
        return tensors

    def rank_bytes(self, rank: int) -> int:
        return sum(t.nbytes for t in self.rank_tensors(rank))

    @property
    def total_bytes(self) -> int:
        """Bytes of state over all ranks (the tensors' payload; the files add a little framing).
        Computed without listing the tensors, so a 1T preset costs nothing."""
        total = 0
        for rank in range(self.ranks):
            blocks, last = divmod(self.rank_parameters(rank), self.block_parameters())
            for count, times in ((self.block_parameters(), blocks), (last, 1 if last else 0)):
                per_block = count * WEIGHT_BYTES + 4 * len(OPTIMIZER_FIELDS) * round(count * self.optimizer_fraction)
                total += per_block * times
        return total

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CheckpointSpec":
        return cls(**json.loads(text))


class _RankRound:
    """What a save and a restore share: each rank's seconds, the round's time (the slowest rank's: the
    checkpoint is done, or training resumes, when the last rank is) and its GB/s (1e9 bytes per GB)."""

    rank_seconds: tuple[float, ...]
    nbytes: int
    ok: bool

    @property
    def seconds(self) -> float:
        return max(self.rank_seconds)

    @property
    def gbps(self) -> float:
        """Sustained bandwidth: bytes / the slowest rank's seconds."""
        return self.nbytes / self.seconds / 1e9 if self.ok and self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SaveRound(_RankRound):
    """One save: each rank's seconds, the files written and their bytes; judged by the slowest rank."""

    directory: str
    rank_seconds: tuple[float, ...]
    nbytes: int
    files: tuple[str, ...]
    ok: bool
    error: Optional[str] = None
    writer: str = KVGATE_WRITER
    direct: bool = False             # every rank's files were written O_DIRECT (kvgate's writer)

    def context(self) -> dict:
        return {"directory": self.directory, "ok": self.ok, "error": self.error, "bytes": self.nbytes,
                "seconds": self.seconds, "gbps": self.gbps, "rank_seconds": list(self.rank_seconds),
                "files": len(self.files), "writer": self.writer, "direct": self.direct}


@dataclass(frozen=True)
class RestoreRound(_RankRound):
    """One restore into fresh tensors, the pages dropped first: seconds, device bytes read, equality."""

    directory: str
    rank_seconds: tuple[float, ...]
    rank_read_bytes: tuple[int, ...]
    nbytes: int
    equal: bool
    ok: bool
    error: Optional[str] = None
    differences: tuple[str, ...] = field(default=())
    reader: str = KVGATE_WRITER

    @property
    def read_bytes(self) -> int:
        """Bytes the ranks read from the device during the load (/proc/PID/io read_bytes growth)."""
        return sum(self.rank_read_bytes)

    @property
    def cold(self) -> bool:
        """The device reads covered the checkpoint: the restore did not come from the page cache."""
        return self.ok and self.read_bytes >= self.nbytes

    def context(self) -> dict:
        return {"directory": self.directory, "ok": self.ok, "error": self.error, "equal": self.equal,
                "cold": self.cold, "bytes": self.nbytes, "read_bytes": self.read_bytes, "seconds": self.seconds,
                "gbps": self.gbps, "rank_seconds": list(self.rank_seconds),
                "rank_read_bytes": list(self.rank_read_bytes), "differences": list(self.differences),
                "reader": self.reader}


def checkpoint_files(directory: Path) -> list[Path]:
    """The regular files of a checkpoint directory, sorted (DCP writes them flat)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())


def looks_complete(directory: Path) -> bool:
    """Whether the directory holds a finished DCP checkpoint: its `.metadata` reads (with DCP's own
    reader) and every file it names is present and long enough for the items it places there."""
    directory = Path(directory)
    if not (directory / METADATA_NAME).is_file():
        return False
    # deferred: torch (seconds), only to read a checkpoint back
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception:
        return False
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in needed.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size < length:
            return False
    return bool(needed)


def spread(values: Sequence[float]) -> float:
    """How far repeated rounds disagree: (max - min) / median (0.0 for one round)."""
    values = list(values)
    if not values:
        raise ValueError("spread: expected at least one value, found none")
    middle = statistics.median(values)
    if middle <= 0:
        return math.inf
    return (max(values) - min(values)) / middle


def rounds_agree(values: Sequence[float], tolerance: float = AGREEMENT_TOLERANCE) -> bool:
    """MLPerf Storage's rule that repeated runs agree within 5%, read as: every round lies within the
    tolerance of every other, relative to the median ((max - min) / median <= tolerance)."""
    return spread(values) <= tolerance


def describe_failures(answers: Sequence[dict]) -> str:
    """'rank 1: [Errno 28] No space left on device' for each rank that reported its own failure."""
    failures: dict[int, str] = {}
    for rank, answer in enumerate(answers):             # a rank's own account of its failure first
        own = (answer.get("failures") or {}).get(str(rank))
        if own:
            failures[rank] = own
    for answer in answers:                              # then what the others heard of the rest
        for rank, message in (answer.get("failures") or {}).items():
            failures.setdefault(int(rank), message)
    if not failures:
        return "failed without a reason from any rank"
    return "; ".join(f"rank {rank}: {failures[rank]}" for rank in sorted(failures))


class CheckpointJob:
    """`spec.ranks` rank processes holding the spec's state, saving and restoring it in rounds.

    Use as a context manager (`with CheckpointJob(spec) as job:`). `thread_count` is DCP's writer
    threads per rank; `round_timeout_s` bounds one save or restore (a rank silent that long is a
    RankFailure), `start_timeout_s` the start (process group, state built).
    """

    def __init__(self, spec: CheckpointSpec, thread_count: int = 1, round_timeout_s: float = 600.0,
                 start_timeout_s: float = 120.0) -> None:
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"checkpoint.thread_count: expected an integer >= 1, found {thread_count!r}")
        self.spec, self.thread_count, self.round_timeout_s = spec, thread_count, round_timeout_s
        self._group = RankGroup("workloads.storage.checkpoint_rank",
                                ["--spec", spec.to_json(), "--collective-timeout-s", str(round_timeout_s)],
                                spec.ranks)
        try:
            self.ranks = self._group.ask(None, "start-up (process group, building the state)", start_timeout_s)
        except RankFailure:
            self._group.remove_logs()
            raise

    def __enter__(self) -> "CheckpointJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return self._group.pids

    @property
    def device(self) -> str:
        return str(self.ranks[0].get("device", "cpu"))

    def save(self, directory: Path, timeout_s: Optional[float] = None, writer: str = KVGATE_WRITER) -> SaveRound:
        """Save the state into `directory` (absent or empty: a checkpoint of its own) from every rank, with
        `writer` (WRITERS: kvgate's own or DCP's FileSystemWriter)."""
        if writer not in WRITERS:
            raise ValueError(f"writer: expected one of {', '.join(WRITERS)}, found {writer!r}")
        directory = Path(directory)
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise CheckpointError(f"{directory}: expected an absent or empty directory for a new checkpoint, "
                                  f"found {'a file' if not directory.is_dir() else 'entries in it'}")
        directory.mkdir(parents=True, exist_ok=True)
        try:
            answers = self._group.ask({"cmd": "save", "directory": str(directory), "thread_count": self.thread_count,
                                       "writer": writer}, f"save into {directory}", timeout_s or self.round_timeout_s)
        except RankFailure:
            self._unpublish(directory)     # a rank died mid-save: whatever rank 0 published is not vouched for
            raise
        ok = all(a.get("ok") for a in answers)
        error = None if ok else describe_failures(answers)
        if ok and not (directory / METADATA_NAME).is_file():
            ok, error = False, f"every rank finished, yet {directory / METADATA_NAME} is missing"
        if not ok:
            self._unpublish(directory)
        files = checkpoint_files(directory)
        return SaveRound(str(directory), tuple(float(a.get("seconds", 0.0)) for a in answers),
                         sum(p.stat().st_size for p in files), tuple(p.name for p in files), ok, error, writer,
                         all(a.get("direct") for a in answers))

    @staticmethod
    def _unpublish(directory: Path) -> None:
        """A failed save must not look complete: no `.metadata`, no half-written `.metadata.tmp`."""
        for name in (METADATA_NAME, METADATA_TEMP_NAME):
            (directory / name).unlink(missing_ok=True)
        fsync_directory(directory)

    def restore(self, directory: Path, timeout_s: Optional[float] = None, reader: str = KVGATE_WRITER) -> RestoreRound:
        """Load the checkpoint in `directory` on every rank into fresh tensors with `reader` (READERS), its pages
        dropped first, and compare with the state the rank holds."""
        if reader not in READERS:
            raise ValueError(f"reader: expected one of {', '.join(READERS)}, found {reader!r}")
        directory = Path(directory)
        files = checkpoint_files(directory)
        nbytes = sum(p.stat().st_size for p in files)
        if not looks_complete(directory):
            return RestoreRound(str(directory), (0.0,), (0,), nbytes, False, False,
                                f"{directory}: not a complete checkpoint (no readable {METADATA_NAME}, "
                                f"or a file it names is missing or short)", reader=reader)
        drop_cached_pages(files)
        answers = self._group.ask({"cmd": "restore", "directory": str(directory), "reader": reader},
                                  f"restore from {directory}", timeout_s or self.round_timeout_s)
        ok = all(a.get("ok") for a in answers)
        differences = tuple(d for a in answers for d in (a.get("differences") or []))
        return RestoreRound(str(directory), tuple(float(a.get("seconds", 0.0)) for a in answers),
                            tuple(int(a.get("read_bytes", 0)) for a in answers), nbytes,
                            ok and not differences, ok, None if ok else describe_failures(answers), differences,
                            reader)

    def close(self) -> None:
        """Let the ranks leave the process group and exit; kill any that do not."""
        self._group.close({"cmd": "exit"})
        self._group.remove_logs()
