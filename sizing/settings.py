"""gates.yaml's `sizing` section: where the sizing model's constants come from before a run has measured them,
its tolerances, and what it needs of the target that the target does not tell. Composed by gates/config.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvcore.rules import Rule
from kvcore.sampling import PairsConfig
from kvcore.settings import MAX_COUNT, ConfigError, Count, Float, Int, StrictModel, absolute_path, size_text
from sizing.layout import KVShape
from workloads.loadgen.settings import G3CapacityConfig, G3SteadyConfig, SLOConfig
from workloads.storage.settings import CheckpointConfig, ModelLoadConfig
from workloads.traffic.datasets import WorkloadSpec
from workloads.traffic.routing import Routing


class TargetSizing(StrictModel):
    """What the sizing model needs of the target under test that kvgate cannot read from it: the model's KV
    layout, the block size and each tier's capacity (an external engine's; for the embedded one they
    replace what targets.embedded gives). The candidate has every tier given; the baseline the device only.
    `model_config` is pydantic's own name, so the field is `model_config_path`, read as `model_config`."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True, protected_namespaces=())

    model_config_path: Optional[Path] = Field(
        examples=["/models/Llama-3.1-70B/config.json"], default=None, alias="model_config", description=(
        "the model's Hugging Face config.json (its layers, KV heads, head dim, dtype; MLA: kv_lora_rank)"))
    kv_dtype: Optional[str] = Field(
        examples=["fp8"], default=None, description="the KV cache's dtype when not the model's (fp8)")
    kv_layout: Optional[dict] = Field(
        examples=[{"layers": 80, "dtype": "bf16", "kv_heads": 8, "head_dim": 128}], default=None, description=(
        "instead of model_config: {layers, dtype, kv_heads, head_dim} or, MLA, {layers, dtype, kv_lora_rank, "
        "qk_rope_head_dim}"))
    block_size: Optional[Count] = Field(
        examples=[16], default=None, ge=1, description="tokens per KV block (vLLM 16, kvgate 256)")
    device_kv_tokens: Optional[Count] = Field(examples=[500000], default=None, ge=1, description=(
        "tokens the device KV cache holds (vLLM: 'GPU KV cache size: N tokens'; SGLang: max_total_num_tokens)"))
    host_capacity: Optional[str] = Field(
        examples=["256GiB"], default=None, description="host DRAM tier bytes (0: none)")
    disk_capacity: Optional[str] = Field(examples=["4TB"], default=None, description="disk tier bytes (0: none)")
    pool_capacity: Optional[str] = Field(
        examples=["1TiB"], default=None, description="the shared pool's bytes (its store's memory)")
    pool_gbps: Optional[Float] = Field(
        examples=[5.0], default=None, gt=0, description="GB/s a node loads from the pool at")
    max_running: Optional[Count] = Field(examples=[256], default=None, ge=1, description=(
        "requests an engine runs at once (vLLM --max-num-seqs; default: targets.embedded.max_running)"))
    prefill_budget: Optional[Count] = Field(examples=[8192], default=None, ge=1, description=(
        "tokens of prompts an external engine prefills a step (vLLM --max-num-batched-tokens; default 2048, vLLM's "
        "CPU server's); kvgate's own engine prefills one block a step"))

    _sizes = field_validator("host_capacity", "disk_capacity", "pool_capacity", mode="before")(
        lambda cls, v: v if v is None else size_text(v))
    _paths = field_validator("model_config_path", mode="before")(lambda cls, v: v if v is None else absolute_path(v))

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

    device_tflops: Float = Field(
        examples=[400], gt=0, description="the device's achievable dense TFLOP/s (peak x utilisation)")
    params: Float = Field(
        examples=["8.03B"], gt=0, le=MAX_COUNT,
        description="the model's parameter count: 8.03e9, or 8.03B (K, M, B, T)")
    attention_dim: Count = Field(
        examples=[4096], ge=1, description="attention heads x head dim (4096 for Llama-3.1-8B)")
    layers: Optional[Count] = Field(examples=[32], default=None, ge=1, description="layers (default: the KV layout's)")
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
    figure_mape: Float = Field(default=0.15, gt=0, le=10,
                               description="largest G3 throughput MAPE (and, apart, TTFT p50 MAPE) it accepts")
    g2_ttft_mape: Float = Field(default=0.10, gt=0, le=10, description="largest G2 TTFT MAPE it accepts")

    _paths = field_validator("calibration", mode="before")(lambda cls, v: absolute_path(v))


class EmbeddedSection(Protocol):
    """What the sizing model reads of `targets.embedded` (gates.config.EmbeddedTargets)."""

    @property
    def preset(self) -> str: ...
    @property
    def max_running(self) -> int: ...
    @property
    def device_capacity_blocks(self) -> int: ...
    @property
    def host_capacity(self) -> str: ...
    @property
    def disk_capacity(self) -> str: ...
    @property
    def candidate_nodes(self) -> int: ...
    @property
    def pool(self) -> str: ...


class TargetsSection(Protocol):
    """What the sizing model reads of `targets` (gates.config.TargetsConfig)."""

    @property
    def kind(self) -> str: ...
    @property
    def embedded(self) -> EmbeddedSection: ...
    @property
    def candidate_nodes(self) -> list[str]: ...
    @property
    def routing(self) -> Routing: ...


class G2Section(Protocol):
    """What the sizing model reads of `g2` (gates.config.G2Config)."""

    @property
    def contexts(self) -> list[int]: ...
    @property
    def model_load(self) -> ModelLoadConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...


class G3Section(Protocol):
    """What the sizing model reads of `g3` (gates.config.G3Config): the sweep it simulates."""

    @property
    def workload(self) -> WorkloadSpec: ...
    @property
    def replay(self) -> str: ...
    @property
    def levels(self) -> Sequence[Union[int, float]]: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def warmup_s(self) -> float: ...
    @property
    def ttft_slo_ms(self) -> Optional[float]: ...
    @property
    def blocks(self) -> PairsConfig: ...
    @property
    def min_requests(self) -> int: ...
    @property
    def prime(self) -> bool: ...
    @property
    def steady(self) -> G3SteadyConfig: ...
    @property
    def capacity(self) -> G3CapacityConfig: ...


class SizedRun(Protocol):
    """A validated gates.yaml, as far as the sizing model reads it (gates.config.GatesConfig satisfies it)."""

    @property
    def targets(self) -> TargetsSection: ...
    @property
    def g2(self) -> G2Section: ...
    @property
    def g3(self) -> G3Section: ...
    @property
    def slo(self) -> Optional[SLOConfig]: ...
    @property
    def sizing(self) -> SizingConfig: ...

    def rule(self, gate: str, metric: str) -> Optional[Rule]: ...
