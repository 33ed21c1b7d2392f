"""`gates.yaml`: targets, storage, expected inventory, fio matrix, workloads, thresholds and durations.

Validated once at the edge: an unknown key or a bad value raises ConfigError
naming the field path, what was expected and what was found (the CLI exits 2).
A profile (`quick` or `full`: gates/profiles/*.yaml) supplies defaults under the file's own values.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args
from urllib.parse import urlsplit

import psutil
from pydantic import (
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from cache_impl.cache.faults import BLOCK_FAULTS, FAULT_LIMITS, IO_FAULTS
from cache_impl.engine.presets import PRESETS
from cache_impl.weights.safetensors_dir import CheckpointFormatError, read_safetensors_dir
from engines.settings import CACHE_LAYERS, ENGINES, ControlConfig, MetricMapConfig
from gates.side_by_side import Pairing
from kvcore.checks import CHECKS, check_of, configurable_metrics
from kvcore.claims import DEFAULT_CLAIMS, Claim
from kvcore.loader_names import KVGATE_LOADER, LOADERS
from kvcore.rules import Rule, parse_rule
from kvcore.settings import (
    MAX_BYTES,
    MAX_COUNT,
    ConfigError,
    ContextTokens,
    Count,
    Float,
    Int,
    StrictModel,
    format_validation_error,
    load_yaml_mapping,
    parse_size,
)
from sizing.layout import KVShape
from workloads.loadgen.steady import SteadyRule
from workloads.loadgen.sweep import pairs_at_most
from workloads.storage.checkpoint import KVGATE_WRITER, STATE_PRESETS, CheckpointSpec
from workloads.storage.checkpoint import WRITERS as CHECKPOINT_WRITERS
from workloads.storage.fio_sweep import SweepGrid
from workloads.traffic.datasets import TokenizerError, check_trace, is_tokenizer_path, load_spec, read_trace, sizer_for

from .fleet import fleet_defaults

Op = Literal[">=", "<=", ">", "<", "=="]


# A threshold {metric, op, value} or a band {metric, min, max}, parsed by kvcore.rules (the one parser).
RuleField = Annotated[Rule, PlainValidator(parse_rule), PlainSerializer(lambda rule: rule.to_dict())]


def _declared_thresholds(gate: str, rules: list[Rule]) -> list[Rule]:
    """Every threshold names a metric its gate judges (kvcore/checks.py), each metric once."""
    known = configurable_metrics(gate)
    seen: dict[str, int] = {}
    for i, rule in enumerate(rules):
        if rule.metric not in known:
            raise ValueError(f"[{i}].metric: expected one of {', '.join(known)}, found {rule.metric!r}")
        if rule.metric in seen:
            raise ValueError(f"[{i}].metric: expected each metric once, found {rule.metric!r} again "
                             f"(first at [{seen[rule.metric]}])")
        seen[rule.metric] = i
    return rules


def _thresholds_of(gate: str):
    return field_validator("thresholds")(lambda cls, rules: _declared_thresholds(gate, rules))


def _size(value: Any) -> str:
    parse_size(value)
    return value if isinstance(value, str) else str(value)


def _repeated(values: list) -> list:
    """The values that appear more than once, sorted (an "each once" check says them)."""
    return sorted({v for v in values if values.count(v) > 1})


def _absolute_path(value: Any) -> Any:
    """A directory path made absolute now (the suites run elsewhere and must read the same place)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a directory path, found an empty string")
    return Path(value).absolute() if isinstance(value, (str, Path)) else value


Positive = Annotated[Count, Field(ge=1)]


FULL_SOAK_S = 72 * 3600  # the full profile's soak: the uptime a soak of 30 min or more certifies (g4 growth checks)
PROFILES_DIR = Path(__file__).with_name("profiles")   # quick.yaml, full.yaml: each profile's defaults
ProfileName = Literal["quick", "full"]
PROFILE_NAMES: tuple[str, ...] = get_args(ProfileName)


class TargetSettings(StrictModel):
    """One external target's section of gates.yaml (`targets.baseline`, `candidate`, `recompute`): what the user
    says of it. A run resolves it into the one runtime `Endpoint` (gates/targets.py: Endpoint.from_settings)."""

    url: str = Field(pattern=r"^https?://", description="base URL ending in /v1")
    model: str = Field(min_length=1)
    api_key_env: Optional[str] = Field(default=None, description="environment variable holding the API key")
    api: Literal["chat", "completions"] = "chat"
    engine: Literal[ENGINES] = Field(default="generic", description=(
        "the engine serving it (engines/): its cache controls and metric names. generic (default): kvgate "
        "assumes nothing; each control and the metric map come from this section"))
    cache_layer: Optional[Literal[tuple(CACHE_LAYERS)]] = Field(default=None, description=(
        "the KV cache layer under the engine: lmcache (vllm), hicache (sglang), mooncake (vllm, sglang), kvgate "
        "(vllm: kvgate's connector, cache_impl/vllm/vllm_connector.py)"))
    cache_layer_url: Optional[str] = Field(default=None, pattern=r"^https?://", description=(
        "lmcache: its internal API server (clears the host tier); kvgate: the connector's sidecar (admin_port)"))
    metrics_url: Optional[str] = Field(default=None, pattern=r"^https?://", description=(
        "the engine's Prometheus page (default: the URL without /v1, + /metrics)"))
    cache_dir: Optional[Path] = Field(default=None, description=(
        "the disk tier's directory when it is on this host: its page cache is dropped by fadvise"))
    device_kv_tokens: Optional[Positive] = Field(default=None, description=(
        "device KV capacity in tokens (default: from the engine's metrics where it says)"))
    host_kv_tokens: Optional[Positive] = Field(default=None, description="host tier KV capacity in tokens")
    control: ControlConfig = Field(default_factory=ControlConfig, description=(
        "cache-control steps, each an HTTP call or a command; they replace the engine's own"))
    metric_map: Optional[MetricMapConfig] = Field(default=None, description="generic: per tier, its hit counters")
    tokenizer: Optional[str] = Field(default=None, description=(
        "how prompts are sized in its tokens: a tokenizer.json or the model's directory (loaded with Hugging Face "
        "tokenizers), or kvgate-byte-v1 (a `kvgate serve`); none or another name: in words, an approximation"))

    _cache_dir = field_validator("cache_dir", mode="before")(lambda cls, v: _absolute_path(v))

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, value: Optional[str]) -> Optional[str]:
        if value is None or not is_tokenizer_path(value):
            return value
        try:
            sizer_for(value)
        except TokenizerError as error:
            raise ValueError(str(error)) from None
        return str(Path(value).expanduser().resolve())

    @property
    def metrics_endpoint(self) -> str:
        return self.metrics_url or f"{self.url.rstrip('/').removesuffix('/v1')}/metrics"

    @model_validator(mode="after")
    def _engine_settings_fit(self) -> "TargetSettings":
        if self.cache_layer is not None and self.engine not in CACHE_LAYERS[self.cache_layer]:
            raise ValueError(f"cache_layer: expected {self.cache_layer} only with engine "
                             f"{' or '.join(CACHE_LAYERS[self.cache_layer])}, found engine {self.engine}")
        if self.cache_layer_url is not None and self.cache_layer not in ("lmcache", "kvgate"):
            raise ValueError(f"cache_layer_url: expected only with cache_layer: lmcache (its internal API server) "
                             f"or kvgate (the connector's sidecar), found cache_layer {self.cache_layer}")
        if self.metric_map is not None and self.engine != "generic":
            raise ValueError(f"metric_map: expected only with engine: generic ({self.engine}'s metric names are "
                             f"known), found engine {self.engine}")
        return self

    @field_validator("url")
    @classmethod
    def _host_and_port(cls, url: str) -> str:
        parts = urlsplit(url)
        try:
            parts.port
        except ValueError:
            raise ValueError(f"expected a port in 1-65535 in the URL, found {url!r}") from None
        if not parts.hostname:
            raise ValueError(f"expected http(s)://host[:port]/v1 with a host, found {url!r}")
        return url

    @field_validator("api_key_env")
    @classmethod
    def _key_is_set(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and not os.environ.get(name):
            raise ValueError(f"expected the environment variable {name!r} to hold the API key, found it "
                             f"{'empty' if name in os.environ else 'unset'}")
        return name


class EmbeddedTargets(StrictModel):
    preset: Literal["tiny", "small", "base"] = "small"
    seed: Int = Field(default=0, ge=0, le=2**63 - 1, description="weights seed")
    max_running: Count = Field(default=8, ge=1)
    device_capacity_blocks: Count = Field(default=64, ge=1, description="device tier of both cached modes")
    host_capacity: str = Field(default="1GiB", description="host tier of the tiered mode")
    disk_capacity: str = Field(default="8GiB", description="disk tier of the tiered mode (under storage.path)")

    _sizes = field_validator("host_capacity", "disk_capacity", mode="before")(lambda cls, v: _size(v))

    @field_validator("host_capacity")
    @classmethod
    def _host_fits_in_memory(cls, value: str) -> str:
        total = psutil.virtual_memory().total
        if parse_size(value) > total:
            raise ValueError(f"expected at most this host's memory ({total / 2**30:.1f} GiB), found {value!r}")
        return value

    disk_io_mode: Literal["buffered", "direct"] = Field(
        default="direct", description="direct: O_DIRECT reads, no second copy in the page cache under the host tier")
    disk_read_workers: Int = Field(default=16, ge=1, le=256, description="parallel block reads (queue depth)")
    candidate_nodes: Int = Field(default=1, ge=1, le=8, description="tiered candidate nodes (several: G3 routes)")
    pool: Literal["none", "redis", "mooncake"] = Field(
        default="none", description="the shared pool the candidate nodes use, started by the harness on loopback")
    pool_capacity: str = Field(default="512MiB", description="the memory the harness's pool holds (redis "
                               "maxmemory, mooncake's segment); several nodes: sized to the fleet (gates/fleet.py)")

    _pool_size = field_validator("pool_capacity", mode="before")(lambda cls, v: _size(v))


class TargetsConfig(StrictModel):
    kind: Literal["embedded", "external"] = "embedded"
    embedded: EmbeddedTargets = Field(default_factory=EmbeddedTargets)
    baseline: Optional[TargetSettings] = None
    candidate: Optional[TargetSettings] = None
    recompute: Optional[TargetSettings] = Field(default=None, description="optional: the no-reuse reference")
    candidate_nodes: list[str] = Field(default_factory=list,
                                       description="external: more base URLs serving the candidate's model")
    routing: Literal["round-robin", "prefix-affinity"] = Field(
        default="round-robin", description="how requests pick a candidate node")

    @model_validator(mode="after")
    def _external_needs_endpoints(self) -> "TargetsConfig":
        if self.kind == "external" and (self.baseline is None or self.candidate is None):
            raise ValueError("expected baseline and candidate endpoints for kind: external, found "
                             f"baseline={self.baseline is not None} candidate={self.candidate is not None}")
        if self.kind == "embedded" and self.candidate_nodes:
            raise ValueError("candidate_nodes: expected none for kind: embedded (its nodes are "
                             f"embedded.candidate_nodes), found {self.candidate_nodes}")
        return self


class StorageConfig(StrictModel):
    path: Path = Field(default=Path("kvgate-storage"), description="the storage under test (fio, disk tier); "
                       "a relative path is taken from the directory kvgate runs in and stored absolute")

    # absolute now: the gate suites run in another directory and must measure the same storage
    _absolute = field_validator("path", mode="before")(lambda cls, v: _absolute_path(v))


class InventoryConfig(StrictModel):
    min_cpu_cores: Optional[Count] = Field(default=None, ge=1)
    min_memory_gib: Optional[Float] = Field(default=None, gt=0, le=MAX_BYTES / 2**30)
    min_free_gib: Optional[Float] = Field(default=None, gt=0, le=MAX_BYTES / 2**30, description="free space at "
                                          "storage.path")
    min_gpus: Optional[Count] = Field(default=None, ge=0)
    min_nics: Optional[Count] = Field(default=None, ge=0)
    rdma_required: bool = False


def _fio_size(value: Any) -> Any:
    if parse_size(value) <= 0:
        raise ValueError(f"expected a byte size > 0, found {value!r}")
    return value


def _each_once(values: list, noun: str = "value") -> list:
    repeated = _repeated(values)
    if repeated:
        raise ValueError(f"expected each {noun} once, found {repeated} repeated")
    return values


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
    modes: list[Literal["direct", "buffered"]] = Field(default_factory=lambda: ["direct", "buffered"], min_length=1,
                                                       description="direct; buffered with invalidate=1")
    ioengines: list[Literal["libaio", "io_uring"]] = Field(
        default_factory=lambda: ["libaio", "io_uring"], min_length=1,
        description="engines of the direct read points (one the host lacks is probed and left out)")
    write_bs: list[str] = Field(default_factory=lambda: ["1M", "4M", "16M"], min_length=1)
    write_numjobs: list[Annotated[Int, Field(ge=1, le=64)]] = Field(default_factory=lambda: [1, 4], min_length=1)
    write_modes: list[Literal["direct", "buffered"]] = Field(default_factory=lambda: ["direct", "buffered"],
                                                             min_length=1)
    size: str = Field(default="4G", description="bytes each point moves (its jobs a share each)")
    runtime_s: Float = Field(default=5.0, gt=0, description="the most seconds a point runs")

    _sizes = field_validator("size", mode="before")(lambda cls, v: _fio_size(v))
    _lists = field_validator("read_bs", "iodepths", "numjobs", "modes", "ioengines", "write_bs", "write_numjobs",
                             "write_modes")(lambda cls, v: _each_once(v))

    @field_validator("read_bs", "write_bs", mode="before")
    @classmethod
    def _block_sizes(cls, values: Any) -> Any:
        if isinstance(values, list):
            return [_fio_size(v) if isinstance(v, str) else v for v in values]
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
    size: str = "256M"
    runtime_s: Float = Field(default=5.0, gt=0)
    iodepth: Count = Field(default=16, ge=1)
    numjobs: Count = Field(default=1, ge=1)
    direct: bool = True
    ioengine: str = Field(default="libaio", pattern=r"^[a-z][a-z0-9_]*$", description="an fio ioengine name")
    verify: bool = True
    verify_size: str = "64M"
    sweep: FioSweepConfig = Field(default_factory=FioSweepConfig, description=(
        "G1's sweep for the storage's best sequential read and fsync'd write (G2's yardstick)"))

    _sizes = field_validator("size", "verify_size", mode="before")(lambda cls, v: _fio_size(v))


class G1Config(StrictModel):
    _declared = _thresholds_of("g1")

    thresholds: list[RuleField]


class PairsConfig(StrictModel):
    """Sequential side-by-side pairs (gates/side_by_side.py): at least `min`, then more until the
    anytime-valid interval decides the rule, at most `max`, none started once `budget_s` has passed. A plain
    number n means exactly n pairs (min = max = n)."""

    min: Count = Field(default=5, ge=3, description="pairs always taken (3: the fewest an interval is given for)")
    max: Count = Field(default=12, ge=3, description="the most pairs taken when the interval does not decide")
    budget_s: Float = Field(default=300.0, gt=0, description="seconds after which no pair is started")

    @model_validator(mode="before")
    @classmethod
    def _a_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"min": value, "max": value}
        return value

    @model_validator(mode="after")
    def _max_at_least_min(self) -> "PairsConfig":
        if self.max < self.min:
            raise ValueError(f"max: expected at least min ({self.min}), found {self.max}")
        return self

    def pairing(self):
        return Pairing(self.min, self.max, self.budget_s)


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


def _judged_among(judged: str, measured: list[str], noun: str) -> None:
    """The judged path (a loader, a checkpoint writer) is one of those measured."""
    if judged not in measured:
        raise ValueError(f"judged: expected one of the {noun}s measured ({', '.join(measured)}), found {judged!r} "
                         f"(add it to {noun}s, or name the {noun} to judge)")


class ModelLoadConfig(StrictModel):
    """G2's model service loading: a safetensors checkpoint read cold by each loader, beside fio reading
    the same files, and (embedded or `launch`) a server's start to its first token."""

    enabled: bool = True
    path: Optional[Path] = Field(default=None, description="an existing model directory (safetensors shards, read "
                                 "only, never written); null: a random checkpoint of `size` is written under "
                                 "storage.path")
    size: str = Field(default="1GiB", description="the random checkpoint's size (without `path`)")
    shard_size: str = Field(default="256MiB", description="the random checkpoint's shard size")
    loaders: list[Literal[LOADER_NAMES]] = Field(default_factory=lambda: list(LOADER_NAMES), min_length=1,
        description="the loaders measured, each beside the storage's best read job; those not judged are shown as "
                    "how much of the storage they use")
    judged: Literal[LOADER_NAMES] = Field(default=KVGATE_LOADER, description=(
        "the loader whose ratio is judged: kvgate (its own path, at the storage's best: the storage is judged), "
        "or a field loader (a joint test of one serving stack's loader)"))
    parallel: Int = Field(default=16, ge=1, le=256, description="reads in flight of kvgate's loader and read "
                          "threads of the streaming loaders")
    rounds: PairsConfig = Field(default_factory=PairsConfig, description=(
        "cold rounds, every loader once per round, each load beside the storage's best read job reading the same "
        "files; taken until the judged loader's interval decides"))
    baseline_path: Optional[Path] = Field(default=None, description=(
        "a directory on the baseline storage (e.g. the NFS mount the vendor compares with): with `path`, the same "
        "model there; without, the random checkpoint is written there too. Unset: the speedup is not run"))
    service: bool = Field(default=True, description="embedded: time `kvgate serve --weights` per loader, start to "
                          "first token")
    launch: Optional[list[str]] = Field(default=None, description="external: the engine's own start command, timed "
                                        "start → health_url ready → first token")
    health_url: Optional[str] = Field(default=None, pattern=r"^https?://")

    _sizes = field_validator("size", "shard_size", mode="before")(lambda cls, v: _fio_size(v))
    _paths = field_validator("path", "baseline_path", mode="before")(lambda cls, v: _absolute_path(v))
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

    _loaders_once = field_validator("loaders")(lambda cls, v: _each_once(v, "loader"))

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

    enabled: bool = True
    ranks: Int = Field(default=2, ge=1, le=64, description="training ranks, one process each (gloo)")
    parameters: Parameters = Field(default=20_000_000,
        description="parameters of the saved state: a count, or a model size of MLPerf Storage's checkpoint "
                    "workload (8B, 70B, 405B, 1T), 32B (the vendor's 8-rank job) or adapter (a LoRA adapter)")
    bytes_per_parameter: Float = Field(default=14.0, ge=2, le=64, description=(
        "bytes of state per parameter: 14 is bf16 weights + fp32 master weights + Adam's two moments"))
    thread_count: Int = Field(default=1, ge=1, le=64, description="each rank's write threads (files written at once)")
    writers: list[Literal[CHECKPOINT_WRITERS]] = Field(
        default_factory=lambda: list(CHECKPOINT_WRITERS), min_length=1, description=(
            "the writers measured, each save beside the storage's best fsync'd write job: kvgate (its own: DCP's "
            "planner and metadata, aligned O_DIRECT writes from huge pages, parallel) and dcp (DCP's "
            "FileSystemWriter); those not judged are shown as how much of the storage they use"))
    judged: Literal[CHECKPOINT_WRITERS] = Field(default=KVGATE_WRITER, description=(
        "the writer whose ratio is judged: kvgate (the storage is judged), or dcp (a joint test of DCP's own "
        "writer); its checkpoint is restored by each reader"))
    rounds: PairsConfig = Field(default_factory=PairsConfig, description=(
        "saves (after two warm-up saves of each writer), each beside the storage's best fsync'd write job writing "
        "as many bytes; taken until the judged writer's interval decides"))
    restores: Count = Field(default=3, ge=1, description="cold restores of the last save, each checked bit for bit")
    baseline_path: Optional[Path] = Field(default=None, description=(
        "a directory on the baseline storage: the speedup of the storage under test over it. Unset: not run"))

    _paths = field_validator("baseline_path", mode="before")(lambda cls, v: _absolute_path(v))

    _writers_once = field_validator("writers")(lambda cls, v: _each_once(v, "writer"))

    @model_validator(mode="after")
    def _judged_is_measured(self) -> "CheckpointConfig":
        _judged_among(self.judged, self.writers, "writer")
        return self

    def spec(self) -> CheckpointSpec:
        """The state the ranks save: `parameters` (a count, or a preset's) at `bytes_per_parameter`."""
        fields = {"bytes_per_parameter": self.bytes_per_parameter, "ranks": self.ranks}
        if isinstance(self.parameters, str):
            return CheckpointSpec.from_preset(self.parameters.lower(), **fields)
        return CheckpointSpec(parameters=self.parameters, **fields)


class NoReuseConfig(StrictModel):
    """G2's no-reuse control (gates/g2_baseline/test_g2_no_reuse.py): what offload costs when no prefix
    comes back, unique prompts sent one at a time to the candidate and the baseline in alternating pairs."""

    enabled: bool = True
    context_tokens: ContextTokens = Field(default=2048, ge=16, description="each control prompt's length in tokens")
    max_tokens: ContextTokens = Field(default=32, ge=2, description="output tokens per control request")
    pairs: Count = Field(default=10, ge=5, description="alternating candidate / baseline pairs")


G2_OUTPUT_TOKENS = 1   # tokens each G2 request generates (its TTFT needs one; gates/g2_baseline)


def g2_contexts_problem(contexts: list[int], model_context: int, model: str) -> Optional[str]:
    """Why `contexts` do not fit a model of `model_context` tokens (`model` says which and whence): the
    longest with the token G2 generates must fit. None when they do. One rule for the embedded presets
    (GatesConfig.check_g2_contexts) and an external model's max_model_len (gates/preflight.py)."""
    longest, fits = max(contexts), model_context - G2_OUTPUT_TOKENS
    if longest <= fits:
        return None
    return (f"g2.contexts: expected context lengths the model serves ({model}: {model_context} tokens, less the "
            f"{G2_OUTPUT_TOKENS} token each G2 request generates: at most {fits}), found {longest}")


class G2Config(StrictModel):
    _declared = _thresholds_of("g2")

    contexts: list[Annotated[ContextTokens, Field(ge=2)]] = Field(min_length=1, description="context lengths in tokens")
    rounds: Count = Field(default=2, ge=1)
    cold_read_pairs: PairsConfig = Field(default_factory=PairsConfig, description=(
        "alternating rounds of the tier's cold load and the storage's best read job (G1's sweep) on the same "
        "storage, taken until the interval decides; the cold-read ratio is judged on them"))
    cold_read_prefixes: Int = Field(default=1, ge=1, le=64, description="longest-context prefixes each tier "
                                    "round loads cold (more bytes per pair: a steadier ratio)")
    cold_read_sets: Int = Field(default=2, ge=1, le=64, description=(
        "sets of cold_read_prefixes prefixes, all stored at the first pair; pair i reloads set i mod sets from "
        "disk (upper tiers evicted, pages dropped) and fio reads region i mod sets of a file laid out then too"))
    model_load: ModelLoadConfig = Field(default_factory=ModelLoadConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    no_reuse: NoReuseConfig = Field(default_factory=NoReuseConfig)
    thresholds: list[RuleField]


def _level(value: Any) -> Union[int, float]:
    """A G3 level as given: an int stays an int (a concurrency), a float a float (a multiplier)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, found {value!r}")
    if abs(value) > MAX_COUNT:
        raise ValueError(f"expected a value <= {MAX_COUNT}, found {value!r}")
    return value


Level = Annotated[Union[int, float], PlainValidator(_level)]


NO_REUSE_WORKLOAD = {"kind": "random", "name": "no-reuse", "requests": 1000,
                     "input_tokens": {"distribution": "uniform", "min": 512, "max": 2048},
                     "output_tokens": {"distribution": "fixed", "mean": 32}}


class G3NoReuseConfig(StrictModel):
    """G3's no-reuse control (gates/g3_main/test_g3_no_reuse.py): one closed-loop level of prompts that
    share no prefix, baseline then candidate, unprimed; each request is sent once (a workload a step
    would cycle through voids the control: its cached tokens say so)."""

    enabled: bool = True
    workload: dict = Field(default_factory=lambda: dict(NO_REUSE_WORKLOAD),
                           description="a workload with no shared prefixes (kind: random)")
    level: Count = Field(default=4, ge=1, description="the concurrency the control runs at")
    duration_s: Optional[Float] = Field(default=None, gt=0, description="seconds per target (default g3.duration_s)")
    warmup_s: Optional[Float] = Field(default=None, ge=0, description="warm-up left out (default g3.warmup_s)")


class G3SteadyConfig(StrictModel):
    """When a level's warm-up pairs end (workloads/loadgen/steady.py): two consecutive candidate blocks agree."""

    ttft_change: Float = Field(default=0.35, gt=0, description="the candidate's TTFT p50 within this fraction of the "
                               "block before")
    hit_ratio_points: Float = Field(default=0.05, ge=0, le=1, description="its hit ratio within this many points "
                                    "(a fraction) of the block before")
    max_pairs: Count = Field(default=3, ge=1, description="warm-up pairs at most; a level not settled by then is "
                             "measured from the last and says so")

    def rule(self) -> SteadyRule:
        return SteadyRule(self.ttft_change, self.hit_ratio_points, self.max_pairs)


class SLOConfig(StrictModel):
    """The service-level objective a request meets: its TTFT and its TPOT within their limits at a percentile of
    the requests, errors within their share. G3's capacity search (g3.capacity) finds the most load at which it
    holds (kvcore/attainment.py: a request misses when a latency is over its limit, it failed, or it never
    finished)."""

    percentile: Float = Field(default=90, gt=50, lt=100, description="the percentile both limits hold at (90: at "
                              "most 10% of the requests may miss)")
    ttft_ms: Float = Field(gt=0, description="TTFT limit at the percentile, ms")
    tpot_ms: Optional[Float] = Field(default=None, gt=0, description="time per output token limit at the "
                                     "percentile, ms (after the first token; none: TTFT alone)")
    max_error_share: Float = Field(default=0.001, ge=0, lt=1, description="a load whose failed share is decided above "
                                   "this misses the SLO")


class G3CapacityConfig(StrictModel):
    """The capacity search: per target, the most load at which `slo` holds (kvcore/capacity.py), baseline and
    candidate probes in turn; each probe stops when its requests decide it. The load is closed-loop users, or with
    `g3.replay: rate_multipliers` a multiple of the trace's arrival rate (open loop, in steps of `rate_step`)."""

    enabled: bool = Field(default=False, description="run the capacity search after the sweep (needs `slo`)")
    start: Level = Field(default=1, description="the first load probed (users, or a multiple of the trace's rate)")
    most: Level = Field(default=64, description="the most load probed (the ramp doubles up to it)")
    rate_step: Float = Field(default=0.25, gt=0, description="replay: rate_multipliers: the search's resolution, in "
                             "multiples of the trace's rate (start and most are whole multiples of it)")
    probe_requests: Count = Field(default=400, ge=34, description="requests a probe sends at most (34: the fewest "
                                  "that decide a 10% allowance when none misses)")
    probe_budget_s: Float = Field(default=60, gt=0, description="seconds a probe may run before it is undecided")
    confidence: Float = Field(default=0.95, gt=0.5, lt=1, description="each probe's confidence sequence level")

    @model_validator(mode="after")
    def _start_within_most(self) -> "G3CapacityConfig":
        for name in ("start", "most"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a load > 0, found {getattr(self, name)}")
        if self.start > self.most:
            raise ValueError(f"start: expected at most `most` ({self.most}), found {self.start}")
        return self

    def unit(self, replay: str) -> float:
        """The search's step: one user closed loop, `rate_step` open loop."""
        return 1 if replay == "closed_loop" else self.rate_step

    def check_loads(self, replay: str) -> None:
        """start and most are whole multiples of the search's step for `replay`; else a ValueError naming the field."""
        unit = self.unit(replay)
        what = "a whole number of users (replay: closed_loop)" if unit == 1 else \
            f"a whole multiple of rate_step ({unit:g}, replay: rate_multipliers)"
        for name in ("start", "most"):
            value = getattr(self, name)
            if not math.isclose(round(value / unit) * unit, value) or (unit == 1 and not isinstance(value, int)):
                raise ValueError(f"g3.capacity.{name}: expected {what}, found {value}")


class G3Config(StrictModel):
    """G3's sweep. `replay` says what a level is: closed_loop, concurrent users (every workload);
    rate_multipliers, multiples of a trace's arrival rate (trace workloads; needs `ttft_slo_ms`)."""

    _declared = _thresholds_of("g3")

    workload: dict = Field(description="a workload spec (see workloads/specs)")
    replay: Literal["closed_loop", "rate_multipliers"] = Field(
        default="closed_loop", description="closed_loop: levels are concurrencies; rate_multipliers (a trace): "
        "levels multiply the trace's arrival rate, open loop")
    levels: list[Level] = Field(min_length=1, description="concurrencies, or rate multipliers")
    ttft_slo_ms: Optional[Float] = Field(
        default=None, gt=0, description="rate_multipliers: a target sustains a rate while its TTFT p90 (from the "
        "scheduled arrival) is within this")
    duration_s: Float = Field(gt=0, description="seconds a baseline block lasts, about: each level runs pairs of "
                              "blocks of baseline and candidate in turn, ABBA..., both blocks of a pair serving the "
                              "same requests (the slice the baseline serves in about this long)")
    warmup_s: Float = Field(ge=0, description="seconds of a block left out, from its first request sent, where "
                            "blocks run by time (the no-reuse control's default); matched pairs are measured from "
                            "their first request, after the level's warm-up pairs (steady)")
    steady: G3SteadyConfig = Field(default_factory=G3SteadyConfig, description="when a level's warm-up pairs end")
    min_blocks: Count = Field(default=3, ge=3, description="blocks per target per level, at least (an interval over "
                            "block pairs needs 3)")
    max_blocks: Count = Field(default=5, description="blocks per target per level at most, while the interval has "
                            "not decided every rule of the level")
    level_budget_s: Optional[Float] = Field(default=None, gt=0, description="seconds a level may take before no "
                                            "further block pair starts (default: no limit)")
    min_requests: Count = Field(default=10, ge=1, description="completed requests a block needs to be valid")
    max_error_share: Float = Field(default=0.01, ge=0, lt=1, description=(
        "a block (and a no-reuse control step) whose measured requests failed more than this share is invalid"))
    prime: bool = Field(default=True, description="send each target every session's first turn (a trace: its "
                        "warm-up requests) before the sweep")
    no_reuse: G3NoReuseConfig = Field(default_factory=G3NoReuseConfig)
    capacity: G3CapacityConfig = Field(default_factory=G3CapacityConfig, description=(
        "the most users each target serves within `slo`, searched, and the candidate's gain in it"))
    thresholds: list[RuleField]

    @model_validator(mode="after")
    def _no_reuse_step_fits(self) -> "G3Config":
        control = self.no_reuse
        duration = control.duration_s if control.duration_s is not None else self.duration_s
        warmup = control.warmup_s if control.warmup_s is not None else self.warmup_s
        if warmup >= duration:
            raise ValueError(f"no_reuse.warmup_s: expected less than its duration ({duration:g} s), found {warmup:g}")
        if control.workload.get("kind") != "random":
            raise ValueError("no_reuse.workload.kind: expected random (prompts that share no prefix), found "
                             f"{control.workload.get('kind')!r}")
        return self

    @model_validator(mode="after")
    def _blocks_in_order(self) -> "G3Config":
        if self.max_blocks < self.min_blocks:
            raise ValueError(f"max_blocks: expected at least min_blocks ({self.min_blocks}), found {self.max_blocks}")
        return self

    @model_validator(mode="after")
    def _warmup_within_the_step(self) -> "G3Config":
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: expected less than duration_s ({self.duration_s:g}), found {self.warmup_s:g}")
        return self

    @model_validator(mode="after")
    def _levels_mean_the_replay(self) -> "G3Config":
        repeated = _repeated(self.levels)
        if repeated:
            raise ValueError(f"levels: expected each level once, found {repeated} repeated")
        if self.replay == "closed_loop":
            bad = [v for v in self.levels if not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"levels: expected concurrencies (integers >= 1) for replay: closed_loop, "
                                 f"found {bad}")
            return self
        if self.workload.get("kind") != "trace":
            raise ValueError("workload.kind: expected a trace workload (kind: trace) for replay: rate_multipliers, "
                             "found "
                             f"{self.workload.get('kind')!r}")
        bad = [v for v in self.levels if v <= 0]
        if bad or sorted(self.levels) != self.levels:
            raise ValueError(f"levels: expected rate multipliers (numbers > 0, ascending) for replay: "
                             f"rate_multipliers, found {self.levels}")
        if self.ttft_slo_ms is None:
            raise ValueError("ttft_slo_ms: expected the TTFT objective a sustained rate meets for replay: "
                             "rate_multipliers, found nothing")
        return self


SCHEDULED_FAULTS = BLOCK_FAULTS + IO_FAULTS


class FaultSpec(StrictModel):
    """A fault injected into the candidate's cache during the soak (kvgate's: embedded, or its connector in vLLM).

    Stored-block faults damage a disk block of the first consistency probe's prompt and evict
    the upper tiers, so the next probe must load it; I/O faults are armed for `duration_s`.
    """

    kind: Literal[SCHEDULED_FAULTS]
    at_s: Float = Field(ge=0, description="seconds after the soak's start")
    duration_s: Float = Field(default=10, gt=0, le=FAULT_LIMITS["duration_s"],
                              description="I/O faults: how long the fault stays armed")
    delay_ms: Float = Field(default=50, gt=0, le=FAULT_LIMITS["delay_ms"],
                            description="slow_disk: added delay per block read or write")


# the only checks a profile may measure without judging: a quick soak cannot power a latency or throughput trend
UNPOWERED_DRIFT = ("ttft_p99_drift_fraction", "throughput_drift_fraction")


class G4Config(StrictModel):
    _declared = _thresholds_of("g4")

    workload: dict
    duration_s: Float = Field(gt=0)
    window_s: Float = Field(ge=1, description="seconds per window (at least 1: a window is a sample of the load)")
    concurrency: Count = Field(ge=1)
    memory_growth_limit_mib: Float = Field(default=512, gt=0, description=(
        "the most server memory outside the cache pools may grow over memory_growth_horizon_s"))
    memory_growth_horizon_s: Optional[Float] = Field(default=None, gt=0, description=(
        "the uptime the run certifies: how far each growth slope (memory, descriptors, threads, tasks, temp files) "
        "is projected, at least duration_s (unset: 72 h for a soak of 30 min or more, the soak's own duration_s "
        "for a shorter one)"))
    warmup_s: Float = Field(default=0, ge=0, description="the soak's first seconds, left out of the drift checks "
                            "(caches filling, memory ramping); errors and probes count from the start")
    drift_tolerance: Float = Field(default=0.05, gt=0, lt=1, description=(
        "the largest change over the soak, as a fraction of the level, that a windowed trend may show"))
    max_error_share: Float = Field(default=0.01, ge=0, lt=1, description=(
        "a window whose requests failed more than this share is invalid: left out of the drift checks"))
    measured_only: list[Literal[UNPOWERED_DRIFT]] = Field(default_factory=list, description=(
        "the latency and throughput drift checks a soak too short to power them measures without judging, saying "
        "the windows each would need (the quick profile's 2 minutes); the full profile judges everything"))
    faults: list[FaultSpec] = Field(default_factory=list, description=(
        "the fault schedule (the embedded candidate, or vLLM with kvgate's connector)"))
    thresholds: list[RuleField]

    @model_validator(mode="after")
    def _faults_within_the_soak(self) -> "G4Config":
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: expected less than duration_s ({self.duration_s:g}), found {self.warmup_s:g}")
        if self.memory_growth_horizon_s is not None and self.memory_growth_horizon_s < self.duration_s:
            raise ValueError(f"memory_growth_horizon_s: expected at least duration_s ({self.duration_s:g}), found "
                             f"{self.memory_growth_horizon_s:g}")
        if self.window_s > self.duration_s:
            raise ValueError(f"window_s: expected at most duration_s ({self.duration_s:g}), found {self.window_s:g}")
        late = [f"faults[{i}].at_s" for i, f in enumerate(self.faults) if f.at_s >= self.duration_s]
        if late:
            raise ValueError(f"expected every fault's at_s < duration_s ({self.duration_s:g}), found "
                             f"{', '.join(late)} at or after the end")
        return self


class TargetSizing(StrictModel):
    """What the sizing model needs of the target under test that kvgate cannot read from it: the model's KV
    layout, the block size and each tier's capacity (an external engine's; for the embedded one they
    replace what targets.embedded gives). The candidate has every tier given; the baseline the device only.
    `model_config` is pydantic's own name, so the field is `model_config_path`, read as `model_config`."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True, protected_namespaces=())

    model_config_path: Optional[Path] = Field(default=None, alias="model_config", description=(
        "the model's Hugging Face config.json (its layers, KV heads, head dim, dtype; MLA: kv_lora_rank)"))
    kv_dtype: Optional[str] = Field(default=None, description="the KV cache's dtype when not the model's (fp8)")
    kv_layout: Optional[dict] = Field(default=None, description=(
        "instead of model_config: {layers, dtype, kv_heads, head_dim} or, MLA, {layers, dtype, kv_lora_rank, "
        "qk_rope_head_dim}"))
    block_size: Optional[Count] = Field(default=None, ge=1, description="tokens per KV block (vLLM 16, kvgate 256)")
    device_kv_tokens: Optional[Count] = Field(default=None, ge=1, description=(
        "tokens the device KV cache holds (vLLM: 'GPU KV cache size: N tokens'; SGLang: max_total_num_tokens)"))
    host_capacity: Optional[str] = Field(default=None, description="host DRAM tier bytes (0: none)")
    disk_capacity: Optional[str] = Field(default=None, description="disk tier bytes (0: none)")
    pool_capacity: Optional[str] = Field(default=None, description="the shared pool's bytes (its store's memory)")
    pool_gbps: Optional[Float] = Field(default=None, gt=0, description="GB/s a node loads from the pool at")
    max_running: Optional[Count] = Field(default=None, ge=1, description=(
        "requests an engine runs at once (vLLM --max-num-seqs; default: targets.embedded.max_running)"))

    _sizes = field_validator("host_capacity", "disk_capacity", "pool_capacity", mode="before")(
        lambda cls, v: v if v is None else _size(v))
    _paths = field_validator("model_config_path", mode="before")(lambda cls, v: v if v is None else _absolute_path(v))

    @model_validator(mode="after")
    def _one_layout(self) -> "TargetSizing":
        if self.model_config_path is not None and self.kv_layout is not None:
            raise ValueError("kv_layout: expected either model_config or kv_layout, found both")
        if self.kv_dtype is not None and self.model_config_path is None:
            raise ValueError(f"kv_dtype: expected it beside model_config (kv_layout names its own dtype), "
                             f"found {self.kv_dtype!r} without one")
        self.shape()  # read now: a missing file or field is an error at load, with its path
        return self

    def shape(self):
        """The KV layout given (sizing/layout.py's KVShape), or None when neither is."""
        if self.kv_layout is not None:
            return KVShape.from_fields(self.kv_layout, root="kv_layout")
        if self.model_config_path is not None:
            try:
                return KVShape.from_hf_config(self.model_config_path, self.kv_dtype)
            except ConfigError as error:
                raise ValueError(f"model_config: expected a config.json with the model's KV layout, found "
                                 f"{error}") from None
        return None


COUNT_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


class RooflineConfig(StrictModel):
    """A recompute curve from FLOPs before any G2 has measured one (sizing/timing.py RecomputeCurve.roofline):
    prefill of n tokens = (2·params·n + 2·layers·n²·attention_dim) ÷ the device's achievable FLOP/s."""

    device_tflops: Float = Field(gt=0, description="the device's achievable dense TFLOP/s (peak x utilisation)")
    params: Float = Field(gt=0, le=MAX_COUNT, description="the model's parameter count: 8.03e9, or 8.03B (K, M, B, T)")
    attention_dim: Count = Field(ge=1, description="attention heads x head dim (4096 for Llama-3.1-8B)")
    layers: Optional[Count] = Field(default=None, ge=1, description="layers (default: the KV layout's)")
    overhead_s: Float = Field(default=0.0, ge=0, description="fixed seconds per request (HTTP, tokenizing)")

    @field_validator("params", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        """"8B", "70.6B", "3e6" (YAML reads an exponent without a sign as text) as a number; anything else as given."""
        if not isinstance(value, str):
            return value
        text, scale = value.strip(), 1.0
        if text[-1:].upper() in COUNT_SUFFIXES:
            text, scale = text[:-1], COUNT_SUFFIXES[text[-1].upper()]
        try:
            return float(text) * scale
        except ValueError:
            raise ValueError(f"expected a parameter count (8.03e9, 8B), found {value!r}") from None


class SizingConfig(StrictModel):
    """The sizing model in `kvgate run` (sizing/): where its constants come from before the run has
    measured them, its tolerances (informational: it never passes or fails a gate), and what it needs of
    the target that the target does not tell (`target`)."""

    target: Optional[TargetSizing] = Field(default=None, description=(
        "the target's KV layout and tier capacities (needed for targets.kind: external)"))

    calibration: Optional[Path] = Field(default=None, description=(
        "constants fitted to an earlier run on this machine (`kvgate plan --calibrate RUN_DIR`): G2's and G3's "
        "figures are predicted before G2 runs; without it, from G2's own measurements onward"))
    roofline: Optional[RooflineConfig] = Field(default=None, description=(
        "a FLOPs roofline standing in for the recompute curve where no run or calibration gives one"))
    runs: Int = Field(default=5, ge=1, le=100, description=(
        "G3 runs simulated per level, each with its own draw of the machine's step noise (a calibrated "
        "jitter): the figure is their median, its interval spans theirs"))
    hit_ratio_points: Float = Field(default=0.05, gt=0, le=1, description="largest hit-ratio error it accepts")
    figure_mape: Float = Field(default=0.15, gt=0, le=10, description="largest G3 TTFT / throughput MAPE it accepts")
    g2_ttft_mape: Float = Field(default=0.10, gt=0, le=10, description="largest G2 TTFT MAPE it accepts")

    _paths = field_validator("calibration", mode="before")(lambda cls, v: _absolute_path(v))


class GatesConfig(StrictModel):
    profile: ProfileName = "quick"
    aa: bool = Field(default=False, description=(
        "A/A mode (`kvgate run --aa`): the candidate against itself, so nothing differs (G2: the storage's best "
        "job on both sides of each pair); the run reports how many intervals excluded the null (the harness's own "
        "false decisions)"))
    targets: TargetsConfig = Field(default_factory=TargetsConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    inventory: InventoryConfig = Field(default_factory=InventoryConfig)
    fio: FioConfig = Field(default_factory=FioConfig)
    slo: Optional[SLOConfig] = Field(default=None, description=(
        "the service-level objective (TTFT and TPOT at a percentile, errors) G3's capacity search holds loads to"))
    g1: G1Config
    g2: G2Config
    g3: G3Config
    g4: G4Config
    sizing: SizingConfig = Field(default_factory=SizingConfig)
    claims: list[Claim] = Field(default_factory=lambda: [Claim(**c) for c in DEFAULT_CLAIMS], description=(
        "the vendor's figures, each beside what the run measured (kvcore/claims.py); default: the seed playbook's"))

    @field_validator("claims")
    @classmethod
    def _claims_once(cls, claims: list[Claim]) -> list[Claim]:
        repeated = _repeated([c.id for c in claims])
        if repeated:
            raise ValueError(f"expected each claim id once, found {repeated} repeated")
        for i, claim in enumerate(claims):
            known = [c.metric for c in CHECKS[claim.gate]]
            if claim.metric not in known:
                raise ValueError(f"[{i}].metric: expected a figure {claim.gate} judges ({', '.join(known)}), "
                                 f"found {claim.metric!r}")
        return claims

    @model_validator(mode="after")
    def _capacity_needs_an_slo(self) -> "GatesConfig":
        if self.g3.capacity.enabled and self.slo is None:
            raise ValueError("slo: expected the objective g3.capacity searches under (slo: {ttft_ms: …, tpot_ms: …}) "
                             "with g3.capacity.enabled, found nothing")
        if self.g3.capacity.enabled:
            self.g3.capacity.check_loads(self.g3.replay)
        return self

    @model_validator(mode="after")
    def _faults_need_kvgates_cache(self) -> "GatesConfig":
        candidate = self.targets.candidate
        connector = candidate is not None and candidate.cache_layer == "kvgate" and candidate.cache_layer_url
        if self.g4.faults and self.targets.kind != "embedded" and not connector:
            raise ValueError("g4.faults: expected no fault schedule for an external candidate without kvgate's "
                             "cache (faults are injected through kvgate's admin routes: the embedded candidate's, or "
                             "the sidecar of kvgate's connector in vLLM: targets.candidate.cache_layer: kvgate and "
                             f"cache_layer_url), found {len(self.g4.faults)}")
        return self

    def check_g2_contexts(self) -> None:
        """ConfigError when G2's contexts do not fit the embedded preset's context (`kvgate run` with G2 and
        `kvgate plan` call it before any work; an external model's is checked at pre-flight, where it is read).
        Not part of loading: a run without G2 does not depend on them (`kvgate run g1 g3` with the full
        profile's 128k contexts on an embedded preset of 16k tokens, say)."""
        if self.targets.kind != "embedded":
            return
        preset = self.targets.embedded.preset
        problem = g2_contexts_problem(self.g2.contexts, PRESETS[preset].max_seq_len, f"preset {preset}")
        if problem:
            raise ConfigError(problem)

    def rule(self, gate: str, metric: str) -> Optional[Rule]:
        """The rule `gate` judges `metric` by: its configured threshold, else the check's default, else None
        (KeyError when the gate declares no such check: kvcore/checks.py)."""
        for rule in getattr(self, gate).thresholds:
            if rule.metric == metric:
                return rule
        return check_of(gate, metric).default

    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def profile_defaults(name: str) -> dict:
    """A profile's defaults, as data: gates/profiles/<name>.yaml, read through kvcore's one YAML loader."""
    if name not in PROFILE_NAMES:
        raise ConfigError(f"profile: expected one of {sorted(PROFILE_NAMES)}, found {name!r}")
    return load_yaml_mapping(PROFILES_DIR / f"{name}.yaml", f"gates/profiles/{name}.yaml")


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "workload":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_config(path: Optional[Path] = None, profile: Optional[str] = None,
                trace: Optional[Path] = None) -> GatesConfig:
    """The validated configuration: profile defaults under the file's values (file optional).

    `trace` (`kvgate run --trace`) is the trace file of every trace workload; a trace path in the
    file is taken relative to the file's folder. Both become absolute, and the file must exist.
    """
    data: Any = {}
    if path is not None:
        data = load_yaml_mapping(path, str(path))
    data = {key: value for key, value in data.items() if value is not None}  # an empty section: its defaults
    chosen = profile or data.get("profile") or "quick"
    merged = _merge(profile_defaults(chosen), {**data, "profile": chosen})
    external = isinstance(merged.get("targets"), dict) and merged["targets"].get("kind") == "external"
    if external and "faults" not in (data.get("g4") if isinstance(data.get("g4"), dict) else {}):
        merged["g4"]["faults"] = []  # the profile's fault schedule is for the embedded candidate
    _place_trace_paths(merged, Path(path).parent if path is not None else None, trace)
    config = _validated(merged)
    fleet = fleet_defaults(config, data)  # several embedded nodes: defaults sized to the fleet (gates/fleet.py)
    if fleet:
        config = _validated(_merge(merged, fleet))
    for gate in ("g3", "g4"):  # every field of a workload spec checked now, before any server starts
        spec = load_spec(getattr(config, gate).workload, root=f"{gate}.workload")
        if spec.kind == "trace":
            check_trace(spec, f"{gate}.workload")
            if gate == "g3":
                _trace_fills_every_block(config.g3, spec)
    return config


def _trace_fills_every_block(g3: G3Config, spec) -> None:
    """A trace's measured requests are cut into one part per level and each part into one sub-part per block pair
    (warm-up pairs included): every sub-part must hold `g3.min_requests`, or no block of it can be valid."""
    records = len(read_trace(spec.path, None if spec.limit is None else spec.warmup_requests + spec.limit))
    measured = records - spec.warmup_requests
    blocks = len(g3.levels) * pairs_at_most(g3.max_blocks, g3.steady.rule())
    needed = blocks * g3.min_requests
    if measured < needed:
        raise ConfigError(
            f"g3.workload: expected a trace with at least {needed} measured requests ({len(g3.levels)} levels x "
            f"{blocks // len(g3.levels)} block pairs (max_blocks {g3.max_blocks} + {g3.steady.max_pairs} warm-up) x "
            f"min_requests {g3.min_requests}: each block replays its own slice once), found {measured} "
            f"({str(spec.path)!r}); give a larger limit, fewer levels or blocks, or a smaller g3.min_requests")


def _validated(merged: dict) -> GatesConfig:
    try:
        return GatesConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "")) from None


def _place_trace_paths(merged: dict, base: Optional[Path], trace: Optional[Path]) -> None:
    """Trace workloads' paths made absolute: `trace` when given (from the working directory), else the file's own."""
    traced = False
    for gate in ("g3", "g4"):
        workload = merged.get(gate, {}).get("workload") if isinstance(merged.get(gate), dict) else None
        if not isinstance(workload, dict) or workload.get("kind") != "trace":
            continue
        traced = True
        found = trace if trace is not None else workload.get("path")
        if isinstance(found, (str, Path)):
            found = Path(found) if trace is not None or base is None or Path(found).is_absolute() else base / found
            workload["path"] = str(found.absolute())
    if trace is not None and not traced:
        raise ConfigError(f"--trace: expected a trace workload (g3.workload.kind or g4.workload.kind: trace), "
                          f"found none to give {str(trace)!r} to")
