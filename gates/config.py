"""`gates.yaml`: targets, storage, expected inventory, fio matrix, workloads, thresholds and durations.

Validated once at the edge: an unknown key or a bad value raises ConfigError
naming the field path, what was expected and what was found (the CLI exits 2).
A profile (`quick` or `full`: gates/profiles/*.yaml) supplies defaults under the file's own values.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args

import psutil
from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from cache_impl.cache.config import DEFAULT_READ_WORKERS
from cache_impl.engine.presets import MAX_WEIGHTS_SEED, PRESETS
from engines.settings import TargetSettings
from kvcore.checks import CHECKS, check_of, configurable_metrics
from kvcore.claims import DEFAULT_CLAIMS, Claim
from kvcore.rules import Rule, parse_rule
from kvcore.sampling import PairsConfig, RoundsConfig
from kvcore.settings import (
    ConfigError,
    ContextTokens,
    Count,
    Float,
    Int,
    StrictModel,
    each_once,
    format_validation_error,
    load_yaml_mapping,
    parse_size,
    repeated,
    size_text,
)
from sizing.settings import SizingConfig
from workloads.loadgen.settings import G3CapacityConfig, G3SteadyConfig, Level, SLOConfig
from workloads.loadgen.sweep import pairs_at_most
from workloads.probes.settings import FaultSpec
from workloads.storage.settings import CheckpointConfig, FioConfig, InventoryConfig, ModelLoadConfig, StorageConfig
from workloads.traffic.datasets import TraceSpec, WorkloadField, check_trace, check_trace_path, load_spec, read_trace

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


FULL_SOAK_S = 72 * 3600  # the full profile's soak: the uptime a soak of 30 min or more certifies (g4 growth checks)
PROFILES_DIR = Path(__file__).with_name("profiles")   # quick.yaml, full.yaml: each profile's defaults
ProfileName = Literal["quick", "full"]
PROFILE_NAMES: tuple[str, ...] = get_args(ProfileName)


class EmbeddedTargets(StrictModel):
    preset: Literal["tiny", "small", "base"] = Field(default="small", description="the model size: tiny | small | base")
    seed: Int = Field(default=0, ge=0, le=MAX_WEIGHTS_SEED, description="weights seed")
    max_running: Count = Field(default=8, ge=1, description="requests decoding at once per server")
    device_capacity_blocks: Count = Field(default=64, ge=1, description="device tier of both cached modes")
    host_capacity: str = Field(default="1GiB", description="host tier of the tiered mode")
    disk_capacity: str = Field(default="8GiB", description="disk tier of the tiered mode (under storage.path)")

    _sizes = field_validator("host_capacity", "disk_capacity", mode="before")(lambda cls, v: size_text(v))

    @field_validator("host_capacity")
    @classmethod
    def _host_fits_in_memory(cls, value: str) -> str:
        total = psutil.virtual_memory().total
        if parse_size(value) > total:
            raise ValueError(f"expected at most this host's memory ({total / 2**30:.1f} GiB), found {value!r}")
        return value

    disk_io_mode: Literal["buffered", "direct"] = Field(
        default="direct", description="direct: O_DIRECT reads, no second copy in the page cache under the host tier")
    disk_read_workers: Int = Field(default=DEFAULT_READ_WORKERS, ge=1, le=256,
                                   description="parallel block reads (queue depth)")
    candidate_nodes: Int = Field(default=1, ge=1, le=8, description="tiered candidate nodes (several: G3 routes)")
    pool: Literal["none", "redis", "mooncake"] = Field(
        default="none", description="the shared pool the candidate nodes use, started by the harness on loopback")
    pool_capacity: str = Field(default="512MiB", description="the memory the harness's pool holds (redis "
                               "maxmemory, mooncake's segment); several nodes: sized to the fleet (gates/fleet.py)")

    _pool_size = field_validator("pool_capacity", mode="before")(lambda cls, v: size_text(v))


class TargetsConfig(StrictModel):
    kind: Literal["embedded", "external"] = Field(default="embedded", description=(
        "embedded: kvgate starts its own servers (recompute, device-only baseline, tiered candidate); external: the "
        "endpoints below, API keys read from the environment variables they name"))
    embedded: EmbeddedTargets = Field(default_factory=EmbeddedTargets, description="kvgate's own servers")
    baseline: Optional[TargetSettings] = Field(default=None, description=(
        "external: the baseline's endpoint and engine (the serving stack without the tiered cache)"))
    candidate: Optional[TargetSettings] = Field(default=None, description=(
        "external: the candidate's endpoint and engine (the serving stack with the tiered cache)"))
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


class G1Config(StrictModel):
    _declared = _thresholds_of("g1")

    thresholds: list[RuleField] = Field(description="each {metric, op, value}, or a band {metric, min, max}")


class NoReuseConfig(StrictModel):
    """G2's no-reuse control (gates/g2_baseline/test_g2_no_reuse.py): what offload costs when no prefix
    comes back, unique prompts sent one at a time to the candidate and the baseline in alternating pairs."""

    enabled: bool = Field(default=True, description="run it")
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

    _contexts_once = field_validator("contexts")(lambda cls, v: each_once(v, "context"))
    rounds: RoundsConfig = Field(default_factory=RoundsConfig, description=(
        "rounds of every context and tier, one request at a time, each figure their median: a number, or {min, max, "
        "budget_s} (after min, more rounds of a context while they fit budget_s: short contexts repeat more)"))
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
    thresholds: list[RuleField] = Field(description="each {metric, op, value}, or a band {metric, min, max}")


NO_REUSE_WORKLOAD = {"kind": "random", "name": "no-reuse", "requests": 1000,
                     "input_tokens": {"distribution": "uniform", "min": 512, "max": 2048},
                     "output_tokens": {"distribution": "fixed", "mean": 32}}


class G3NoReuseConfig(StrictModel):
    """G3's no-reuse control (gates/g3_main/test_g3_no_reuse.py): one closed-loop level of prompts that
    share no prefix, baseline then candidate, unprimed; each request is sent once (a workload a step
    would cycle through voids the control: its cached tokens say so)."""

    enabled: bool = Field(default=True, description="run it")
    workload: WorkloadField = Field(default_factory=lambda: load_spec(NO_REUSE_WORKLOAD),
                                    description="a workload with no shared prefixes (kind: random)")
    level: Count = Field(default=4, ge=1, description="the concurrency the control runs at")
    duration_s: Optional[Float] = Field(default=None, gt=0, description="seconds per target (default g3.duration_s)")
    warmup_s: Optional[Float] = Field(default=None, ge=0, description="warm-up left out (default g3.warmup_s)")


# closed-loop users a G3 level may ask for at most (each a locust user of its own: more is no load this harness makes)
MAX_USERS = 100_000
# gates.yaml's earlier keys for G3's block pairs, each with the `g3.blocks` field it is, and G3's own defaults
FLAT_BLOCK_KEYS = {"min_blocks": "min", "max_blocks": "max", "level_budget_s": "budget_s"}
G3_BLOCKS = {"min": 3, "max": 5, "budget_s": None}


def fold_flat_block_keys(g3: Any, defaults: Optional[dict] = None) -> Any:
    """A g3 section whose earlier spelling of its block pairs (`min_blocks`, `max_blocks`, `level_budget_s`) is
    read as `blocks`' min, max and budget_s, over `defaults`; ValueError when both spellings are given."""
    if not isinstance(g3, dict) or not any(key in g3 for key in FLAT_BLOCK_KEYS):
        return g3
    given = {FLAT_BLOCK_KEYS[key]: g3[key] for key in FLAT_BLOCK_KEYS if key in g3}
    if "blocks" in g3:
        raise ValueError(f"blocks: expected either blocks or {', '.join(k for k in FLAT_BLOCK_KEYS if k in g3)} (its "
                         "earlier spelling), found both")
    rest = {key: item for key, item in g3.items() if key not in FLAT_BLOCK_KEYS}
    return rest | {"blocks": (defaults or {}) | given}


class G3Config(StrictModel):
    """G3's sweep. `replay` says what a level is: closed_loop, concurrent users (every workload);
    rate_multipliers, multiples of a trace's arrival rate (trace workloads; needs `ttft_slo_ms`)."""

    _declared = _thresholds_of("g3")

    workload: WorkloadField = Field(description="a workload spec (see workloads/specs)")
    replay: Literal["closed_loop", "rate_multipliers"] = Field(
        default="closed_loop", description="closed_loop: levels are concurrencies; rate_multipliers (a trace): "
        "levels multiply the trace's arrival rate, open loop")
    levels: list[Level] = Field(min_length=1, description="concurrencies, or rate multipliers")
    ttft_slo_ms: Optional[Float] = Field(examples=[2000],
        default=None, gt=0, description="rate_multipliers: a target sustains a rate while its TTFT p90 (from the "
        "scheduled arrival) is within this")
    duration_s: Float = Field(gt=0, description="seconds a baseline block lasts, about: each level runs pairs of "
                              "blocks of baseline and candidate in turn, ABBA..., both blocks of a pair serving the "
                              "same requests (the slice the baseline serves in about this long)")
    warmup_s: Float = Field(ge=0, description="seconds of a block left out, from its first request sent, where "
                            "blocks run by time (the no-reuse control's default); matched pairs are measured from "
                            "their first request, after the level's warm-up pairs (steady)")
    steady: G3SteadyConfig = Field(default_factory=G3SteadyConfig, description="when a level's warm-up pairs end")
    blocks: PairsConfig = Field(default_factory=lambda: PairsConfig.model_validate(G3_BLOCKS), description=(
        "block pairs per level, after its warm-up pairs: at least `min`, then more until the interval decides every "
        "rule of the level, at most `max`, none started once the level has run `budget_s` (null: no limit)"))
    min_requests: Count = Field(default=10, ge=1, description="completed requests a block needs to be valid")
    max_error_share: Float = Field(default=0.01, ge=0, lt=1, description=(
        "a block (and a no-reuse control step) whose measured requests failed more than this share is invalid"))
    prime: bool = Field(default=True, description="send each target every session's first turn (a trace: its "
                        "warm-up requests) before the sweep")
    no_reuse: G3NoReuseConfig = Field(default_factory=G3NoReuseConfig)
    capacity: G3CapacityConfig = Field(default_factory=G3CapacityConfig, description=(
        "the most users each target serves within `slo`, searched, and the candidate's gain in it"))
    thresholds: list[RuleField] = Field(description="each {metric, op, value}, or a band {metric, min, max}")

    @model_validator(mode="after")
    def _no_reuse_step_fits(self) -> "G3Config":
        control = self.no_reuse
        duration = control.duration_s if control.duration_s is not None else self.duration_s
        warmup = control.warmup_s if control.warmup_s is not None else self.warmup_s
        if warmup >= duration:
            raise ValueError(f"no_reuse.warmup_s: expected less than its duration ({duration:g} s), found {warmup:g}")
        if control.workload.kind != "random":
            raise ValueError("no_reuse.workload.kind: expected random (prompts that share no prefix), found "
                             f"{control.workload.kind!r}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _flat_block_keys(cls, value: Any) -> Any:
        return fold_flat_block_keys(value, G3_BLOCKS)

    @model_validator(mode="after")
    def _warmup_within_the_step(self) -> "G3Config":
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: expected less than duration_s ({self.duration_s:g}), found {self.warmup_s:g}")
        return self

    @model_validator(mode="after")
    def _levels_mean_the_replay(self) -> "G3Config":
        twice = repeated(self.levels)
        if twice:
            raise ValueError(f"levels: expected each level once, found {twice} repeated")
        if self.replay == "closed_loop":
            bad = [v for v in self.levels if not isinstance(v, int) or not 1 <= v <= MAX_USERS]
            if bad:
                raise ValueError(f"levels: expected concurrencies (integers in 1..{MAX_USERS:,}) for replay: "
                                 f"closed_loop, found {bad}")
            return self
        if self.workload.kind != "trace":
            raise ValueError("workload.kind: expected a trace workload (kind: trace) for replay: rate_multipliers, "
                             "found "
                             f"{self.workload.kind!r}")
        bad = [v for v in self.levels if v <= 0]
        if bad or sorted(self.levels) != self.levels:
            raise ValueError(f"levels: expected rate multipliers (numbers > 0, ascending) for replay: "
                             f"rate_multipliers, found {self.levels}")
        if self.ttft_slo_ms is None:
            raise ValueError("ttft_slo_ms: expected the TTFT objective a sustained rate meets for replay: "
                             "rate_multipliers, found nothing")
        return self


# the only checks a profile may measure without judging: a quick soak cannot power a latency or throughput trend
UnpoweredDrift = Literal["ttft_p99_drift_fraction", "throughput_drift_fraction"]
UNPOWERED_DRIFT: tuple[str, ...] = get_args(UnpoweredDrift)


class G4Config(StrictModel):
    _declared = _thresholds_of("g4")

    workload: WorkloadField = Field(description="a workload spec (see workloads/specs)")
    duration_s: Float = Field(gt=0, description="seconds the soak runs")
    window_s: Float = Field(ge=1, description="seconds per window (at least 1: a window is a sample of the load)")
    concurrency: Count = Field(ge=1, description="closed-loop users through the soak")
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
    measured_only: list[UnpoweredDrift] = Field(default_factory=list, description=(
        "the latency and throughput drift checks a soak too short to power them measures without judging, saying "
        "the windows each would need (the quick profile's 2 minutes); the full profile judges everything"))
    faults: list[FaultSpec] = Field(default_factory=list, description=(
        "the fault schedule (the embedded candidate, or vLLM with kvgate's connector)"))
    thresholds: list[RuleField] = Field(description="each {metric, op, value}, or a band {metric, min, max}")

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


class GatesConfig(StrictModel):
    profile: ProfileName = Field(default="quick", description=(
        "quick: the embedded default, every gate in minutes on a small machine; full: a real joint test (G4 soaks "
        "for 72 hours)"))
    aa: bool = Field(default=False, description=(
        "A/A mode (`kvgate run --aa`): the candidate against itself, so nothing differs (G2: the storage's best "
        "job on both sides of each pair); the run reports how many intervals excluded the null (the harness's own "
        "false decisions)"))
    targets: TargetsConfig = Field(default_factory=TargetsConfig, description="what is tested: kvgate's embedded "
                                   "servers, or external endpoints (a baseline, a candidate, a recompute reference)")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="the storage under test")
    inventory: InventoryConfig = Field(default_factory=InventoryConfig, description=(
        "G1: what the order says the machine has; a key left out skips its check"))
    fio: FioConfig = Field(default_factory=FioConfig, description=(
        "G1's fio matrix: sequential read and write of 1 MiB, random read and write of 4 KiB, mixed 70/30"))
    slo: Optional[SLOConfig] = Field(default=None, description=(
        "the service-level objective (TTFT and TPOT at a percentile, errors) G3's capacity search holds loads to"))
    g1: G1Config = Field(description="G1, arrival: the inventory and fio's baselines against the spec sheet")
    g2: G2Config = Field(description=(
        "G2, single-node baseline: recompute against hits per tier, cold reads, model loading and checkpoints "
        "against the storage's best"))
    g3: G3Config
    g4: G4Config = Field(description=(
        "G4, stability: a soak under load with drift, leaks and consistency under injected faults"))
    sizing: SizingConfig = Field(default_factory=SizingConfig)
    claims: list[Claim] = Field(default_factory=lambda: [Claim(**c) for c in DEFAULT_CLAIMS], description=(
        "the vendor's figures, each beside what the run measured (kvcore/claims.py); default: the seed playbook's"))

    @field_validator("claims")
    @classmethod
    def _claims_once(cls, claims: list[Claim]) -> list[Claim]:
        twice = repeated([c.id for c in claims])
        if twice:
            raise ValueError(f"expected each claim id once, found {twice} repeated")
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
    """`override` over `base`, section by section; a workload over one of its own kind (or naming none) changes the
    fields it gives, a workload of another kind replaces it whole."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        here = merged.get(key)
        if isinstance(value, dict) and isinstance(here, dict) and key != "workload":
            merged[key] = _merge(here, value)
        elif isinstance(value, dict) and isinstance(here, dict) and value.get("kind", here.get("kind")) == here.get(
                "kind"):
            merged[key] = {**here, **copy.deepcopy(value)}    # a workload over one of its kind: the fields it gives
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
    if isinstance(data.get("g3"), dict):
        try:
            data["g3"] = fold_flat_block_keys(data["g3"])
        except ValueError as error:
            raise ConfigError(f"g3.{error}") from None
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
    for gate in ("g3", "g4"):  # a trace's file read now, before any server starts
        spec = getattr(config, gate).workload
        if isinstance(spec, TraceSpec):
            check_trace(spec, f"{gate}.workload")
            if gate == "g3":
                _trace_fills_every_block(config.g3, spec)
    return config


def _trace_fills_every_block(g3: G3Config, spec: TraceSpec) -> None:
    """A trace's measured requests are cut into one part per level and each part into one sub-part per block pair
    (warm-up pairs included): every sub-part must hold `g3.min_requests`, or no block of it can be valid."""
    path = check_trace_path(spec, "g3.workload")
    records = len(read_trace(path, None if spec.limit is None else spec.warmup_requests + spec.limit))
    measured = records - spec.warmup_requests
    blocks = len(g3.levels) * pairs_at_most(g3.blocks.max, g3.steady.rule())
    needed = blocks * g3.min_requests
    if measured < needed:
        raise ConfigError(
            f"g3.workload: expected a trace with at least {needed} measured requests ({len(g3.levels)} levels x "
            f"{blocks // len(g3.levels)} block pairs (blocks.max {g3.blocks.max} + {g3.steady.max_pairs} warm-up) x "
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
